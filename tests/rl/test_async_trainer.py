"""AsyncRLTrainer on 4 rollout + 4 trainer CPU devices: η = 0 is the synchronous trainer bit for bit (also
resumed, and with LoRA + DAPO dynamic sampling); with η > 0 batches are off-policy (π_prox ≠ π_behav) and
the proximal policy stays fixed across mini-batches."""

import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from rl_testlib import digit_fraction, make_config

from jaxrl import config as config_lib
from jaxrl.rl import RLConfig, RLTrainer
from jaxrl.rl._async import AsyncRLTrainer
from jaxrl.rl._config import DEFAULT_REWARD

ENGINE = {"num_slots": 12, "kv_cache_bytes": 1 << 20, "block_size": 8, "steps_per_call": 4}
# 4 rollout + 4 trainer devices; the synchronous reference trains and rolls out on the trainer's 4. Both
# engines then split their pool (and every prefill's rows, row-local) over 4 shards and run the same program
# shapes, which bit-for-bit equality needs (XLA's rounding depends on the per-device shapes).
ROLLOUT = 4


def _config(tmp_path, name, asynchronous=None, **over):
  over = {"rollout.engine": ENGINE, "algorithm.objective": "decoupled_ppo", "steps": 2, **over}
  if asynchronous is not None:
    over["asynchronous"] = {"rollout_devices": ROLLOUT, **asynchronous}
  return make_config(tmp_path / name, **over)


def _params(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def _run(trainer, **kwargs):
  try:
    return trainer.run(**kwargs)
  finally:
    trainer.close()


def test_eta0_is_the_synchronous_trainer_bit_for_bit(tmp_path):
  sync = RLTrainer(_config(tmp_path, "sync"), devices=jax.devices()[ROLLOUT:])  # the async trainer's sub-mesh
  _run(sync)
  cfg = _config(tmp_path, "async", {"max_staleness": 0}, checkpoint={"every": 1})
  trainer = AsyncRLTrainer(cfg)
  _run(trainer)
  assert [d.id for d in trainer.mesh.devices.flat] == [4, 5, 6, 7]
  assert {d.id for x in jax.tree.leaves(trainer.engine.params) for d in x.devices()} == set(range(ROLLOUT))
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

  # Resume: the run is cut after step 1 (its step-2 checkpoint set aside, as the checkpointer does with an
  # unusable one) and resumed to step 2: the uninterrupted run's parameters bit for bit (η = 0 has nothing
  # generated ahead; the prompt stream restarts at group 1·B).
  ckpt = Path(cfg.out_dir) / "checkpoints"
  (ckpt / "2").rename(ckpt / "2.cut")
  part = AsyncRLTrainer(cfg)
  out = _run(part)
  assert out["start_step"] == 1 and len(part.history) == 1
  assert part.history[0]["loss"] == trainer.history[1]["loss"]
  for a, b in zip(_params(trainer), _params(part), strict=True):
    np.testing.assert_array_equal(a, b)


def half_flat(prompt, completion, **_):
  """Half the prompts (by a checksum) get a constant reward (dynamic sampling filters their groups), the
  rest :func:`rl_testlib.digit_fraction`."""
  return 0.5 if zlib.crc32(prompt.encode()) % 2 else digit_fraction(prompt, completion)


def test_eta0_lora_and_dynamic_sampling_are_the_synchronous_trainer_bit_for_bit(tmp_path):
  """LoRA: only the adapters are trained and transferred to the rollout engine (the base is placed there
  once); DAPO dynamic sampling: filtered groups are never trained, the batch waits for B informative
  groups. At η = 0 both give the synchronous trainer's adapters and dynamic-sampling counts exactly, and a run
  cut after step 1 and resumed from its checkpoint (the prompt stream past every round drawn for batch 1)
  gives the uninterrupted run's adapters (docs/async.md, "Resume": exact at η = 0)."""
  over = {"lora": {"rank": 4, "alpha": 8, "lr_multiplier": 10.0}, "algorithm.kl_coef": 0.05,
          "rollout.dynamic_sampling": True, "rollout.max_rounds": 3, "reward.fn": "test_async_trainer:half_flat"}
  sync = RLTrainer(_config(tmp_path, "sync", **over), devices=jax.devices()[ROLLOUT:])
  _run(sync)
  cfg = _config(tmp_path, "async", {"max_staleness": 0}, checkpoint={"every": 1}, **over)
  trainer = AsyncRLTrainer(cfg)
  base = [np.asarray(x) for x in jax.tree.leaves(trainer._rollout_base)]
  _run(trainer)
  got, want = nnx.to_flat_state(trainer.state.params), nnx.to_flat_state(sync.state.params)
  assert got and all(str(path[-1]).endswith(("_lora_a", "_lora_b")) for path, _ in got)  # adapters only
  for (pa, a), (pb, b) in zip(want, got, strict=True):
    assert pa == pb
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(pa))
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.params))
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.opt_state))
  base_bytes = sum(x.nbytes for x in base)
  assert opt_bytes < base_bytes / 2  # the optimizer holds the adapters' moments, not the base's
  for h in trainer.history:  # each version moves only the adapters
    assert h["async/weight_transfer_bytes"] == adapter_bytes < base_bytes / 5
  for a, b in zip(base, jax.tree.leaves(trainer._rollout_base), strict=True):  # the rollout's base is frozen
    np.testing.assert_array_equal(a, np.asarray(b))
  keys = ("reward/mean", "loss", "dynamic/groups_kept", "dynamic/rounds", "dynamic/groups_generated")
  for hs, ha in zip(sync.history, trainer.history, strict=True):
    assert {k: ha.get(k) for k in keys} == {k: hs.get(k) for k in keys}  # no "loss": a step without update
    assert ha["dynamic/groups_filtered"] + ha["dynamic/groups_kept"] + ha["dynamic/groups_surplus"] == \
        ha["dynamic/groups_generated"]
  assert sum(h["dynamic/groups_filtered"] for h in trainer.history) > 0
  assert max(h["dynamic/rounds"] for h in trainer.history) > 1  # a batch waited for more informative groups

  # Resume with dynamic sampling: cut after step 1 (step 2's checkpoint set aside), resumed to step 2.
  ckpt = Path(cfg.out_dir) / "checkpoints"
  (ckpt / "2").rename(ckpt / "2.cut")
  part = AsyncRLTrainer(cfg)
  out = _run(part)
  assert out["start_step"] == 1 and len(part.history) == 1
  assert {k: part.history[0].get(k) for k in keys} == {k: trainer.history[1].get(k) for k in keys}
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
  with pytest.raises(ValueError, match="reward_overlap_chunks must be 1"):
    _config(tmp_path, "x", {}, **{"rollout.reward_overlap_chunks": 2})
  with pytest.raises(ValueError, match="asynchronous: reward.model is not supported"):
    _config(tmp_path, "x", {}, **{"reward.fn": DEFAULT_REWARD, "reward.kwargs": {}, "reward.model": {"path": str(tmp_path / "rm")}})


def test_async_trainer_overrides_only_the_schedule():
  """Packing, updates, rewards and evaluation are RLTrainer's own (a same-named helper would hijack them)."""
  own = {k for k in vars(AsyncRLTrainer) if not k.startswith("__")}
  assert own & set(vars(RLTrainer)) == {"run", "close"}


def test_split_devices_gives_each_process_its_own_rollout_devices(tmp_path):
  """On P processes every process's first rollout_devices / P devices roll out (this process's are returned:
  its engine's process-local mesh) and the trainer mesh is every process's others, in process order."""
  from types import SimpleNamespace

  from jaxrl.rl._async import split_devices
  devs = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]  # 2 processes × 4 devices
  cfg = _config(tmp_path, "x", {"rollout_devices": 6})  # 3 per process
  rollout, trainer = split_devices(cfg, devs)
  assert [d.id for d in rollout] == [0, 1, 2] and [d.id for d in trainer] == [3, 7]
  default = _config(tmp_path, "x", {"rollout_devices": None})  # 3/4 of each process's devices
  assert [[d.id for d in x] for x in split_devices(default, devs)] == [[0, 1, 2], [3, 7]]
  one = [SimpleNamespace(id=i, process_index=0) for i in range(8)]
  assert [[d.id for d in x] for x in split_devices(cfg, one)] == [list(range(6)), [6, 7]]
  with pytest.raises(ValueError, match="multiple of the process count"):
    split_devices(_config(tmp_path, "x", {"rollout_devices": 5}), devs)
  with pytest.raises(ValueError, match="at least one rollout and one trainer device of the 4"):
    split_devices(_config(tmp_path, "x", {"rollout_devices": 8}), devs)
