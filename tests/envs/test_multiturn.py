"""Multi-turn rollouts: observation tokens masked, the log-prob contract, and gradient isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import envs, losses
from jaxrl.rl import AlgorithmConfig, compute_advantages, loss_mask, make_loss_fn, make_prepare, pack_sequences
from jaxrl.rl import policy_logprobs, sequence_fields

import envs_testlib

ROW_LEN = 128


@pytest.fixture(scope="module")
def agent_batch(tiny_sampler, tiny_tokenizer):
  driver = envs.MultiTurnRollout(tiny_sampler, tiny_tokenizer, envs.env_factory("scripted_tools", observations=2),
                                 max_turns=6, max_turn_tokens=10, max_prompt_tokens=32)
  batch = driver.run([{"prompt": "12+34"}, {"prompt": "5*6"}], n=2, max_new_tokens=80, request_ids=[3, 4],
                     options=envs.SamplingOptions(temperature=1.0, seed=0))
  driver.close()
  return batch


def test_observations_are_template_tokens_with_zero_policy_mask(agent_batch, tiny_tokenizer):
  ro = agent_batch.to_rollout(tiny_tokenizer)
  assert ro.tokens.shape[0] == 4 and (ro.group_ids == [0, 0, 1, 1]).all()
  for i, t in enumerate(agent_batch.trajectories):
    mask = ro.policy_mask[i, :ro.lengths[i]]
    obs = [k for k in range(len(mask)) if mask[k] == 0]
    assert obs, "the scripted environment answers every trajectory's first turns"
    assert (ro.logprobs[i, obs] == 0).all()
    text = tiny_tokenizer.decode(ro.tokens[i, obs].tolist(), skip_special_tokens=False)
    assert "<|im_start|>tool\nresult 1<|im_end|>\n<|im_start|>assistant\n" in text
    assert t.turns == 3 or t.finish == "length"
  # The loss mask is the response mask times the policy mask: observation tokens are never trained on.
  np.testing.assert_array_equal(loss_mask(ro, overlong_filter=False), ro.response_mask() * ro.policy_mask)


def _packed(ro, *, advantage="grpo"):
  adv, _ = compute_advantages(ro, name=advantage, options={})
  seqs = sequence_fields(ro, adv, loss_mask(ro, overlong_filter=False))
  pb = pack_sequences(seqs, row_len=ROW_LEN, rows=len(seqs), bucket="exact")
  assert pb.shape[0] == 1
  return {k: jnp.asarray(v) for k, v in pb.micro_batch(0).items()}


def test_multi_turn_policy_logprobs_equal_the_samplers(agent_batch, tiny_model, tiny_tokenizer):
  ro = agent_batch.to_rollout(tiny_tokenizer)
  mb = _packed(ro)
  graphdef, params = nnx.split(tiny_model)
  lp = np.asarray(policy_logprobs(graphdef, params, mb, temperature=1.0, chunk_size=1024))
  mask = np.asarray(mb["loss_mask"]) > 0
  assert mask.sum() == ro.policy_mask.sum()  # every policy token, and only those
  np.testing.assert_allclose(lp[mask], np.asarray(mb["sampler_logprobs"])[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "prompt_mean"])
def test_tool_tokens_contribute_nothing_to_gradient_or_counts(agent_batch, tiny_model, tiny_tokenizer, aggregation):
  ro = agent_batch.to_rollout(tiny_tokenizer)
  mb = _packed(ro)
  graphdef, params = nnx.split(tiny_model)
  old = policy_logprobs(graphdef, params, mb, temperature=1.0, chunk_size=1024)
  mb = dict(mb, old_logprobs=old - 0.05 * mb["loss_mask"], mb_index=mb["mb_index"])
  tool, bad = envs_testlib.perturb_tool_tokens(mb)  # tool-output positions, their training signals perturbed
  algo = AlgorithmConfig(aggregation=aggregation, kl_coef=0.0, entropy_coef=0.01)
  prepare = make_prepare(algo, num_groups=2, max_len=80)
  loss_fn = make_loss_fn(graphdef, algo, temperature=1.0, num_micro=1)

  def grads(batch):
    batch = prepare(batch)
    (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, jnp.asarray(False))
    return batch["weights"], loss, metrics, g

  w0, l0, m0, g0 = grads(mb)
  w1, l1, m1, g1 = grads(bad)
  assert tool.sum() > 0
  np.testing.assert_array_equal(np.asarray(w0), np.asarray(w1))  # every aggregation count
  assert float(m0["loss_tokens"]) == float(m1["loss_tokens"]) == float(ro.policy_mask.sum())
  assert float(l0) == float(l1)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g0))
  # Control: had the tool tokens been counted, the aggregation weights would differ.
  counted = jnp.where(jnp.asarray(tool), 1.0, mb["loss_mask"])
  wrong = losses.loss_weights(counted, mode=aggregation, group_ids=mb["group_ids"], num_groups=2,
                              segment_ids=mb["segment_ids"], max_len=80)
  assert not np.array_equal(np.asarray(w0), np.asarray(wrong))


def test_engine_multi_turn_equals_the_sampler_path(agent_batch, tiny_engine, tiny_model, tiny_tokenizer):
  """Continuous batching on the Engine: every turn a request of its own, submitted when its
  observation is ready; the trajectories are the Sampler path's, token for token."""
  driver = envs.MultiTurnRollout(tiny_engine, tiny_tokenizer, envs.env_factory("scripted_tools", observations=2),
                                 max_turns=6, max_turn_tokens=10, max_prompt_tokens=32)
  try:
    batch = driver.run([{"prompt": "12+34"}, {"prompt": "5*6"}], n=2, max_new_tokens=80, request_ids=[3, 4],
                       options=envs.SamplingOptions(temperature=1.0, seed=0))
  finally:
    driver.close()
  assert batch.stats["generate_calls"] > 3  # turns were submitted as observations became ready
  ref, got = agent_batch.arrays(), batch.arrays()
  for key in ("tokens", "policy_mask", "lengths", "rewards", "truncated"):
    np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
  np.testing.assert_allclose(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
  assert [t.turns for t in batch.trajectories] == [t.turns for t in agent_batch.trajectories]
  # The log-prob contract holds for the engine's trajectories too (float32, 1e-5).
  ro = batch.to_rollout(tiny_tokenizer)
  mb = _packed(ro)
  graphdef, params = nnx.split(tiny_model)
  lp = np.asarray(policy_logprobs(graphdef, params, mb, temperature=1.0, chunk_size=1024))
  mask = np.asarray(mb["loss_mask"]) > 0
  assert mask.sum() == ro.policy_mask.sum()
  np.testing.assert_allclose(lp[mask], np.asarray(mb["sampler_logprobs"])[mask], atol=1e-5, rtol=0)
