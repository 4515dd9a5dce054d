"""The rollout engine on Qwen2.5-VL / Qwen2-VL: paged, chunked prefill with images, M-RoPE decode deltas per
slot, preemption and weight-update recompute.

References: transformers 5.24's greedy ``generate`` with its per-step logits (``generate.npz``), and the
whole-batch sampler (itself checked against a teacher-forced forward in test_vl_sampler.py) for the same
rows and draws.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from vl_testlib import KINDS, count_tower_runs, fixture_prompts, generate_reference, vl_model

from jaxrl import sampling


def _engine(model, **kw):
  """Small blocks and chunks: the image of the generate prompt (tokens 30..33) straddles two chunks. A pool
  of 29 blocks of 4 holds one 112-token row: rows of 50..90 prompt tokens growing 24 preempt each other."""
  args = dict(max_len=112, num_slots=4, block_size=4, num_blocks=128, steps_per_call=8, prefill_chunk=16,
              eos_token_ids=[])
  return sampling.Engine(model, **{**args, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_preemption_equals_transformers_generate(kind):
  model, gen = vl_model(kind), generate_reference(kind)
  prompts = fixture_prompts(kind)  # one image, two images, an image in a later turn, text only
  vocab = model.cfg.vocab_size
  engine = _engine(model, num_blocks=29, max_top_logprobs=vocab)
  out = engine.generate(prompts, n=2, max_new_tokens=24, temperature=0.0, return_top_logprobs=vocab)
  assert engine.metrics.preemptions > 0
  steps = gen["tokens"].shape[1]  # greedy: the first 8 of 24 tokens are transformers' 8
  want = gen["logits"][0].astype(np.float64)
  want = want - want.max(-1, keepdims=True)
  want = want - np.log(np.exp(want).sum(-1, keepdims=True))
  for row in (0, 1):
    np.testing.assert_array_equal(out.tokens[row, :steps], gen["tokens"][0])
    got = np.zeros((steps, vocab))
    ids, values = out.top_logprobs.ids[row, :steps], out.top_logprobs.logprobs[row, :steps]
    np.put_along_axis(got, ids.astype(np.int64), values, axis=-1)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_sampled_mixed_batch_equals_the_sampler_through_preemption():
  model = vl_model("qwen2_5_vl")
  prompts = fixture_prompts("qwen2_5_vl")
  kw = dict(n=2, max_new_tokens=20, temperature=1.2, top_k=40, seed=11)
  engine = _engine(model, num_blocks=29)
  out = engine.generate(prompts, **kw)
  assert engine.metrics.preemptions > 0
  dense = sampling.Sampler(model, max_len=112, eos_token_ids=[]).generate(prompts, **kw)
  np.testing.assert_array_equal(out.tokens, dense.tokens)
  np.testing.assert_allclose(out.logprobs, dense.logprobs, rtol=0, atol=2e-5)


def test_the_tower_runs_once_per_prompt_and_weight_updates_recompute():
  model = vl_model("qwen2_5_vl")
  prompts = fixture_prompts("qwen2_5_vl")
  requests = [sampling.Request(prompt=p["tokens"], images=p if "grid_thw" in p else None, n=3, max_new_tokens=8,
                               temperature=0.0, request_id=i) for i, p in enumerate(prompts)]
  sampling.engine_programs.cache_clear()  # trace afresh, with the counting tower
  with count_tower_runs() as runs:
    engine = _engine(model, steps_per_call=2)
    engine.submit(requests)
    whole = {c.index: c for c in engine.completions()}
    jax.effects_barrier()
    # three image prompts (each its own patch bucket), three samples each: three one-row tower runs, not nine
    assert runs == [1, 1, 1] and engine.metrics.tower_calls == 3
    engine.submit(requests)
    before = engine.metrics.generated_tokens
    while engine.metrics.generated_tokens < before + 4:  # rows mid-completion
      engine.step()
    running = len(engine._running)
    engine.update_weights(model, mode="interrupt")  # running rows recompute their caches, images included
    done = {c.index: c for c in engine.completions()}
    jax.effects_barrier()
  sampling.engine_programs.cache_clear()
  assert engine.metrics.interruptions == running > 0
  assert len(runs) > 6  # the recompute ran the tower again
  for i in range(len(prompts) * 3):
    np.testing.assert_array_equal(done[i].tokens, whole[i].tokens)
  assert max(c.versions[-1] for c in done.values()) == 1


def test_paged_sampler_serves_images_through_the_engine():
  model = vl_model("qwen2_vl")
  prompts = fixture_prompts("qwen2_vl")
  paged = sampling.Sampler(model, max_len=112, eos_token_ids=[], paged=True)
  out = paged.generate(prompts, n=2, max_new_tokens=6, temperature=0.0)
  assert paged.compile_counts["embed"] > 0
  dense = sampling.Sampler(model, max_len=112, eos_token_ids=[]).generate(prompts, n=2, max_new_tokens=6,
                                                                           temperature=0.0)
  np.testing.assert_array_equal(out.tokens, dense.tokens)


def test_engine_refuses_mismatched_images():
  model = vl_model("qwen2_5_vl")
  prompt = fixture_prompts("qwen2_5_vl")[0]
  engine = _engine(model)
  with pytest.raises(ValueError, match=r"requests\[0\].*placeholder"):
    engine.submit([sampling.Request(prompt=prompt["tokens"], max_new_tokens=2)])
  assert engine.idle
