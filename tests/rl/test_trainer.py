"""The RL loop end to end on a tiny model (8 fake devices): ratios, logged log-prob gaps, dynamic
sampling, overlong filtering, learning, iterative context lengthening and resume."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from rl_testlib import first_micro_batch_ratios, make_config

from jaxrl import rl


def _run(cfg, **kw):
  trainer = rl.RLTrainer(cfg)
  seen = []
  update = trainer.update
  trainer.released_in_update = []  # whether the sampler held no weights right after each update

  def spy(ro, step):
    seen.append((step, ro))
    out = update(ro, step)
    trainer.released_in_update.append(trainer.sampler.params is None)
    return out
  trainer.update = spy
  try:
    out = trainer.run(**kw)
  finally:
    trainer.close()
  return trainer, out, seen


@pytest.fixture(scope="module")
def recompute_run(tmp_path_factory):
  """π_old recomputed, two mini-batches × two epochs, KL to the reference, DAPO dynamic sampling with a
  sparse 0/1 reward, and overlong filtering (stop strings end some responses early)."""
  cfg = make_config(
      tmp_path_factory.mktemp("recompute"), **{
          "reward.fn": "rl_testlib:starts_with_digit", "rollout.dynamic_sampling": True, "rollout.max_rounds": 4,
          "rollout.overlong_filter": True, "rollout.stop_strings": ["5", "7"], "algorithm.old_logprobs": "recompute",
          "algorithm.ppo_epochs": 2, "algorithm.kl_coef": 0.01, "steps": 2})
  return _run(cfg)


@pytest.mark.parametrize("shift, current_as_old, want", [
    (0.0, False, 1.0),  # the recomputed π_old is the loss's own forward: the shortcut below is exact
    (0.1, False, math.exp(-0.1)),  # the ratio reads π_old
    (0.1, True, 1.0),  # the first-mini-batch shortcut replaces π_old by the current log-probs
])
def test_recomputed_pi_old_matches_the_loss_forward_and_the_ratio_reads_it(recompute_run, shift, current_as_old,
                                                                            want):
  trainer, _, seen = recompute_run
  assert len(seen) == 2, "every step must have kept at least one group"
  step, ro = seen[-1]
  lo, hi = first_micro_batch_ratios(trainer, ro, step, shift=shift, current_as_old=current_as_old)
  assert abs(lo - want) < 1e-5 and abs(hi - want) < 1e-5, (lo, hi)
  later = [u for u in trainer.update_history if u["ratio_min"] != 1.0 or u["ratio_max"] != 1.0]
  assert later, "updates after the first one move the policy away from π_old"


def test_recompute_vs_sampler_gap_is_logged_every_step(recompute_run, tmp_path):
  trainer, _, _ = recompute_run
  for h in trainer.history:
    assert 0.0 < h["logprob_diff/max_abs"] < 1e-4 and 0.0 <= h["logprob_diff/mean_abs"] <= h["logprob_diff/max_abs"]
    assert h["kl"] >= 0.0
  logged = (trainer.out_dir / "metrics.jsonl").read_text()
  assert logged.count("logprob_diff/max_abs") == len(trainer.history)


def test_the_sampler_holds_no_weights_during_updates(recompute_run):
  """Its stale copy is released before the train step (issue 34: not live beside the gradients) and the next
  step's rollout gives it the new weights."""
  trainer, _, seen = recompute_run
  assert isinstance(trainer.sampler, __import__("jaxrl").sampling.Sampler)
  assert len(seen) == 2 and trainer.released_in_update == [True, True]


def test_dynamic_sampling_never_emits_a_zero_variance_group(recompute_run):
  trainer, _, seen = recompute_run
  for (step, ro), h in zip(seen, trainer.history):
    assert ro.num_groups == h["dynamic/groups_kept"] <= 4
    assert h["dynamic/rounds"] == 4 or ro.num_groups == 4  # refilled until full or out of rounds
    assert rl.informative_groups(ro.rewards, ro.group_ids, ro.num_groups).all()
    adv, _ = rl.compute_advantages(ro, name="grpo", options={})
    for g in range(ro.num_groups):
      assert ro.rewards[ro.group_ids == g].std() > 0 and adv[ro.group_ids == g, 0].std() > 0


def test_overlong_filtering_masks_exactly_the_truncated_responses(recompute_run):
  trainer, _, seen = recompute_run
  some = False
  for step, ro in seen:
    assert ro.truncated.any() and not ro.truncated.all(), "want a mix of truncated and finished responses"
    assert (ro.lengths[ro.truncated] == 16).all()  # truncated = finish reason "length"
    packed, _ = trainer.pack(ro, step)
    kept_tokens = sum(float(p.arrays["loss_mask"].sum()) for p in packed)
    assert kept_tokens == ro.lengths[~ro.truncated].sum()
    mask = rl.loss_mask(ro, overlong_filter=True)
    np.testing.assert_array_equal(mask.sum(1) == 0, ro.truncated)
    some = True
  assert some


def test_packed_rows_carry_their_loss_columns_at_one_width_for_the_run(recompute_run):
  """The head scores each row's loss tokens only (``loss_columns``), at a width fixed by the shortest training
  prompt (no recompile between steps); a row over it widens it for the rest of the run."""
  trainer, _, seen = recompute_run
  step, ro = seen[-1]
  row_len = trainer.layout(step)[0]
  shortest = min(len(x) for x in trainer.train_prompts.ids)
  width = trainer._loss_widths[row_len]
  most = trainer.cfg.rollout.max_max_new_tokens
  bound = max(min(k * most, row_len - k * (shortest - 1)) for k in range(1, row_len // shortest + 1))
  assert width == min(row_len, -(-bound // 8) * 8) < row_len
  for pb in trainer.pack(ro, step)[0]:
    mask, cols = pb.arrays["loss_mask"] > 0, pb.arrays["loss_columns"]
    assert cols.shape == (*mask.shape[:2], width)
    got = np.zeros_like(mask)
    np.put_along_axis(got, np.minimum(cols, row_len - 1), True, axis=-1)  # padding (row_len) lands on the last
    np.testing.assert_array_equal(got[..., :-1], mask[..., :-1])
  full = rl.PackedBatch({"loss_mask": np.ones((1, 1, row_len), np.float32)}, 1, row_len, [])
  try:
    assert trainer._loss_width(full, row_len) == row_len
    assert trainer._loss_widths[row_len] == row_len  # kept
  finally:
    trainer._loss_widths[row_len] = width


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
  """π_old from the sampler; a dense reward a random policy can learn within a few steps."""
  cfg = make_config(
      tmp_path_factory.mktemp("learn"), **{
          "algorithm.old_logprobs": "sampler", "algorithm.mini_batches": 1, "optim.lr": 1e-2,
          "optim.schedule": "constant", "steps": 10, "eval.every": 10, "eval.prompts": 8})
  trainer = rl.RLTrainer(cfg)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.params))
  try:
    out = trainer.run()
  finally:
    trainer.close()
  return trainer, out, before


def test_sampler_logprobs_give_ratio_within_1e4_of_one(learning_run):
  trainer, _, _ = learning_run
  for h in trainer.history:
    assert abs(h["ratio_first_min"] - 1.0) < 1e-4 and abs(h["ratio_first_max"] - 1.0) < 1e-4, h
    assert h["logprob_diff/max_abs"] < 1e-4


def test_grpo_raises_the_mean_reward(learning_run):
  _, out, _ = learning_run
  rewards = out["rewards"]
  assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
  assert out["eval_after"]["eval/reward_mean"] > out["eval_before"]["eval/reward_mean"]


def test_every_parameter_changed_and_the_plot_is_written(learning_run):
  trainer, out, before = learning_run
  after = nnx.to_pure_dict(trainer.state.params)
  for path, old in jax.tree_util.tree_leaves_with_path(before):
    new = after
    for k in path:
      new = new[k.key if hasattr(k, "key") else k.idx]
    assert not np.array_equal(old, np.asarray(new)), f"parameter {jax.tree_util.keystr(path)} did not change"
  assert trainer.state.skipped == 0
  assert (trainer.out_dir / "curves.png").stat().st_size > 0


def test_context_lengthening_restarts_each_stage_from_a_checkpoint_and_resumes(tmp_path):
  over = {"rollout.max_new_tokens": 8, "rollout.context_schedule": [{"start_step": 3, "max_new_tokens": 16}],
          "rollout.n": 2, "algorithm.mini_batches": 1, "checkpoint": {"every": 1, "keep": 5}, "steps": 3}
  cfg = make_config(tmp_path, **over)
  first, out1, _ = _run(cfg, until=2)
  assert out1["steps"] == 2 and [h["response/length_max"] <= 8 for h in first.history] == [True, True]
  second, out2, seen = _run(cfg)  # a fresh process resumes from the latest checkpoint
  assert out2["start_step"] == 2 and [s for s, _ in seen] == [3]
  assert second.history[0]["response/length_max"] > 8 and second.sampler.max_len == 32 + 16
  assert second.stream.get_state()["drawn"] == 3 * 4
  assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2, 3]


def test_chunked_rollout_scores_a_chunk_while_the_next_generates_and_draws_the_same_samples(tmp_path):
  """``reward_overlap_chunks``: rewards of chunk 1 start before chunk 2 is generated; the rollout is
  the one an unchunked round draws (per-row PRNG keys), rewards included."""
  import rl_testlib
  rollouts = {}
  for chunks in (1, 2):
    cfg = make_config(tmp_path / str(chunks), **{"reward.fn": "rl_testlib:timed_digit_fraction",
                                                 "rollout.reward_overlap_chunks": chunks, "rollout.prompts_per_step": 4})
    trainer = rl.RLTrainer(cfg)
    ends = []
    sampler = trainer._sampler_for(1)
    generate = sampler.generate
    sampler.generate = lambda *a, **k: (generate(*a, **k), ends.append(__import__("time").monotonic()))[0]
    rl_testlib.REWARD_STARTS.clear()
    try:
      rollouts[chunks], info = trainer.collect(1)
    finally:
      trainer.close()
    assert len(ends) == chunks and len(rl_testlib.REWARD_STARTS) == 4 * cfg.rollout.n
    if chunks == 2:
      assert min(rl_testlib.REWARD_STARTS) < ends[1], "no reward started before the second chunk finished"
  one, two = rollouts[1], rollouts[2]
  np.testing.assert_array_equal(one.tokens, two.tokens)
  np.testing.assert_array_equal(one.lengths, two.lengths)
  np.testing.assert_allclose(one.logprobs, two.logprobs, atol=1e-5)
  np.testing.assert_array_equal(one.rewards, two.rewards)
  np.testing.assert_array_equal(one.group_ids, two.group_ids)
