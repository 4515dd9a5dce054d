"""PTST (rollout.context_schedule) and reward monitors under the asynchronous trainer: each group is generated with
the stage of the step that trains it (budget and group size), a run resumed at the stage boundary continues in the
new stage, and ``reward/monitor/*`` / ``eval/monitor/*`` are the means a hand recomputation gives."""

import collections
from pathlib import Path

import jax
import numpy as np
import pytest
from rl_testlib import digit_monitor, make_config

from jaxrl.rl import RLTrainer
from jaxrl.rl._async import AsyncRLTrainer

ENGINE = {"num_slots": 12, "kv_cache_bytes": 1 << 20, "block_size": 8, "steps_per_call": 4}
ROLLOUT = 4  # rollout devices; the synchronous reference runs on the other 4 (test_async_trainer.py: same shapes)
# 8 tokens x 4 samples, then 16 x 2 from step 2. eval.max_new_tokens keeps every engine at max_len 32 + 16, so the
# synchronous reference (which sizes its engine per stage) runs the asynchronous engine's program shapes.
PTST = {"rollout.n": 4, "rollout.max_new_tokens": 8, "rollout.context_schedule": [
    {"start_step": 2, "max_new_tokens": 16, "n": 2}], "eval.max_new_tokens": 16, "eval.prompts": 3, "eval.samples": 2,
    "eval.temperature": 1.0,
    "steps": 2,
    "rollout.engine": ENGINE, "algorithm.objective": "decoupled_ppo",
    "reward.fn": "rl_testlib:monitored_digit_fraction"}


def hand_means(texts, prefix):
  values = collections.defaultdict(list)
  for t in texts:
    for k, v in digit_monitor(t).items():
      values[f"{prefix}/monitor/{k}"].append(v)
  return {k: sum(v) / len(v) for k, v in values.items()}


def _run(trainer, after=lambda: None):
  """Runs (then ``after()``) and closes ``trainer``; returns the ``(step, rollout)`` of every update."""
  seen = []
  update = trainer.update
  trainer.update = lambda ro, step: (seen.append((step, ro)), update(ro, step))[1]
  try:
    trainer.run()
    after()
  finally:
    trainer.close()
  return seen


def _params(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def test_eta0_ptst_is_the_synchronous_trainer_and_resumes_in_the_new_stage(tmp_path):
  sync = RLTrainer(make_config(tmp_path / "sync", **PTST), devices=jax.devices()[ROLLOUT:])
  _run(sync)
  cfg = make_config(tmp_path / "async", asynchronous={"rollout_devices": ROLLOUT, "max_staleness": 0},
                    checkpoint={"every": 1, "keep": 4}, **PTST)
  trainer = AsyncRLTrainer(cfg)
  seen = _run(trainer)
  assert trainer.engine.max_len == 32 + 16  # the largest stage's
  # Each step's groups have its stage's n; no response exceeds its budget; stage 1's budget is used.
  for rec, (n, budget) in zip(trainer.trained, [(4, 8), (2, 16)], strict=True):
    assert set(collections.Counter(rec["group"].tolist()).values()) == {n} and len(rec["group"]) == 4 * n
    assert rec["length"].max() <= budget
  assert trainer.trained[1]["length"].max() > 8
  assert [s for s, _ in seen] == [1, 2] and [ro.tokens.shape[1] for _, ro in seen] == [8, 16]
  # η = 0: the synchronous PTST run, bit for bit (its monitors too: the same reward infos, another code path).
  for a, b in zip(_params(sync), _params(trainer), strict=True):
    np.testing.assert_array_equal(a, b)
  for hs, ha in zip(sync.history, trainer.history, strict=True):
    assert ha["loss"] == hs["loss"]
    assert {k: v for k, v in ha.items() if "/monitor/" in k} == {k: v for k, v in hs.items() if "/monitor/" in k}
  # reward/monitor/*: the means over the step's samples (the ones that report a key), recomputed by hand.
  for (step, ro), h in zip(seen, trainer.history, strict=True):
    want = hand_means(ro.texts, "reward")
    assert {"reward/monitor/chars", "reward/monitor/digits"} <= set(want)
    assert {k: v for k, v in h.items() if "/monitor/" in k} == pytest.approx(want, rel=1e-12)

  # Resume at the stage boundary: checkpoint 2 set aside, a fresh trainer restarts from step 1's and trains
  # step 2 in stage 1 (n = 2, 16 tokens): the uninterrupted run's parameters bit for bit.
  ckpt = Path(cfg.out_dir) / "checkpoints"
  (ckpt / "2").rename(ckpt / "2.cut")
  part = AsyncRLTrainer(cfg)
  texts, evaluated = [], {}  # eval/monitor/*: the held-out samples' means, by hand from the texts scored
  score = part._score
  part._score = lambda prompts, idx, n, out: (texts.extend(out.texts), score(prompts, idx, n, out))[1]
  seen2 = _run(part, after=lambda: evaluated.update(part.evaluate(2)))
  assert [s for s, _ in seen2] == [2] and part._stage == 1
  for rec in part.trained:
    assert set(collections.Counter(rec["group"].tolist()).values()) == {2} and rec["length"].max() <= 16
  assert [h["loss"] for h in part.history] == [h["loss"] for h in trainer.history[1:]]
  for a, b in zip(_params(trainer), _params(part), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(texts) == 3 * 2 and "eval/monitor/chars" in hand_means(texts, "eval")
  assert {k: v for k, v in evaluated.items() if "/monitor/" in k} == pytest.approx(hand_means(texts, "eval"),
                                                                                   rel=1e-12)


def test_admission_ahead_generates_with_the_stage_of_the_training_step(tmp_path):
  """η = 1: batch 1 (step 2, stage 1) is admitted while stage 0's batch 0 trains; its groups still get n = 2 and
  the 16-token budget (and are older than the version that trains them)."""
  cfg = make_config(tmp_path / "eta1", asynchronous={"rollout_devices": ROLLOUT, "max_staleness": 1}, **PTST)
  trainer = AsyncRLTrainer(cfg)
  _run(trainer)
  sizes = [set(collections.Counter(rec["group"].tolist()).values()) for rec in trainer.trained]
  assert sizes == [{4}, {2}]
  assert [int(rec["length"].max()) <= b for rec, b in zip(trainer.trained, (8, 16))] == [True] * 2
  assert trainer.trained[1]["version_min"].min() == 0  # admitted (and partly generated) at version 0, in stage 0


def test_ptst_with_dynamic_sampling_is_refused(tmp_path):
  with pytest.raises(ValueError, match="context_schedule with rollout.dynamic_sampling is not supported"):
    make_config(tmp_path, asynchronous={"rollout_devices": ROLLOUT}, **{**PTST, "rollout.dynamic_sampling": True})
