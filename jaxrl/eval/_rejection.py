"""Rejection sampling for SFT (DeepSeek-R1's stage 3): ``k`` samples per prompt from the engine, the ones a
reward accepts, deduplicated and optionally capped per prompt, written as an SFT data set with its statistics.

Sampling and scoring are :func:`jaxrl.eval.evaluate`'s (same records, so a run resumes from its records); the
selection is a pure function of the records and is recomputed from all of them at the end of every run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl import envs, rewards
from jaxrl.eval._run import EvalSettings, evaluate
from jaxrl.rl import EncodedPrompts

DATASET = "sft.jsonl"
"""The SFT data set in the output directory: one ``messages`` record per kept sample (``jaxrl sft`` reads it)."""
STATS = "stats.json"
"""The selection's statistics in the output directory."""
STATS_MD = "stats.md"
"""The statistics as a markdown table in the output directory."""


def normalize_whitespace(text: str) -> str:
  """``text`` with runs of whitespace folded to one space and the ends stripped: the key duplicates share."""
  return " ".join(text.split())


def select_samples(records: Sequence[dict[str, Any]], *, keep_per_prompt: int | None = None,
                   keep_truncated: bool = False) -> tuple[list[list[int]], dict[str, Any]]:
  """The samples to keep of each record (:func:`jaxrl.eval.evaluate`'s, with ``responses``) and the counts.

  A sample is kept when it is correct (reward above the threshold), not truncated (finish reason ``length``;
  unless ``keep_truncated``), not blank, not a duplicate of an earlier such sample of the same prompt (text
  equal after :func:`normalize_whitespace`) and among the first ``keep_per_prompt`` distinct ones.

  Returns:
    per record, the kept sample indices in sample order; and the statistics (``prompts``, ``samples``,
    ``accepted``, ``acceptance_rate``, ``truncated``, ``dropped_truncated``, ``dropped_empty``,
    ``duplicates_removed``, ``capped``, ``kept``, ``prompts_with_kept``, ``mean_kept_tokens``).
  """
  if keep_per_prompt is not None and keep_per_prompt < 1:
    raise ValueError(f"keep_per_prompt must be >= 1 or None, got {keep_per_prompt}")
  counts = dict.fromkeys(("samples", "accepted", "truncated", "dropped_truncated", "dropped_empty",
                          "duplicates_removed", "capped"), 0)
  kept, kept_tokens = [], []
  for rec in records:
    if "responses" not in rec:
      raise ValueError(f"record of line {rec['line']} has no responses (written with keep_text=False)")
    seen, mine = set(), []
    for s, (ok, reason, text) in enumerate(zip(rec["correct"], rec["finish_reasons"], rec["responses"])):
      counts["samples"] += 1
      counts["truncated"] += reason == "length"
      if not ok:
        continue
      counts["accepted"] += 1
      key = normalize_whitespace(text)
      if reason == "length" and not keep_truncated:
        counts["dropped_truncated"] += 1
      elif not key:
        counts["dropped_empty"] += 1
      elif key in seen:
        counts["duplicates_removed"] += 1
      elif keep_per_prompt is not None and len(mine) >= keep_per_prompt:
        counts["capped"] += 1
      else:
        mine.append(s)
        kept_tokens.append(rec["response_tokens"][s])
      seen.add(key)
    kept.append(mine)
  stats = {"prompts": len(records), **counts,
           "acceptance_rate": counts["accepted"] / counts["samples"] if counts["samples"] else 0.0,
           "kept": len(kept_tokens), "prompts_with_kept": sum(bool(k) for k in kept),
           "mean_kept_tokens": float(np.mean(kept_tokens)) if kept_tokens else 0.0}
  return kept, stats


def sft_record(problem: dict[str, Any], record: dict[str, Any], sample: int) -> dict[str, Any]:
  """One SFT record: the prompt's messages (as the model saw them, template applied; assistant turns of the
  prompt not trained) and the sample as the trained assistant turn, with its ``id``, ``line`` and ``reward``."""
  messages = [m if m["role"] != "assistant" else {**m, "train": False} for m in envs.prompt_messages(problem)]
  return {"messages": [*messages, {"role": "assistant", "content": record["responses"][sample]}],
          "id": record["id"], "line": record["line"], "reward": record["rewards"][sample]}


def write_dataset(path: str | Path, problems: EncodedPrompts, records: Sequence[dict[str, Any]],
                  kept: Sequence[Sequence[int]]) -> Path:
  """Writes the kept samples as SFT records (:func:`sft_record`), problem by problem; returns the path."""
  path = Path(path)
  with open(path, "w", encoding="utf-8") as f:
    for problem, record, samples in zip(problems.records, records, kept):
      for s in samples:
        f.write(json.dumps(sft_record(problem, record, s)) + "\n")
  return path


def stats_markdown(stats: dict[str, Any]) -> str:
  """The statistics as a markdown table."""
  s = stats
  rows = ["| rejection sampling | value |", "| --- | ---: |",
          f"| prompts (skipped: too long) | {s['prompts']} ({s['skipped_prompts']}) |",
          f"| samples | {s['samples']} |",
          f"| accepted (reward > {s['correct_threshold']}) | {s['accepted']} |",
          f"| acceptance rate | {100 * s['acceptance_rate']:.2f} % |",
          f"| truncated (finish: length; accepted ones dropped) | {s['truncated']} ({s['dropped_truncated']}) |",
          f"| blank responses dropped | {s['dropped_empty']} |",
          f"| duplicates removed | {s['duplicates_removed']} |",
          f"| over --keep-per-prompt | {s['capped']} |",
          f"| kept | {s['kept']} |",
          f"| prompts with >= 1 kept | {s['prompts_with_kept']} |",
          f"| mean kept length (tokens) | {s['mean_kept_tokens']:.1f} |"]
  return "\n".join(rows)


def rejection_sample(sampler, scorer: rewards.RewardRunner, problems: EncodedPrompts, settings: EvalSettings,
                     out_dir: str | Path, *, keep_per_prompt: int | None = None, keep_truncated: bool = False,
                     chunk: int = 8, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
  """Samples ``settings.n`` completions per problem not yet recorded in ``out_dir`` (:func:`jaxrl.eval.evaluate`:
  records appended per chunk, progress and ETA, resumable), then selects (:func:`select_samples`) over all
  records and writes ``sft.jsonl``, ``stats.json`` and ``stats.md`` in ``out_dir``.

  The selection options are not sampling settings: a rerun with another ``keep_per_prompt`` reuses the records.

  Returns:
    the statistics (``stats.json``): :func:`select_samples`' counts, ``skipped_prompts``, ``samples_per_prompt``,
    ``correct_threshold``, ``keep_per_prompt``, ``keep_truncated``, ``dataset`` (its path) and ``run_info``.
  """
  out_dir = Path(out_dir)
  records = evaluate(sampler, scorer, problems, settings, out_dir, chunk=chunk, keep_text=True, run_info=run_info,
                     desc="rs")
  kept, counts = select_samples(records, keep_per_prompt=keep_per_prompt, keep_truncated=keep_truncated)
  path = write_dataset(out_dir / DATASET, problems, records, kept)
  stats = {**counts, "skipped_prompts": int(problems.skipped), "samples_per_prompt": settings.n,
           "correct_threshold": settings.correct_threshold, "keep_per_prompt": keep_per_prompt,
           "keep_truncated": keep_truncated, "dataset": str(path), **(run_info or {})}
  (out_dir / STATS).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
  (out_dir / STATS_MD).write_text(stats_markdown(stats) + "\n", encoding="utf-8")
  return stats
