"""An evaluation run: problems from a JSONL file, ``n`` samples each, scored by a reward, per-problem records
written as it goes (and read back to resume), and the summary the metrics are reported from."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl import data as data_lib
from jaxrl import rewards, sampling, sharding, train
from jaxrl.config import ConfigError, from_dict
from jaxrl.rl import EncodedPrompts, EngineConfig, build_engine, read_records, reward_fields

RECORDS = "records.jsonl"
"""Per-problem records in the output directory (one JSON object a line, appended as problems finish)."""
SUMMARY = "summary.json"
"""The summary (metrics, settings, token counts, truncation rate) in the output directory."""
SETTINGS = "settings.json"
"""What a resumed run must match: sampling settings, task, model and data."""
BARRIER_TIMEOUT_S = 7 * 24 * 3600.0
"""How long a process that finished its share waits for the others (the shares are balanced, not equal)."""


def part_name(index: int, count: int) -> str:
  """The records file of process ``index`` of ``count`` in a multi-process run (merged into ``records.jsonl``
  by process 0 once every part is complete)."""
  return f"records.part-{index}-of-{count}.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings:
  """Sampling and scoring settings of a run; all of them go into the records' directory and the summary."""

  n: int = 16
  "Samples per problem."
  max_new_tokens: int = 1024
  "Most response tokens per sample (DeepScaleR reports at 32768)."
  max_prompt_tokens: int = 1024
  "Prompts longer than this (chat template included) are skipped and counted."
  temperature: float = 0.6
  "Sampling temperature (0: greedy)."
  top_p: float = 0.95
  "Nucleus sampling mass."
  top_k: int = 0
  "Top-k (0: off)."
  seed: int = 0
  "Base of the per-sample PRNG keys; a sample's draws depend on its problem's line and index only."
  stop_strings: tuple[str, ...] = ()
  "Strings that end a response."
  correct_threshold: float = 0.5
  "A sample is correct when its reward is above this (the RL trainer's ``reward.correct_threshold``)."

  def __post_init__(self):
    if self.n < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
      raise ValueError("n, max_new_tokens and max_prompt_tokens must be >= 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f"bad sampling settings: temperature={self.temperature}, top_p={self.top_p}, "
                       f"top_k={self.top_k}")


TASKS: dict[str, tuple[str | None, tuple[str, ...]]] = {"math": ("math", ("answer",)), "code": ("code", ("tests",)),
                                                      "custom": (None, ())}
"""Task -> (reward, the record fields it needs): math answers with math-verify (``jaxrl.rewards.math_reward``),
code with the sandbox (``jaxrl.rewards.code_reward``), custom with a reward named by its import path."""


def make_scorer(task: str, *, reward: str | None = None, require_think: bool = False, workers: int = 4,
                reward_kwargs: dict[str, Any] | None = None,
                runner: dict[str, Any] | None = None) -> rewards.RewardRunner:
  """The reward runner of ``task``: ``math`` scores the answer after ``</think>`` (``require_think``: a response
  without the think block is wrong, as in DeepScaleR's training reward), ``code`` runs the tests in the sandbox,
  ``custom`` loads ``reward`` (``module:function`` or a built-in name, bound to ``reward_kwargs``) as the RL
  trainer does; ``runner`` is a ``reward.runner`` mapping (:class:`jaxrl.rewards.RewardRunnerConfig`; default
  ``workers`` threads)."""
  if task not in TASKS:
    raise ValueError(f"task must be one of {'/'.join(TASKS)}, got {task!r}")
  config = (rewards.RewardRunnerConfig(workers=workers) if runner is None
            else from_dict(rewards.RewardRunnerConfig, runner, prefix="reward.runner"))
  if task == "custom":
    if not reward:
      raise ValueError("task custom needs a reward import path (--reward module:function)")
    return rewards.RewardRunner(reward, config=config, reward_kwargs=reward_kwargs or {})
  kwargs = {"config": rewards.MathRewardConfig(require_think=require_think)} if task == "math" else {}
  return rewards.RewardRunner(reward or TASKS[task][0], config=config, reward_kwargs=kwargs)


def make_sampler(model, tokenizer, *, max_len: int, backend: str = "engine", num_slots: int = 32,
                 block_size: int = 16, kv_cache_bytes: int | None = None, mesh=None, rules=None):
  """The rollout engine (:func:`jaxrl.rl.build_engine`, as the trainers build it) or, with ``backend="sampler"``,
  the whole-batch :class:`jaxrl.sampling.Sampler`, for rows of ``max_len`` tokens.

  Args:
    model, tokenizer: the model (placed on ``mesh``) and its tokenizer.
    max_len: prompt + response tokens per row.
    backend: ``engine`` or ``sampler``.
    num_slots, block_size: the engine's decode slots and KV cache slots per block.
    kv_cache_bytes: the engine's KV cache budget per device (``None``: enough blocks for every slot's full row).
    mesh, rules: where it runs and the logical-axis rules (``None``: one device).
  """
  if backend not in ("engine", "sampler"):
    raise ValueError(f"backend must be engine or sampler, got {backend!r}")
  if backend == "sampler":
    return sampling.Sampler(model, tokenizer, mesh=mesh, rules=rules, max_len=max_len)
  num_blocks = None if kv_cache_bytes else num_slots * (-(-max_len // block_size) + 1)
  settings = EngineConfig(num_slots=num_slots, block_size=block_size, kv_cache_bytes=kv_cache_bytes,
                          num_blocks=num_blocks)
  return build_engine(model, tokenizer, settings, max_len=max_len, mesh=mesh, rules=rules)


def load_problems(path: str | Path, tokenizer, *, max_prompt_tokens: int, prompt_field: str | None = None,
                  answer_field: str | None = None, template: str = "{prompt}",
                  required: Sequence[str] = (), images: data_lib.ImageConfig | None = None) -> EncodedPrompts:
  """The problems of a JSONL file, read as the RL trainer reads prompts (:func:`jaxrl.rl.read_records`: a bad
  line is a one-line error naming ``file:line``), encoded with the tokenizer's chat template.

  Args:
    path: the JSONL file.
    tokenizer: the model's tokenizer.
    max_prompt_tokens: longer prompts are skipped (counted in ``EncodedPrompts.skipped``).
    prompt_field: a column holding the prompt text (e.g. ``problem`` in MATH-500); default: ``prompt`` or
      ``messages`` as in RL data.
    answer_field: a column holding the reference answer, copied to ``answer`` (e.g. ``Answer`` in AIME 2024).
    template: format of a text prompt, with ``{prompt}`` (e.g. DeepScaleR's instruction after it).
    required: reward columns each record must hold (``answer`` for math, ``tests`` for code).
    images: a VLM's image processing for records with images (image parts, or an ``images`` list with
      ``<image>`` markers; paths relative to the file; default :class:`jaxrl.data.ImageConfig` ()).
  """
  records = read_records([path], check_prompt=False)
  for rec in records:
    where = rec["_where"]
    if prompt_field is not None:
      if not isinstance(rec.get(prompt_field), str):
        raise data_lib.DataError(f"{where}: needs a text field {prompt_field!r}; has keys {sorted(rec)}")
      rec["prompt"] = rec[prompt_field]
    if answer_field is not None:
      if answer_field not in rec:
        raise data_lib.DataError(f"{where}: needs the answer field {answer_field!r}; has keys {sorted(rec)}")
      rec["answer"] = rec[answer_field]
    if isinstance(rec.get("prompt"), str):
      if not rec["prompt"].strip():
        raise data_lib.DataError(f"{where}: 'prompt' is empty")
      rec["prompt"] = template.replace("{prompt}", rec["prompt"])  # not str.format: "\\boxed{}" stays
    elif "messages" not in rec and not isinstance(rec.get("prompt"), list):
      raise data_lib.DataError(f"{where}: record needs 'prompt' or 'messages' (or --prompt-field); "
                               f"has keys {sorted(rec)}")
    for key in required:
      if key not in rec:
        raise data_lib.DataError(f"{where}: the task needs the field {key!r}; has keys {sorted(rec)}")
  return EncodedPrompts(records, tokenizer, max_tokens=max_prompt_tokens, images=images)


def _line(rec: dict[str, Any]) -> int:
  """The problem's line in its file: its identity in the records (stable across resumes)."""
  return int(str(rec["_where"]).rsplit(":", 1)[1])


def request_id(rec: dict[str, Any]) -> int:
  """The sampler's request id of a problem: its line minus one, i.e. its 0-based position in a file without
  blank lines. With ``seed`` it fixes the problem's draws whatever the chunking or resuming, and equals the
  trainers' held-out evaluation (request ids ``0..P-1`` in file order), so ``--seed`` of the trainer's
  ``seed + 1`` reproduces its sampled held-out numbers (docs/eval.md)."""
  return _line(rec) - 1


def problem_id(rec: dict[str, Any]) -> str:
  """A record's own id (``id``, ``unique_id``, ``problem_id``, ``ID``, ``task_id``) or its ``file:line``."""
  for key in ("id", "unique_id", "problem_id", "ID", "task_id"):
    if key in rec:
      return str(rec[key])
  return str(rec["_where"])


def read_done(path: Path, *, repair: bool = True) -> dict[int, dict[str, Any]]:
  """Records already written, by line; a torn last line (a run killed mid-write) is dropped from the file
  (``repair``) or only ignored (``repair=False``: a file this process does not own)."""
  if not path.is_file():
    return {}
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  done: dict[int, dict[str, Any]] = {}
  for i, raw in enumerate(lines):
    try:
      rec = json.loads(raw)
    except json.JSONDecodeError:
      if i != len(lines) - 1:
        raise data_lib.DataError(f"{path}:{i + 1}: not a JSON record (only the last line may be torn)") from None
      if repair:
        path.write_text("".join(lines[:i]), encoding="utf-8")
      break
    done[int(rec["line"])] = rec
  return done


def _write_atomic(path: Path, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file and a rename: a reader sees the old or new file."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)


def check_settings(out_dir: Path, settings: dict[str, Any]) -> None:
  """Writes ``settings.json`` on a first run; a rerun in the same directory must match it (else the records
  of both would be mixed): :class:`jaxrl.config.ConfigError` names the settings that differ."""
  path = out_dir / SETTINGS
  if path.is_file():
    old = json.loads(path.read_text(encoding="utf-8"))
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
      raise ConfigError(f"{out_dir} holds records made with other settings ({', '.join(diff)} differ: "
                       f"{ {k: old.get(k) for k in diff} } vs { {k: settings.get(k) for k in diff} }); "
                       f"use another --out or the same settings")
    return
  out_dir.mkdir(parents=True, exist_ok=True)  # several processes may write it at once: the same text, atomically
  _write_atomic(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def _problem_record(rec, prompt_tokens: int, out, rows: range, batch, threshold: float,
                    keep_text: bool) -> dict[str, Any]:
  """One problem's record from its rows of the sample output and of the scored batch (same row order)."""
  infos = [batch.infos[r] for r in rows]
  values = [float(batch.rewards[r]) for r in rows]
  record = {
      "line": _line(rec), "id": problem_id(rec), "prompt_tokens": int(prompt_tokens),
      "response_tokens": [int(out.lengths[r]) for r in rows],
      "finish_reasons": [str(out.finish_reason[r]) for r in rows],
      "rewards": values, "correct": [v > threshold for v in values],
      "answers": [info.get("extracted") for info in infos],
      "reasons": [info.get("reason") for info in infos]}
  if keep_text:
    record["responses"] = [out.texts[r] for r in rows]
  return record


def _generate_and_score(sampler, scorer: rewards.RewardRunner, problems: EncodedPrompts, todo: list[int],
                        settings: EvalSettings, keep_text: bool) -> list[dict[str, Any]]:
  """Samples ``n`` responses for each problem of ``todo`` (indices into ``problems``) and scores them."""
  n = settings.n
  out = sampler.generate([problems.ids[i].tolist() for i in todo], n=n, max_new_tokens=settings.max_new_tokens,
                         temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                         seed=settings.seed, request_ids=[request_id(problems.records[i]) for i in todo],
                         stop_strings=list(settings.stop_strings),
                         **({"images": [problems.images(i) for i in todo]} if problems.has_images else {}))
  index = [scorer.submit(problems.texts[i], out.texts[j * n + s], **reward_fields(problems.records[i]))
           for j, i in enumerate(todo) for s in range(n)]  # row j·n + s of the output
  batch = scorer.collect(index)  # in index order: row order
  return [_problem_record(problems.records[i], len(problems.ids[i]), out, range(j * n, (j + 1) * n), batch,
                          settings.correct_threshold, keep_text) for j, i in enumerate(todo)]


def _parts(out_dir: Path) -> list[tuple[Path, int]]:
  """The part files in ``out_dir`` with the process count of the run that wrote each."""
  files = sorted(out_dir.glob("records.part-*-of-*.jsonl"))
  return [(f, int(f.name.rsplit("-of-", 1)[1].split(".")[0])) for f in files]


def _resume(out_dir: Path, own: Path, count: int) -> dict[int, dict[str, Any]]:
  """Records already written that this process may count as done: its own file (a torn last line repaired),
  ``records.jsonl`` and the parts of an earlier run with another process count (read only: the parts of this
  run's other processes hold only their own shares and are being written)."""
  done: dict[int, dict[str, Any]] = {}
  others = [] if own.name == RECORDS else [out_dir / RECORDS]
  for path in others + [f for f, c in _parts(out_dir) if c != count or own.name == RECORDS]:
    done.update(read_done(path, repair=False))
  done.update(read_done(own))
  return done


def _merge(out_dir: Path, problems: EncodedPrompts, index: int, count: int) -> list[dict[str, Any]]:
  """Once every process has written its part (a barrier), process 0 writes every record, by line, into
  ``records.jsonl`` (atomically) and removes the parts; returns the records of ``problems`` in file order."""
  path = out_dir / RECORDS
  sharding.barrier("eval-parts", timeout_s=BARRIER_TIMEOUT_S)
  parts = [f for f, _ in _parts(out_dir)]
  if index == 0 and (count > 1 or parts):
    done = read_done(path, repair=False)
    for f in parts:
      done.update(read_done(f, repair=False))
    missing = [_line(rec) for rec in problems.records if _line(rec) not in done]
    if missing:
      raise data_lib.DataError(f"{out_dir}: the parts lack the records of lines {missing[:10]}")
    _write_atomic(path, "".join(json.dumps(done[k]) + "\n" for k in sorted(done)))
    for f in parts:
      f.unlink()
  sharding.barrier("eval-merged", timeout_s=BARRIER_TIMEOUT_S)
  done = read_done(path, repair=False)
  return [done[_line(rec)] for rec in problems.records]


def evaluate(sampler, scorer: rewards.RewardRunner, problems: EncodedPrompts, settings: EvalSettings,
             out_dir: str | Path, *, chunk: int = 8, keep_text: bool = True,
             run_info: dict[str, Any] | None = None, desc: str = "eval",
             process: tuple[int, int] | None = None) -> list[dict[str, Any]]:
  """Generates and scores every problem not yet in ``out_dir/records.jsonl``, ``chunk`` problems per
  ``generate`` call, appending each chunk's records as it finishes; returns all records in file order.

  ``sampler`` is a :class:`jaxrl.sampling.Engine` or :class:`jaxrl.sampling.Sampler` (the same ``generate``).
  Progress (problems done, tokens/s, accuracy so far, ETA) goes through the training loop's logger, titled
  ``desc``. Under ``jax.distributed`` (``process`` = ``(index, count)``, default this process's) problem ``i``
  goes to process ``i % count``, which appends its records to its own part (:func:`part_name`, resumed from
  there); once all are complete process 0 merges them by line into ``records.jsonl``. A sample's draws depend on
  the seed, its problem's line and its index only, so the records equal a one-process run's.
  """
  out_dir = Path(out_dir)
  index, count = (jax.process_index(), jax.process_count()) if process is None else process
  check_settings(out_dir, {**dataclasses.asdict(settings), "stop_strings": list(settings.stop_strings),
                           **(run_info or {})})
  own = out_dir / (RECORDS if count == 1 else part_name(index, count))
  done = _resume(out_dir, own, count)
  mine = [i for i in range(len(problems.records)) if i % count == index]
  todo = [i for i in mine if _line(problems.records[i]) not in done]
  logger = train.process_logger(out_dir, index, total_steps=len(mine), desc=desc,
                                show=("problems", "tok/s", "accuracy"), tensorboard=False)
  if len(todo) < len(mine):
    logger.note(f"resuming: {len(mine) - len(todo)} of {len(mine)} problems already in {out_dir}")
  tokens, t0 = 0, time.perf_counter()
  lines = [_line(problems.records[i]) for i in mine]
  correct = [c for k in lines if k in done for c in done[k]["correct"]]
  with open(own, "a", encoding="utf-8") as f:
    for s in range(0, len(todo), max(1, chunk)):
      for record in _generate_and_score(sampler, scorer, problems, todo[s:s + chunk], settings, keep_text):
        f.write(json.dumps(record) + "\n")
        tokens += sum(record["response_tokens"])
        correct += record["correct"]
      f.flush()
      finished = len(mine) - len(todo) + min(s + chunk, len(todo))
      logger.log(finished, {"problems": float(finished), "tok/s": tokens / max(time.perf_counter() - t0, 1e-9),
                            "accuracy": float(np.mean(correct)) if correct else math.nan})
  logger.close(f"{desc} progress")
  return _merge(out_dir, problems, index, count)


def summary(records: Sequence[dict[str, Any]], metrics: Sequence[str], settings: EvalSettings, *,
            skipped: int = 0, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
  """The metrics over ``records`` (each problem weighs the same), token counts, truncation rate and settings."""
  if not records:
    raise ValueError("no problem was evaluated")
  correct = np.array([r["correct"] for r in records], bool)  # [P, n]
  answers = [r["answers"] for r in records]
  lengths = np.array([r["response_tokens"] for r in records], np.int64)  # [P, n]
  reasons = [f for r in records for f in r["finish_reasons"]]
  return {
      "metrics": rewards.summarize(correct, metrics, answers),
      "problems": len(records), "samples_per_problem": int(correct.shape[1]), "skipped_prompts": int(skipped),
      "response_tokens": {"mean": float(lengths.mean()), "max": int(lengths.max()), "total": int(lengths.sum())},
      "truncation_rate": float(np.mean([f == "length" for f in reasons])),
      "settings": {**dataclasses.asdict(settings), "stop_strings": list(settings.stop_strings)},
      **(run_info or {})}


def markdown(result: dict[str, Any]) -> str:
  """The summary as a markdown table (metrics in percent, as papers report them) and its settings."""
  rows = ["| metric | value |", "| --- | ---: |"]
  rows += [f"| {k} | {100 * v:.2f} |" for k, v in result["metrics"].items()]
  tok = result["response_tokens"]
  rows += [f"| response tokens (mean / max) | {tok['mean']:.1f} / {tok['max']} |",
           f"| truncated (finish: length) | {100 * result['truncation_rate']:.2f} % |",
           f"| problems (skipped: too long) | {result['problems']} ({result['skipped_prompts']}) |"]
  s = result["settings"]
  rows.append("")
  rows.append(f"n={s['n']} temperature={s['temperature']} top_p={s['top_p']} top_k={s['top_k']} "
              f"max_new_tokens={s['max_new_tokens']} seed={s['seed']}")
  return "\n".join(rows)


def write_summary(out_dir: str | Path, result: dict[str, Any]) -> Path:
  """Writes ``summary.json`` in ``out_dir``; returns its path."""
  path = Path(out_dir) / SUMMARY
  path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
  return path
