"""AsyncRLTrainer on 6 rollout + 2 trainer CPU devices: η = 0 is the synchronous trainer bit for bit; with
η > 0 batches are off-policy (π_prox ≠ π_behav) and the proximal policy stays fixed across mini-batches."""

from pathlib import Path

import jax
import numpy as np
import pytest
from rl_testlib import make_config

from jaxrl import config as config_lib
from jaxrl.rl import RLConfig, RLTrainer
from jaxrl.rl._async import AsyncRLTrainer

ENGINE = {"num_slots": 12, "kv_cache_bytes": 1 << 20, "block_size": 8, "steps_per_call": 4}


def _config(tmp_path, name, asynchronous=None, **over):
  over = {"rollout.engine": ENGINE, "algorithm.objective": "decoupled_ppo", "steps": 2, **over}
  if asynchronous is not None:
    over["asynchronous"] = {"rollout_devices": 6, **asynchronous}
  return make_config(tmp_path / name, **over)


def _params(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def test_eta0_is_the_synchronous_trainer_bit_for_bit(tmp_path):
  sync = RLTrainer(_config(tmp_path, "sync"), devices=jax.devices()[6:])  # the async trainer's sub-mesh
  try:
    sync.run()
  finally:
    sync.close()
  trainer = AsyncRLTrainer(_config(tmp_path, "async", {"max_staleness": 0}))
  try:
    trainer.run()
  finally:
    trainer.close()
  assert [d.id for d in trainer.mesh.devices.flat] == [6, 7]
  assert {d.id for x in jax.tree.leaves(trainer.engine.params) for d in x.devices()} == set(range(6))
  for a, b in zip(_params(sync), _params(trainer), strict=True):
    np.testing.assert_array_equal(a, b)
  for hs, ha in zip(sync.history, trainer.history, strict=True):
    assert ha["reward/mean"] == hs["reward/mean"] and ha["loss"] == hs["loss"]
    assert ha["async/staleness_max"] == 0.0 and ha["async/staleness/0"] == 1.0
    assert ha["async/time_weight_transfer"] > 0.0
  # π_prox is the parameters before the step, not the just-updated actor: the second mini-batch's ratio
  # π_θ/π_prox moves away from 1 (it would be exactly 1 with π_prox := the current actor).
  second = trainer.update_history[1::2]
  assert all(u["ratio_min"] < 1.0 or u["ratio_max"] > 1.0 for u in second)
  assert all(u["ratio_min"] == u["ratio_max"] == 1.0 for u in trainer.update_history[0::2])

  # Resume: stopped after step 1 (its checkpoint), then resumed to step 2 gives the uninterrupted run's
  # parameters bit for bit (η = 0 has nothing generated ahead; the prompt stream restarts at group 1·B).
  cut = _config(tmp_path, "cut", {"max_staleness": 0}, checkpoint={"every": 1})
  for until in (1, None):
    part = AsyncRLTrainer(cut)
    try:
      out = part.run(until=until)
    finally:
      part.close()
  assert out["start_step"] == 1 and len(part.history) == 1
  assert part.history[0]["loss"] == trainer.history[1]["loss"]
  for a, b in zip(_params(trainer), _params(part), strict=True):
    np.testing.assert_array_equal(a, b)


def test_off_policy_batches_are_reweighted_and_bounded(tmp_path):
  trainer = AsyncRLTrainer(_config(tmp_path, "eta1", {"max_staleness": 1}))  # test 1's programs (XLA cache)
  try:
    trainer.run()
  finally:
    trainer.close()
  h = trainer.history
  assert max(x["async/staleness_max"] for x in h) <= 1.0
  assert h[0]["async/staleness_max"] == 0.0 and h[1]["async/staleness_mean"] > 0  # batch 1 began under version 0
  # π_prox (the trainer's recompute at the step's parameters) differs from π_behav (the engine's log-probs
  # of the older version): at the first update of a step π_θ = π_prox, so this gap is |log π_prox − log π_behav|.
  fresh, stale = h[0]["logprob_diff/mean_abs"], h[1]["logprob_diff/mean_abs"]
  assert stale > 100 * max(fresh, 1e-7)
  assert h[1]["behav_weight_mean"] != 1.0


def test_async_config_is_checked_at_load(tmp_path):
  cfg = config_lib.load(RLConfig, Path(__file__).resolve().parents[2] / "configs" / "areal_async_tiny.yaml")
  assert cfg.asynchronous.max_staleness == 2 and cfg.asynchronous.rollout_devices == 6
  with pytest.raises(ValueError, match="asynchronous: needs rollout.engine"):
    make_config(tmp_path, asynchronous={})
  with pytest.raises(ValueError, match="max_staleness must be 1 with mode: one_off"):
    _config(tmp_path, "x", {"mode": "one_off", "max_staleness": 3})
  with pytest.raises(ValueError, match="asynchronous.max_staleness must be an int >= 0"):
    _config(tmp_path, "x", {"max_staleness": -1})
  with pytest.raises(config_lib.ConfigError, match="asynchronous"):
    config_lib.from_dict(RLConfig, {"asynchronous": {"staleness": 1}})
  with pytest.raises(ValueError, match="dynamic_sampling is not supported"):
    _config(tmp_path, "x", {}, **{"rollout.dynamic_sampling": True})


def test_async_trainer_overrides_only_the_schedule():
  """Packing, updates, rewards and evaluation are RLTrainer's own (a same-named helper would hijack them)."""
  own = {k for k in vars(AsyncRLTrainer) if not k.startswith("__")}
  assert own & set(vars(RLTrainer)) == {"run", "close"}
