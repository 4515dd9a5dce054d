"""The training-loop skeleton (jaxrl/train/_loop.py): evaluation cadence, resume rule, results file."""

from __future__ import annotations

import json

from jaxrl import train


class _Logger:
  def __init__(self):
    self.rows = []

  def log(self, step, metrics):
    self.rows.append((step, dict(metrics)))


class _Checkpointer:
  def __init__(self, latest):
    self.latest = latest

  def latest_step(self):
    return self.latest


def test_finish_step_evaluates_every_k_steps_and_at_the_last():
  logger, history, results, asked = _Logger(), [], {}, []

  def evaluate(step):
    asked.append(step)
    return {"eval/accuracy": step / 10}

  for step in range(1, 8):
    train.finish_step(step, {"loss": float(step)}, logger=logger, history=history, results=results,
                      evaluate=evaluate, eval_every=3, total_steps=7)
  assert asked == [3, 6, 7]
  assert results["eval_after"] == {"eval/accuracy": 0.7}
  assert [h["step"] for h in history] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
  assert history[2] == {"loss": 3.0, "eval/accuracy": 0.3, "step": 3.0}
  assert [s for s, _ in logger.rows] == [1, 2, 3, 4, 5, 6, 7]


def test_finish_step_never_evaluates_with_eval_every_zero():
  results = {}
  train.finish_step(5, {}, logger=_Logger(), history=[], results=results,
                    evaluate=lambda s: 1 / 0, eval_every=0, total_steps=5)
  assert "eval_after" not in results


def test_resumable_needs_a_checkpointer_auto_and_a_checkpoint():
  assert train.resumable(_Checkpointer(4), "auto")
  assert not train.resumable(_Checkpointer(None), "auto")
  assert not train.resumable(_Checkpointer(4), "never")
  assert not train.resumable(None, "auto")


def test_eval_if_resumed_at_end_only_when_no_step_ran_at_the_end():
  results = {}
  train.eval_if_resumed_at_end(results, start_step=5, last=5, total_steps=5, eval_every=2,
                               evaluate=lambda: {"eval/accuracy": 0.5})
  assert results == {"eval_after": {"eval/accuracy": 0.5}}
  results = {}
  train.eval_if_resumed_at_end(results, start_step=3, last=5, total_steps=5, eval_every=2, evaluate=lambda: 1 / 0)
  assert results == {}


def test_write_results_only_on_process_zero(tmp_path):
  train.write_results({"steps": 3, "path": tmp_path}, tmp_path, pid=1)
  assert not (tmp_path / "results.json").exists()
  train.write_results({"steps": 3, "path": tmp_path}, tmp_path, pid=0)
  assert json.loads((tmp_path / "results.json").read_text()) == {"steps": 3, "path": str(tmp_path)}
