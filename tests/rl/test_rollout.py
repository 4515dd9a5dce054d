"""Rollout batches on the host: dynamic-sampling filter, overlong masks, group selection, advantages."""

import numpy as np
import pytest

from jaxrl import rl


def _rollout(rewards, truncated, lengths=None, group_size=2):
  n = len(rewards)
  lengths = np.full(n, 4, np.int32) if lengths is None else np.asarray(lengths, np.int32)
  return rl.Rollout(
      prompt_ids=tuple(np.arange(1, 4, dtype=np.int32) + i for i in range(n)), tokens=np.ones((n, 4), np.int32),
      logprobs=np.zeros((n, 4), np.float32), lengths=lengths, truncated=np.asarray(truncated, bool),
      group_ids=np.repeat(np.arange(n // group_size, dtype=np.int32), group_size),
      rewards=np.asarray(rewards, np.float32), task_rewards=np.asarray(rewards, np.float32),
      texts=tuple(str(i) for i in range(n)))


def test_informative_groups_are_those_with_unequal_rewards():
  rewards = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, -5, 5, 2])
  groups = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4])
  np.testing.assert_array_equal(rl.informative_groups(rewards, groups, 5), [False, True, False, True, False])


def test_selected_groups_are_renumbered_and_keep_their_samples():
  ro = _rollout([0, 1, 1, 1, 0, 0, 1, 0], [False] * 8)
  keep = rl.informative_groups(ro.rewards, ro.group_ids, ro.num_groups)
  np.testing.assert_array_equal(keep, [True, False, False, True])
  sel = ro.select_groups(np.flatnonzero(keep))
  np.testing.assert_array_equal(sel.group_ids, [0, 0, 1, 1])
  assert sel.texts == ("0", "1", "6", "7")
  both = rl.concat_rollouts([sel, sel])
  np.testing.assert_array_equal(both.group_ids, [0, 0, 1, 1, 2, 2, 3, 3])


def test_kept_groups_have_nonzero_advantage_variance():
  rng = np.random.default_rng(0)
  ro = _rollout(rng.integers(0, 2, size=64).astype(np.float32), [False] * 64, group_size=4)
  kept = ro.select_groups(np.flatnonzero(rl.informative_groups(ro.rewards, ro.group_ids, ro.num_groups)))
  assert 0 < kept.num_groups < ro.num_groups
  adv, _ = rl.compute_advantages(kept, name="grpo", options={})
  for g in range(kept.num_groups):
    assert adv[kept.group_ids == g, 0].var() > 0.1


def test_overlong_filter_masks_exactly_the_truncated_responses():
  ro = _rollout([0, 1, 1, 0], [True, False, False, True], lengths=[4, 2, 3, 4])
  full = rl.loss_mask(ro, overlong_filter=False)
  np.testing.assert_array_equal(full.sum(1), [4, 2, 3, 4])
  mask = rl.loss_mask(ro, overlong_filter=True)
  np.testing.assert_array_equal(mask.sum(1), [0, 2, 3, 0])
  np.testing.assert_array_equal(mask[1:3], full[1:3])
  # The filtered responses still count in their group's baseline (GRPO+): advantages are unchanged.
  adv, _ = rl.compute_advantages(ro, name="grpo", options={})
  assert adv[0, 0] < 0 < adv[1, 0]


def test_sequence_fields_place_response_targets_after_the_prompt():
  ro = _rollout([0, 1], [False, True], lengths=[2, 4])
  adv = np.arange(8, dtype=np.float32).reshape(2, 4)
  seqs = rl.sequence_fields(ro, adv, rl.loss_mask(ro, overlong_filter=True))
  s = seqs[0]
  np.testing.assert_array_equal(s["tokens"], [1, 2, 3, 1])  # prompt + response[:-1]
  np.testing.assert_array_equal(s["targets"], [2, 3, 1, 1])
  np.testing.assert_array_equal(s["loss_mask"], [0, 0, 1, 1])
  np.testing.assert_array_equal(s["advantages"], [0, 0, 0, 1])
  assert seqs[1]["loss_mask"].sum() == 0 and len(seqs[1]["tokens"]) == 3 + 4 - 1


def test_prompt_stream_is_a_resumable_seeded_shuffle():
  a = rl.PromptStream(5, seed=3)
  first, ids = a.take(7)
  assert sorted(first[:5]) == list(range(5)) and ids == list(range(7))
  state = a.get_state()
  nxt = a.take(6)
  b = rl.PromptStream(5, seed=3)
  b.set_state(state)
  assert b.take(6) == nxt


def test_arithmetic_reward_is_exact_match_of_the_answer():
  assert rl.arithmetic_reward("", "3*4=12; 1+12=13. Answer: 13", answer="13").value == 1.0
  wrong = rl.arithmetic_reward("", "Answer: 12", answer="13")
  assert wrong.value == 0.0 and wrong.info["reason"] == "wrong_answer"
  assert rl.arithmetic_reward("", "13", answer="13").info["reason"] == "no_answer"


def test_weighted_reward_adds_format_and_accuracy_like_r1():
  from jaxrl.rewards import load_reward
  fn = load_reward("jaxrl.rl:weighted_reward", components={"acc": "jaxrl.rl:arithmetic_reward", "fmt": "format"},
                   weights={"fmt": 0.5})
  assert fn("", "<think>3+4=7</think> Answer: 7", answer="7").value == 1.5
  assert fn("", "Answer: 7", answer="7").value == 1.0


def test_advantages_run_as_one_program_with_the_eager_values_and_untraceable_estimators_still_run():
  import jax.numpy as jnp
  from jaxrl import losses
  rng = np.random.default_rng(1)
  ro = _rollout(rng.normal(size=16).astype(np.float32), [False] * 16, lengths=rng.integers(1, 5, 16), group_size=4)
  arrays = dict(rewards=jnp.asarray(ro.rewards), group_ids=jnp.asarray(ro.group_ids),
                response_mask=jnp.asarray(ro.response_mask()))
  for name, options in [("grpo", {}), ("grpo", {"std_normalize": False}), ("rloo", {})]:
    adv, metrics = rl.compute_advantages(ro, name=name, options=options)
    want, want_metrics = losses.ADVANTAGES[name](**arrays, num_groups=4, **options)
    np.testing.assert_allclose(adv, np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=f"{name} {options}")
    assert metrics == pytest.approx({f"advantage/{k}": float(v) for k, v in want_metrics.items()}, rel=1e-6, abs=1e-6)

  def host_mean(rewards, group_ids, response_mask, num_groups, scale=1.0):  # reads values on the host
    centred = rewards - float(np.asarray(rewards).mean())
    return scale * centred[:, None] * response_mask, {"host": float(np.asarray(rewards).mean())}

  losses.register_advantage("test_host_mean", overwrite=True)(host_mean)
  try:
    for _ in range(2):  # the fallback is remembered: the second call goes straight to the eager path
      adv, metrics = rl.compute_advantages(ro, name="test_host_mean", options={"scale": 2.0})
      np.testing.assert_allclose(adv, 2.0 * (ro.rewards - ro.rewards.mean())[:, None] * ro.response_mask(), rtol=1e-6)
      assert metrics["advantage/host"] == pytest.approx(float(ro.rewards.mean()))
  finally:
    losses.ADVANTAGES.pop("test_host_mean")
