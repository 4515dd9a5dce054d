"""The training-loop skeleton every trainer (``sft``, ``rl``, asynchronous ``rl``, ``latent``) runs through.

A trainer's ``run`` fills in the steps; these pieces are the parts every loop shares, in the order a run
calls them:

1. :func:`resumable`: whether the run restores its latest checkpoint first.
2. :func:`process_logger`: process 0 logs to ``out_dir``, process ``K`` to ``out_dir/processes/K`` (the same
   global metrics, never the same files).
3. Per step, :func:`finish_step`: the evaluation cadence (every ``eval_every`` steps and the run's last step),
   the history row and the progress line. The checkpoint and the pre-emption poll follow it in the trainer
   (each trainer's checkpoint holds its own host state); a signal ends the run with :func:`stop_preempted`.
4. After the loop, :func:`eval_if_resumed_at_end`: a run resumed at (or past) its end ran no step, so the final
   evaluation is redone for the results.
5. :func:`export_hf` when the run reached its last step under ``export_hf``, then :func:`write_results`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from jaxrl import models
from jaxrl.train._logging import MetricsLogger
from jaxrl.train._preempt import Preempted


def process_logger(out_dir: Path, pid: int, **kwargs) -> MetricsLogger:
  """A :class:`MetricsLogger` (``kwargs`` as it takes them) in ``out_dir`` on process 0 and in
  ``out_dir/processes/<pid>`` on the others."""
  log_dir = out_dir if pid == 0 else out_dir / "processes" / str(pid)
  return MetricsLogger(log_dir, **kwargs)


def finish_step(step: int, metrics: dict[str, float], *, logger: MetricsLogger, history: list[dict[str, float]],
                results: dict[str, Any], evaluate: Callable[[int], dict[str, float]], eval_every: int,
                total_steps: int) -> None:
  """Evaluates when the cadence asks (``step % eval_every == 0`` or the run's last step; ``eval_every`` 0 never),
  merges the evaluation into ``metrics`` and ``results["eval_after"]``, appends the history row and logs it."""
  if eval_every and (step % eval_every == 0 or step == total_steps):
    ev = evaluate(step)
    metrics.update(ev)
    if ev:
      results["eval_after"] = ev
  history.append(dict(metrics, step=float(step)))
  logger.log(step, metrics)


def eval_if_resumed_at_end(results: dict[str, Any], *, start_step: int, last: int, total_steps: int,
                           eval_every: int, evaluate: Callable[[], dict[str, float]]) -> None:
  """Sets ``results["eval_after"]`` when the run resumed at (or past) ``last == total_steps`` with evaluation on:
  no step ran, so the last step's evaluation is redone for the results."""
  if start_step >= last and eval_every and last == total_steps:
    ev = evaluate()
    if ev:
      results["eval_after"] = ev


def export_hf(results: dict[str, Any], *, out_dir: Path, model, tokenizer=None, adapter=None) -> None:
  """Saves ``model`` (merged weights) in Hugging Face format to ``out_dir/hf`` and, under LoRA, the ``adapter``
  model's PEFT adapter to ``out_dir/adapter``; records both directories in ``results``."""
  models.save_pretrained(model, out_dir / "hf", tokenizer=tokenizer)
  results["hf_dir"] = str(out_dir / "hf")
  if adapter is not None:
    models.save_peft(adapter, out_dir / "adapter")
    results["adapter_dir"] = str(out_dir / "adapter")


def write_results(results: dict[str, Any], out_dir: Path, *, pid: int = 0) -> None:
  """Writes ``out_dir/results.json`` (JSON, ``str`` for anything else) from process 0 only."""
  if pid == 0:
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))


def resumable(checkpointer, resume: str) -> bool:
  """Whether a run resumes: checkpointing is on (``checkpointer`` not None), ``checkpoint.resume`` is ``auto``
  and a checkpoint exists."""
  return checkpointer is not None and resume == "auto" and bool(checkpointer.latest_step())


def stop_preempted(signum: int, step: int, *, checkpointer, logger: MetricsLogger, title: str) -> None:
  """Pre-emption after ``step``: the checkpoint commits, the logger closes, then :class:`Preempted` is raised
  (the CLI exits 143)."""
  if checkpointer is not None:
    checkpointer.close()
  logger.close(title=title)
  raise Preempted(signum, step, checkpointed=checkpointer is not None)
