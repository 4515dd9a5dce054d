"""CapRL's QA curation (shared/seeds/004, CapRL "QA Curation"; the authors' README thresholds): keep a question
only if a vision model answers it *with* the image (visual accuracy > 0.75) and a text LLM cannot answer it
*without* the image (text accuracy < 0.25), both over shuffled rounds with the first-letter rule
(`jaxrl.rewards.question_accuracy`). A question answerable from its own wording would reward a caption for
nothing; one the vision model cannot answer is likely wrong. ``jaxrl caprl-curate`` runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl import rewards
from jaxrl.eval._vlrl_io import image_part, markdown_table, ordered_map, public, read_image_records, write_outputs

__all__ = ["CurateConfig", "curate_questions", "curate_file"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurateConfig:
  """Thresholds and sampling of the curation."""

  visual_min: float = 0.75
  """Keep only questions with visual accuracy strictly above this."""
  text_max: float = 0.25
  """Keep only questions with text-only accuracy strictly below this."""
  rounds: int = 4
  temperature: float = 0.6
  max_tokens: int = 8
  seed: int = 0
  template: str = rewards.CAPRL_QUESTION_TEMPLATE
  workers: int = 8


def _score(rec: dict[str, Any], vision, text, cfg: CurateConfig) -> list[dict[str, Any]]:
  qs = rewards.parse_questions(rec["questions"], f"{rec['_where']}: questions")
  part = image_part(rec["_image_path"], where=rec["_where"])
  c = rewards.CapRLConfig(rounds=cfg.rounds, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
  out = []
  for q in qs:
    v, _ = rewards.question_accuracy(vision, q, prompt=cfg.template, cfg=c, image_part=part)
    t, _ = rewards.question_accuracy(text, q, prompt=cfg.template, cfg=c)
    out.append({"question": q.question, "options": list(q.options), "answer": chr(ord("A") + q.answer),
                "visual_acc": v, "text_acc": t})
  return out


def curate_questions(records: list[dict[str, Any]], *, vision: Any, text: Any,
                     config: CurateConfig | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The records (from `read_image_records`, with ``image`` and ``questions``) with only their kept questions,
  each annotated with ``visual_acc`` and ``text_acc``, records left without a question omitted (counted); and
  the counts. `vision` must accept ``image_url`` parts; both are `jaxrl.rewards.as_chat` specs."""
  cfg = config or CurateConfig()
  vchat, tchat = rewards.as_chat(vision), rewards.as_chat(text)
  scored = ordered_map(lambda r: _score(r, vchat, tchat, cfg), records, workers=cfg.workers)
  kept_rows = []
  n = dict.fromkeys(("questions", "kept", "dropped_visual", "dropped_text", "dropped_both"), 0)
  for rec, qs in zip(records, scored):
    keep = []
    for q in qs:
      n["questions"] += 1
      seen_ok, blind_ok = q["visual_acc"] > cfg.visual_min, q["text_acc"] < cfg.text_max
      if seen_ok and blind_ok:
        keep.append(q)
      else:
        n["dropped_both" if not (seen_ok or blind_ok) else "dropped_visual" if not seen_ok else "dropped_text"] += 1
    n["kept"] += len(keep)
    if keep:
      kept_rows.append({**public(rec), "questions": keep})
  stats = {"images": len(records), **n, "images_kept": len(kept_rows),
           "images_without_questions": len(records) - len(kept_rows),
           "keep_rate": n["kept"] / n["questions"] if n["questions"] else 0.0,
           "visual_min": cfg.visual_min, "text_max": cfg.text_max, "rounds": cfg.rounds}
  return kept_rows, stats


def stats_table(s: dict[str, Any]) -> str:
  """The curation counts as a markdown table."""
  return markdown_table("caprl-curate", [
    ("images", s["images"]), ("questions", s["questions"]),
    (f"kept (visual acc > {s['visual_min']}, text acc < {s['text_max']})", s["kept"]),
    ("dropped: vision model fails with the image", s["dropped_visual"]),
    ("dropped: answerable without the image", s["dropped_text"]), ("dropped: both", s["dropped_both"]),
    ("keep rate", s["keep_rate"]), ("images kept", s["images_kept"]),
    ("images left without a question (omitted)", s["images_without_questions"])])


def curate_file(data: str, out: str, *, vision: Any, text: Any, config: CurateConfig | None = None) -> dict[str, Any]:
  """`curate_questions` over a JSONL file, written to `out` with its statistics (`write_outputs`)."""
  records = read_image_records(data, ("image", "questions"))
  rows, stats = curate_questions(records, vision=vision, text=text, config=config)
  return {**stats, "paths": write_outputs(out, rows, stats, stats_table(stats))}
