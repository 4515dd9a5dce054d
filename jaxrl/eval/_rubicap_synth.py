"""RubiCap's rubric synthesis (shared/seeds/004, RubiCap "Automated Rubric Synthesis"), offline, before RL:
``jaxrl rubicap-rubrics``.

Per image, a rubric-writer LLM reads the teacher committee's captions and the current student's caption and
answers JSON: the facts at least two teachers state (each with the supporting teachers and a quote from
each), and a binary, checkable rubric for each such fact the student gets wrong or leaves out, with its
severity. The consensus rule is then checked deterministically (`jaxrl.rewards.parse_rubric_reply`: a teacher
supports a rubric only if its quote occurs in that teacher's caption; >= 2 teachers). With a ``judge``, each
surviving rubric is also checked on the student's own caption and dropped when the student already meets
it (rubrics are for failures only). Severity weights: critical 3.0, important 2.0, minor 1.0.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from jaxrl import data as data_lib
from jaxrl import rewards
from jaxrl.eval._vlrl_io import image_part, markdown_table, ordered_map, public, read_image_records, write_outputs

__all__ = ["RUBRIC_WRITER_TEMPLATE", "SynthConfig", "synthesize_file", "synthesize_rubrics"]

RUBRIC_WRITER_TEMPLATE = """You write grading rubrics for an image caption.

Captions of the image by {n} teacher models:
{teachers}

The student's caption:
{student}

1. Find the facts (objects, attributes, text, counts, spatial relations, context) that at least two teachers
state. Ignore what only one teacher says.
2. Compare the student's caption with those facts. Find only the student's real failures: a fact it gets
wrong, hallucinates against, or leaves out.
3. For each failure write one binary, checkable criterion a grader can answer yes or no from a caption alone,
with a severity: "critical" (wrong or missing main object, hallucinated major element, missing key
relation), "important" (missing secondary object, wrong attribute or spatial relation) or "minor" (detail,
clarity, wording). Write nothing for what the student already does well.

Answer only JSON: {{"rubrics": [{{"criterion": "...", "severity": "critical|important|minor",
"support": [{{"teacher": <number>, "quote": "<words copied from that teacher's caption>"}}, ...]}}]}}"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthConfig:
  """The writer's prompt and sampling, the consensus threshold and the student check."""

  min_support: int = 2
  """Teachers that must state a rubric's fact (verified quotes)."""
  template: str = RUBRIC_WRITER_TEMPLATE
  """Formatted with ``n``, ``teachers`` (numbered captions) and ``student``."""
  max_tokens: int = 2048
  temperature: float = 0.0
  with_image: bool = False
  """Send the image to the writer too (an ``image_url`` part; the writer must accept images)."""
  on_error: str = "raise"
  """A writer answer that is not valid rubric JSON: ``raise`` (naming ``file:line``) or ``skip`` (counted)."""
  workers: int = 8

  def __post_init__(self):
    if self.on_error not in ("raise", "skip"):
      raise ValueError(f"on_error: {self.on_error!r} is not 'raise' or 'skip'")
    if self.min_support < 1:
      raise ValueError(f"min_support: must be >= 1, got {self.min_support!r}")


def _check(rec: dict[str, Any]) -> tuple[list[str], str]:
  where, teachers, student = rec["_where"], rec["teacher_captions"], rec["student_caption"]
  if not isinstance(teachers, list) or len(teachers) < 2 or not all(isinstance(t, str) and t.strip() for t in teachers):
    raise data_lib.DataError(f"{where}: 'teacher_captions' must list at least two non-empty captions")
  if not isinstance(student, str):
    raise data_lib.DataError(f"{where}: 'student_caption' must be a string")
  return teachers, student


def _one(rec: dict[str, Any], writer, judge: Any, cfg: SynthConfig) -> dict[str, Any]:
  teachers, student = _check(rec)
  listing = "\n".join(f"[{i}] {t}" for i, t in enumerate(teachers, start=1))
  text = cfg.template.format(n=len(teachers), teachers=listing, student=student)
  content: Any = text
  if cfg.with_image:
    content = [image_part(rec["_image_path"], where=rec["_where"]), {"type": "text", "text": text}]
  reply = writer([{"role": "user", "content": content}], max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                 seed=None)
  try:
    kept, counts = rewards.parse_rubric_reply(reply, teachers, min_support=cfg.min_support, where=rec["_where"])
  except ValueError as e:
    if cfg.on_error == "raise":
      raise data_lib.DataError(str(e)) from None
    return {"error": str(e)}
  met = []
  if judge is not None and kept:
    met = rewards.rubicap_reward("Describe the image.", student, rubrics=kept, judge=judge, mode="text").info["met"]
  failures = [r for r, m in zip(kept, met or [0.0] * len(kept)) if m < 0.5]
  return {"rubrics": failures, **counts, "already_met": len(kept) - len(failures)}


def synthesize_rubrics(records: list[dict[str, Any]], *, writer: Any, judge: Any = None,
                       config: SynthConfig | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Per-image rubrics: each record (``teacher_captions``, ``student_caption``, optional ``image``) with a
  ``rubrics`` list of ``{criterion, severity, weight, teachers}``; and the counts. `writer` is a
  `jaxrl.rewards.as_chat` spec; `judge` (a judge config, optional) drops rubrics the student already meets."""
  cfg = config or SynthConfig()
  chat = rewards.as_chat(writer)
  results = ordered_map(lambda r: _one(r, chat, judge, cfg), records, workers=cfg.workers)
  rows, n, sev, errors = [], Counter(), Counter(), []
  for rec, res in zip(records, results):
    if "error" in res:
      errors.append(res["error"])
      continue
    for k in ("proposed", "unsupported", "already_met"):
      n[k] += res[k]
    sev.update(r["severity"] for r in res["rubrics"])
    rows.append({**public(rec), "rubrics": res["rubrics"]})
  kept = sum(len(r["rubrics"]) for r in rows)
  stats = {"images": len(records), "writer_errors": len(errors), "errors": errors[:20], "proposed": n["proposed"],
           "unsupported": n["unsupported"], "already_met": n["already_met"], "kept": kept,
           "severity": {k: sev.get(k, 0) for k in rewards.SEVERITY_WEIGHTS},
           "images_without_rubrics": sum(not r["rubrics"] for r in rows),
           "mean_rubrics_per_image": kept / len(rows) if rows else 0.0, "min_support": cfg.min_support}
  return rows, stats


def stats_table(s: dict[str, Any]) -> str:
  """The synthesis counts as a markdown table."""
  return markdown_table("rubicap-rubrics", [
    ("images", s["images"]), ("writer answers refused (skipped)", s["writer_errors"]),
    ("rubrics proposed", s["proposed"]), (f"dropped: fewer than {s['min_support']} teachers verified", s["unsupported"]),
    ("dropped: the student already meets it", s["already_met"]), ("kept", s["kept"]),
    *((f"kept {k}", v) for k, v in s["severity"].items()),
    ("images without rubrics", s["images_without_rubrics"]), ("mean rubrics per image", s["mean_rubrics_per_image"])])


def synthesize_file(data: str, out: str, *, writer: Any, judge: Any = None,
                    config: SynthConfig | None = None) -> dict[str, Any]:
  """`synthesize_rubrics` over a JSONL file, written to `out` with its statistics (`write_outputs`)."""
  records = read_image_records(data, ("teacher_captions", "student_caption"))
  rows, stats = synthesize_rubrics(records, writer=writer, judge=judge, config=config)
  return {**stats, "paths": write_outputs(out, rows, stats, stats_table(stats))}
