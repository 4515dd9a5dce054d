"""ARPO rollouts: the branching rule, exact accounting (M per question), branching only after tool
calls, α = β = 0 as plain GRPO, and the shared-prefix structure arpo_hard / arpo_soft receive."""

import math

import numpy as np
import pytest

from jaxrl import envs
from jaxrl.rl import compute_advantages

K = 3  # probe tokens


def test_entropy_delta_and_branch_probability_by_hand():
  h_t, h0 = np.array([2.0, 3.0, 1.0]), np.array([1.0, 1.0])
  assert envs.entropy_delta(h_t, h0, vocab_size=100) == pytest.approx((1.0 + 2.0) / 100)
  assert envs.entropy_delta(h_t, h0, vocab_size=100, normalize="mean") == pytest.approx(1.5)
  assert envs.branch_probability(0.5, alpha=0.5, beta=0.2) == pytest.approx(0.6)
  with pytest.raises(ValueError, match="arpo.branches"):
    envs.ArpoConfig(branches=0)


def test_shared_prefix_ids_of_a_hand_built_tree():
  # 0 root (10 tokens); 1 and 2 branch from 0 after 4 tokens; 3 branches from 1 after 6; 4 is independent.
  ids, nxt = envs.shared_prefix_ids([None, 0, 0, 1, None], [0, 4, 4, 6, 0], [10, 8, 9, 7, 5], width=10, first_id=5)
  want = np.full((5, 10), -1)
  want[:4, :4] = 5  # node {0, 1, 2, 3}
  want[[1, 3], 4:6] = 6  # node {1, 3}
  np.testing.assert_array_equal(ids, want)
  assert nxt == 7


def _driver(sampler, tok, observations):
  return envs.MultiTurnRollout(sampler, tok, envs.env_factory("scripted_tools", observations=observations),
                               max_turns=6, max_turn_tokens=8, max_prompt_tokens=32)


RECORDS = [{"prompt": "12+34"}, {"prompt": "5*6"}]


@pytest.fixture(scope="module", params=["sampler", "engine"])
def branched(request, tiny_tokenizer):
  """One ARPO rollout on the Sampler (probe, fork) and one on the Engine (public API: entropies,
  branches submitted as requests with the shared prefix)."""
  arpo = envs.ArpoConfig(initial_samples=2, entropy_tokens=K, alpha=1.0, beta=0.0, threshold=0.5, branches=2)
  d = _driver(request.getfixturevalue(f"tiny_{request.param}"), tiny_tokenizer, observations=2)
  try:
    return d.run(RECORDS, n=5, max_new_tokens=80, request_ids=[7, 8], arpo=arpo)
  finally:
    d.close()


def test_arpo_samples_exactly_m_per_question_and_branches_only_after_tool_calls(branched):
  ts = branched.trajectories
  assert [sum(t.group == g for t in ts) for g in range(2)] == [5, 5]
  assert branched.stats["branch_paths"] == 6 and branched.stats["topups"] == 0  # M − N = 3 per question
  children = [t for t in ts if t.parent is not None]
  assert len(children) == 6
  for c in children:
    p = next(t for t in ts if t.group == c.group and t.index == c.parent)
    b = c.branch_pos
    assert c.tokens[:b] == p.tokens[:b] and c.policy[:b] == p.policy[:b]  # the shared prefix
    assert c.logprobs[:b] == p.logprobs[:b]
    assert c.policy[b - K:b] == [1.0] * K  # the k probe tokens the entropy was measured on ...
    assert c.policy[b - K - 1] == 0.0  # ... directly after a tool observation


def test_no_tool_call_means_no_branch_and_top_ups_fill_the_group(tiny_sampler, tiny_tokenizer):
  arpo = envs.ArpoConfig(initial_samples=2, entropy_tokens=K, alpha=1.0, beta=0.0, threshold=0.5, branches=2)
  d = _driver(tiny_sampler, tiny_tokenizer, observations=0)
  batch = d.run(RECORDS[:1], n=4, max_new_tokens=80, request_ids=[7], arpo=arpo)
  d.close()
  assert len(batch.trajectories) == 4 and batch.stats["branch_events"] == 0 and batch.stats["topups"] == 2
  assert all(t.parent is None for t in batch.trajectories)


@pytest.mark.parametrize("backend", ["sampler", "engine"])
def test_alpha_beta_zero_is_trajectory_level_grpo(backend, request, tiny_tokenizer):
  d = _driver(request.getfixturevalue(f"tiny_{backend}"), tiny_tokenizer, observations=1)
  plain = d.run(RECORDS, n=4, max_new_tokens=80, request_ids=[7, 8])
  arpo = d.run(RECORDS, n=4, max_new_tokens=80, request_ids=[7, 8],
               arpo=envs.ArpoConfig(initial_samples=2, entropy_tokens=K, alpha=0.0, beta=0.0, threshold=0.5))
  d.close()
  assert arpo.stats["branch_events"] == 0 and arpo.stats["topups"] == 4
  a, b = plain.arrays(), arpo.arrays()
  for k in ("tokens", "policy_mask", "lengths", "group_ids", "rewards"):
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-6)
  assert (b["prefix_ids"] == -1).all()
  ro = arpo.to_rollout()
  grpo, _ = compute_advantages(ro, name="grpo", options={})
  for name in ("arpo_hard", "arpo_soft"):
    np.testing.assert_array_equal(compute_advantages(ro, name=name, options={})[0], grpo, err_msg=name)


def test_arpo_advantages_see_the_branch_tree(branched):
  ro = branched.to_rollout()
  ts = branched.trajectories
  grpo, _ = compute_advantages(ro, name="grpo", options={})
  hard, hm = compute_advantages(ro, name="arpo_hard", options={})
  soft, sm = compute_advantages(ro, name="arpo_soft", options={})
  np.testing.assert_array_equal(soft, grpo)  # soft attribution: the GRPO advantages, on duplicated prefixes
  seq = grpo[:, 0]

  def root(i):
    while ts[i].parent is not None:
      i = next(j for j, t in enumerate(ts) if t.group == ts[i].group and t.index == ts[i].parent)
    return i

  # Independent of prefix_ids: rows of one family whose tokens agree up to t share token t.
  want = np.array(grpo)
  shared = 0
  for i, t in enumerate(ts):
    for pos in range(len(t.tokens)):
      same = [j for j, u in enumerate(ts) if root(j) == root(i) and len(u.tokens) > pos
              and u.tokens[:pos + 1] == t.tokens[:pos + 1]]
      if len(same) > 1:
        want[i, pos] = seq[same].mean()
        shared += 1
  assert shared > 0
  np.testing.assert_allclose(hard, want, atol=1e-6)
  assert hm["advantage/shared_token_fraction"] == pytest.approx(shared / ro.lengths.sum())
  assert sm["advantage/shared_token_fraction"] == pytest.approx(shared / ro.lengths.sum())
  assert not math.isclose(float(np.abs(hard - grpo).sum()), 0.0)


def test_branched_rollouts_keep_the_log_prob_contract(branched, tiny_model, tiny_tokenizer):
  """The trainer's recomputed log-probs of every policy token of the branched rollout (shared
  prefixes, probe tokens, continuations) equal the rollout's own within 1e-5 (float32)."""
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.rl import loss_mask, pack_sequences, policy_logprobs, sequence_fields
  ro = branched.to_rollout(tiny_tokenizer)
  adv, _ = compute_advantages(ro, name="arpo_hard", options={})
  seqs = sequence_fields(ro, adv, loss_mask(ro, overlong_filter=False))
  pb = pack_sequences(seqs, row_len=128, rows=len(seqs), bucket="exact")
  assert pb.shape[0] == 1
  mb = {k: jnp.asarray(v) for k, v in pb.micro_batch(0).items()}
  graphdef, params = nnx.split(tiny_model)
  lp = np.asarray(policy_logprobs(graphdef, params, mb, temperature=1.0, chunk_size=1024))
  mask = np.asarray(mb["loss_mask"]) > 0
  assert mask.sum() == ro.policy_mask.sum()
  np.testing.assert_allclose(lp[mask], np.asarray(mb["sampler_logprobs"])[mask], atol=1e-5, rtol=0)


def test_engine_arpo_needs_entropies(tiny_model, tiny_tokenizer):
  from jaxrl import sampling
  engine = sampling.Engine(tiny_model, tiny_tokenizer, max_len=128, num_slots=4, num_blocks=40, block_size=16)
  d = _driver(engine, tiny_tokenizer, observations=1)
  with pytest.raises(ValueError, match="entropy=True"):
    d.run(RECORDS[:1], n=2, max_new_tokens=8, request_ids=[0], arpo=envs.ArpoConfig(initial_samples=1))
  d.close()
