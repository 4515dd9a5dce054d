"""Vision-R1's cold-start set by modality bridging (shared/seeds/004, Vision-R1 "第一步"): ``jaxrl
vision-r1-coldstart``.

For each (image, question, answer): (1) a multimodal model sees the image and writes a "pseudo-CoT" — a
detailed description of what the question needs and a first reasoning; (2) a text reasoning model (DeepSeek-R1
in the paper), which never sees the image, reasons again from the question, the description and the draft,
and answers as ``<think>…</think>`` then the final answer; (3) the result is kept only if Vision-R1's hard
formatting result reward gives 1 (valid format and the reference answer); (4) it is written as an SFT chat
record paired with the original image, content parts ``{"type": "image", "image": path}`` and
``{"type": "text", "text": question}`` in the user turn (jaxrl's vision-language chat data).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from jaxrl import data as data_lib
from jaxrl import rewards
from jaxrl.eval._vlrl_io import image_part, markdown_table, ordered_map, read_image_records, write_outputs

__all__ = ["BRIDGE_TEMPLATE", "ColdStartConfig", "PSEUDO_COT_TEMPLATE", "build_cold_start", "cold_start_file"]

PSEUDO_COT_TEMPLATE = ("Question: {question}\n\nFirst describe the image in detail: every object, label, number, "
                       "length, angle and relation the question may need. Then reason step by step toward the "
                       "answer.")
BRIDGE_TEMPLATE = ("You cannot see the image, but here is a detailed description of it and a draft reasoning "
                   "written by someone who could.\n\nDescription and draft:\n{pseudo_cot}\n\nQuestion: {question}"
                   "\n\nThink it through carefully inside <think> </think>, checking the draft against the "
                   "description, then give the final answer after </think> as \\boxed{{...}}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColdStartConfig:
  """Prompts and sampling of the two models, the filter, and what the SFT record holds."""

  pseudo_cot_template: str = PSEUDO_COT_TEMPLATE
  """To the multimodal model, with the image; formatted with ``question``."""
  bridge_template: str = BRIDGE_TEMPLATE
  """To the reasoning model; formatted with ``question`` and ``pseudo_cot``."""
  mllm_max_tokens: int = 2048
  reasoner_max_tokens: int = 8192
  temperature: float = 0.6
  seed: int = 0
  reward: rewards.HardFormatConfig = dataclasses.field(default_factory=rewards.HardFormatConfig)
  """The filter: Vision-R1's hard format + result rule against the record's ``answer``."""
  image_field: str = "image"
  workers: int = 8


def _reasoning_text(reply: str) -> str:
  """A reasoner's answer with the ``<think>`` opening restored when its template opened it in the prompt
  (R1-distilled servers answer ``… </think> answer``)."""
  text = reply.strip()
  if "</think>" in text and not text.startswith("<think>"):
    text = "<think>\n" + text
  return text


def _one(rec: dict[str, Any], mllm, reasoner, cfg: ColdStartConfig) -> dict[str, Any]:
  where, question = rec["_where"], rec["question"]
  if not isinstance(question, str) or not question.strip():
    raise data_lib.DataError(f"{where}: 'question' must be a non-empty string")
  part = image_part(rec["_image_path"], where=where)
  ask = [{"role": "user", "content": [part, {"type": "text", "text": cfg.pseudo_cot_template.format(question=question)}]}]
  pseudo = mllm(ask, max_tokens=cfg.mllm_max_tokens, temperature=cfg.temperature, seed=cfg.seed)
  bridge = cfg.bridge_template.format(question=question, pseudo_cot=pseudo.strip())
  reply = reasoner([{"role": "user", "content": bridge}], max_tokens=cfg.reasoner_max_tokens,
                   temperature=cfg.temperature, seed=cfg.seed)
  text = _reasoning_text(reply)
  r = rewards.hard_format_reward(question, text, answer=rec["answer"], config=cfg.reward)
  record = None
  if r.value == cfg.reward.correct_value:
    user = [{"type": "image", "image": rec[cfg.image_field]}, {"type": "text", "text": question}]
    record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}],
              "answer": rec["answer"], "source": where}
  return {"record": record, "reason": r.info["reason"], "words": len(text.split())}


def build_cold_start(records: list[dict[str, Any]], *, mllm: Any, reasoner: Any,
                     config: ColdStartConfig | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The SFT records of the examples (``image``, ``question``, ``answer``) whose bridged reasoning passes the
  hard reward, in input order; and the counts. `mllm` must accept ``image_url`` parts; both are
  `jaxrl.rewards.as_chat` specs."""
  cfg = config or ColdStartConfig()
  m, rsn = rewards.as_chat(mllm), rewards.as_chat(reasoner)
  results = ordered_map(lambda r: _one(r, m, rsn, cfg), records, workers=cfg.workers)
  rows = [res["record"] for res in results if res["record"] is not None]
  reasons = Counter(res["reason"] for res in results)
  kept_words = [res["words"] for res in results if res["record"] is not None]
  stats = {"examples": len(records), "kept": len(rows), "keep_rate": len(rows) / len(records) if records else 0.0,
           "format_fail": sum(v for k, v in reasons.items() if k.startswith("format:")),
           "wrong_answer": reasons.get("wrong_answer", 0) + reasons.get("answer_too_long", 0),
           "no_answer": reasons.get("no_answer", 0), "reasons": dict(reasons),
           "mean_kept_words": float(np.mean(kept_words)) if kept_words else 0.0}
  return rows, stats


def stats_table(s: dict[str, Any]) -> str:
  """The builder's counts as a markdown table."""
  return markdown_table("vision-r1-coldstart", [
    ("examples", s["examples"]), ("dropped: format invalid", s["format_fail"]),
    ("dropped: wrong answer", s["wrong_answer"]), ("dropped: no answer found", s["no_answer"]),
    ("kept (hard reward = 1)", s["kept"]), ("keep rate", s["keep_rate"]),
    ("mean kept length (words)", s["mean_kept_words"])])


def cold_start_file(data: str, out: str, *, mllm: Any, reasoner: Any,
                    config: ColdStartConfig | None = None) -> dict[str, Any]:
  """`build_cold_start` over a JSONL file, written to `out` (SFT chat records) with its statistics."""
  cfg = config or ColdStartConfig()
  records = read_image_records(data, ("image", "question", "answer"))
  rows, stats = build_cold_start(records, mllm=mllm, reasoner=reasoner, config=cfg)
  return {**stats, "paths": write_outputs(out, rows, stats, stats_table(stats))}
