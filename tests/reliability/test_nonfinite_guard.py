"""Non-finite updates: a poisoned micro-batch is skipped, counted and named; too many in a row abort.
Loss spikes (guards.spike_window): flagged against the rolling median + MAD, or abort the run."""

import json

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import sft, train
from jaxrl.sft import _trainer as sft_trainer

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}
POISONED_ROW = 3
"""Micro-batch ``m`` holds rows ``m, m + M, ...``: with M = 2 this row is in micro-batch 1."""


def _poisoned_trainer(tmp_path, monkeypatch, guards, poison_steps, value=np.nan):
  """A tiny SFT trainer whose loss weights of row POISONED_ROW are multiplied by ``value`` on the
  1-based steps ``poison_steps``; returns it and the list of batches fed so far."""
  cfg = config_lib.from_dict(sft.SFTConfig, {
      "model": TINY, "data": {"builtin": {"n_train": 12, "n_heldout": 4, "difficulty": 2, "seed": 0}},
      "packing": {"seq_len": 64, "global_rows": 16, "buffer_size": 4}, "micro_batches": 2,
      "optim": {"lr": 3e-3, "warmup_steps": 0}, "steps": 6, "eval": {"every": 0, "exact_match": 0},
      "guards": guards, "export_hf": False, "tensorboard": False,
      "out_dir": str(tmp_path)})
  prepare = sft_trainer.sft_prepare

  def poisoning_prepare(loss_cfg):
    inner = prepare(loss_cfg)

    def run(batch):
      batch = dict(batch)
      poison = batch.pop("poison")  # [rows, 1]: 1.0 or NaN
      out = inner(batch)
      return dict(out, weights=out["weights"] * poison)
    return run
  monkeypatch.setattr(sft_trainer, "sft_prepare", poisoning_prepare)
  trainer = sft.SFTTrainer(cfg)
  device_batch = trainer._device_batch
  calls = []

  def with_poison(arrays):
    calls.append(1)
    poison = np.ones((arrays["tokens"].shape[0], 1), np.float32)
    if len(calls) in poison_steps:
      poison[POISONED_ROW] = value
    return device_batch(dict(arrays, poison=poison))
  trainer._device_batch = with_poison
  return trainer, calls


def test_poisoned_steps_are_skipped_named_and_abort_after_the_limit(tmp_path, monkeypatch):
  trainer, calls = _poisoned_trainer(tmp_path, monkeypatch, {"max_consecutive_skips": 2}, {2, 4, 5})
  notes = []
  monkeypatch.setattr(train.MetricsLogger, "note", lambda self, text: notes.append(text))
  params_before = {}

  step_fn = trainer.step_fn

  def recording_step(state, batch, *extra):
    params_before[len(calls)] = jax.tree.map(np.asarray, state.params)
    return step_fn(state, batch, *extra)
  trainer.step_fn = recording_step
  with pytest.raises(train.NonFiniteError, match=r"step 5: 2 consecutive updates skipped .*max_consecutive_skips=2"):
    trainer.run()
  skipped = [n for n in notes if "non-finite" in n]
  assert len(skipped) == 3, notes
  assert all("micro-batch(es) [1]" in n for n in skipped), skipped
  assert skipped[0].startswith("step 2:") and "1 in a row" in skipped[0]
  assert skipped[1].startswith("step 4:") and "1 in a row" in skipped[1]  # step 3 reset the count
  assert skipped[2].startswith("step 5:") and "2 in a row" in skipped[2]
  # A skipped update leaves the parameters as they were; a finite one changes them.
  for step, nxt in ((2, 3), (4, 5)):
    jax.tree.map(np.testing.assert_array_equal, params_before[step], params_before[nxt])
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, params_before[3], params_before[4])))
  assert int(trainer.state.skipped) >= 3


def test_skip_guard_counts_in_a_row_and_restores_its_count():
  lines = []
  guard = train.SkipGuard(train.GuardConfig(max_consecutive_skips=3), log=lines.append)
  guard.observe(1, 1, np.asarray([0, 1, 1]))
  guard.observe(2, 0)
  guard.observe(3, 1)
  guard.observe(4, 1)
  assert guard.state()["consecutive"] == 2
  resumed = train.SkipGuard(train.GuardConfig(max_consecutive_skips=3), log=lines.append)
  resumed.set_state(guard.state())
  with pytest.raises(train.NonFiniteError, match="step 5: 3 consecutive"):
    resumed.observe(5, 1)
  assert "micro-batch(es) [1, 2]" in lines[0]
  unlimited = train.SkipGuard(train.GuardConfig(max_consecutive_skips=0), log=lines.append)
  for step in range(100):
    unlimited.observe(step, 1)


def test_a_loss_spike_stops_the_run_with_spike_action_abort(tmp_path, monkeypatch):
  """Step 5's loss is ~2000x the previous four (one row's weights x 1e4): detected on step 5."""
  trainer, _ = _poisoned_trainer(tmp_path, monkeypatch, {"spike_window": 4, "spike_action": "abort"}, {5},
                                 value=1e4)
  with pytest.raises(train.LossSpikeError, match=r"^step 5: loss spike: .* of the last 4 updates"):
    trainer.run()


def test_spike_limit_is_median_plus_threshold_mad_sigma():
  window = [2.0, 2.5, 1.0, 4.0, 3.0]
  med = sorted(window)[2]  # 2.5
  mad = sorted(abs(x - med) for x in window)[2]  # |2-2.5|, 0, 1.5, 1.5, 0.5 -> 0.5
  assert train._guards.spike_limit(window, 3.0) == pytest.approx(med + 3.0 * 1.4826 * mad, rel=1e-12)
  assert train._guards.spike_limit([5.0] * 4, 2.0) == pytest.approx(5.0 + 2.0 * 5e-3, rel=1e-12)  # floor


def test_skip_guard_flags_spikes_only_when_enabled_and_resumes_its_window():
  losses = [3.0, 2.9, 2.85, 2.8, 2.78, 9.0, 2.76, 2.75]
  lines = []
  cfg = train.GuardConfig(spike_window=4, spike_threshold=6.0)
  guard = train.SkipGuard(cfg, log=lines.append)
  for step, loss in enumerate(losses[:4], start=1):
    guard.observe(step, 0, None, loss)
  resumed = train.SkipGuard(cfg, log=lines.append)  # as after a checkpoint of step 4
  resumed.set_state(json.loads(json.dumps(guard.state())))
  for g in (guard, resumed):
    for step, loss in enumerate(losses[4:], start=5):
      g.observe(step, 0, None, loss)
  assert [line.split(":")[0] for line in lines] == ["step 6", "step 6"], lines
  assert guard.state() == resumed.state() and guard.spikes == 1
  with pytest.raises(train.LossSpikeError, match="step 6: loss spike: 9 > "):
    abort = train.SkipGuard(train.GuardConfig(spike_window=4, spike_action="abort"), log=lines.append)
    for step, loss in enumerate(losses, start=1):
      abort.observe(step, 0, None, loss)
  off = train.SkipGuard(train.GuardConfig(), log=lines.append)  # spike_window=0: no detection
  for step, loss in enumerate(losses, start=1):
    off.observe(step, 0, None, loss)
  assert off.spikes == 0 and len(lines) == 2
