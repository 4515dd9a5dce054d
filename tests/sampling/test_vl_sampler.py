"""The whole-batch sampler on Qwen2.5-VL / Qwen2-VL: prompts with images, M-RoPE through decode.

References: transformers 5.24's greedy ``generate`` and its per-step logits (``generate.npz`` of
``tests/fixtures/make_vlm_fixtures.py``), a teacher-forced forward over prompt + completion with the
sequence's own ``mrope_positions`` and images (the trainer's view), and an uninterrupted run (for
resume with a cache recompute and fork).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampling_testlib import HF_FIXTURES
from vl_testlib import KINDS, count_tower_runs, fixture_prompts, generate_reference, teacher_forced_logprobs, vl_model

from jaxrl import models, sampling


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers_generate(kind):
  model, gen = vl_model(kind), generate_reference(kind)
  prompt = fixture_prompts(kind)[0]
  vocab = model.cfg.vocab_size
  sampler = sampling.Sampler(model, max_len=96, eos_token_ids=[])
  out = sampler.generate([prompt], n=2, max_new_tokens=8, temperature=0.0, return_top_logprobs=vocab)
  steps = gen["tokens"].shape[1]
  for row in range(2):  # both samples of the group: prefilled once, copied
    np.testing.assert_array_equal(out.tokens[row], gen["tokens"][0])
    ids, values = out.top_logprobs.ids[row], out.top_logprobs.logprobs[row]  # [G, V]
    got = np.zeros((steps, vocab))
    np.put_along_axis(got, ids.astype(np.int64), values, axis=-1)
    want = _log_softmax(gen["logits"][0])  # the full next-token distribution per step
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_sampled_logprobs_equal_a_teacher_forced_forward():
  """Mixed batch: one image, two images, an image in a later turn, text only; n = 3 samples each."""
  model = vl_model("qwen2_5_vl")
  prompts = fixture_prompts("qwen2_5_vl")
  sampler = sampling.Sampler(model, max_len=160, eos_token_ids=[])
  temperature = 1.3
  out = sampler.generate(prompts, n=3, max_new_tokens=6, temperature=temperature, seed=5)
  assert len(set(map(tuple, out.tokens.tolist()))) > 4  # really sampled
  for row in range(len(prompts) * 3):
    want = teacher_forced_logprobs(model, prompts[out.prompt_index[row]], out.tokens[row], temperature)
    np.testing.assert_allclose(out.logprobs[row], want, rtol=0, atol=2e-5)


def test_the_tower_runs_once_per_prompt_not_per_sample():
  model = vl_model("qwen2_5_vl")
  prompts = fixture_prompts("qwen2_5_vl")
  sampling.sampler_programs.cache_clear()  # trace afresh, with the counting tower
  with count_tower_runs() as runs:
    sampler = sampling.Sampler(model, max_len=160, eos_token_ids=[])
    part = sampler.generate(prompts, n=4, max_new_tokens=6, temperature=1.0, max_steps=2)
    jax.effects_barrier()
    assert runs == [4]  # one run over the 4 prompt rows, not the 16 sample rows
    out = sampler.resume(part.state, new_model=model)  # the cache recompute: again once per prompt
    jax.effects_barrier()
  sampling.sampler_programs.cache_clear()
  assert runs == [4, 4]
  assert out.tokens.shape[0] == 16


def test_resume_with_recompute_and_fork_keep_images_and_rope_positions():
  kind = "qwen2_vl"  # the other kind of the logprob test above
  model, gen = vl_model(kind), generate_reference(kind)
  prompts = fixture_prompts(kind)[:2] + fixture_prompts(kind)[3:]
  sampler = sampling.Sampler(model, max_len=160, eos_token_ids=[])
  whole = sampler.generate(prompts, max_new_tokens=8, temperature=0.0)
  np.testing.assert_array_equal(whole.tokens[0], gen["tokens"][0])
  part = sampler.generate(prompts, max_new_tokens=8, temperature=0.0, max_steps=3)
  branches = sampler.fork(part.state, rows=[0, 1], k=2)
  resumed = sampler.resume(part.state, new_model=model)  # recompute every row's cache: images, rope positions
  np.testing.assert_array_equal(resumed.tokens, whole.tokens)
  forked = sampler.resume(branches, new_model=model)
  np.testing.assert_array_equal(forked.tokens, whole.tokens[[0, 0, 1, 1]])


def test_text_only_vlm_prompts_decode_with_one_dimensional_rope():
  """A VLM's text-only prompt decodes with delta 0 (its rope positions equal the 1-D ones): the same tokens
  as the plain model path with 1-D RoPE, through the model's own cache path."""
  model = vl_model("qwen2_vl")
  prompt = fixture_prompts("qwen2_vl")[3]
  out = sampling.Sampler(model, max_len=96, eos_token_ids=[]).generate([prompt], max_new_tokens=6, temperature=0.0)
  want = teacher_forced_logprobs(model, prompt, out.tokens[0], 1.0)
  np.testing.assert_allclose(out.logprobs[0], want, rtol=0, atol=2e-5)


def test_bad_images_are_refused():
  model = vl_model("qwen2_5_vl")
  prompt = fixture_prompts("qwen2_5_vl")[0]
  sampler = sampling.Sampler(model, max_len=96, eos_token_ids=[])
  with pytest.raises(ValueError, match=r"prompts\[0\].*placeholder"):
    sampler.generate([prompt["tokens"]], max_new_tokens=2)  # image tokens without their image
  with pytest.raises(ValueError, match=r"images: expected one entry"):
    sampler.generate([prompt["tokens"]], images=[None, None], max_new_tokens=2)
  short = dict(prompt, pixel_values=prompt["pixel_values"][:8])
  with pytest.raises(ValueError, match=r"images\[0\]: pixel_values"):
    sampler.generate([short], max_new_tokens=2)
  text = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32")
  with pytest.raises(ValueError, match="no vision tower"):
    sampling.Sampler(text, max_len=96).generate([[1, 2, 3]], images=[prompt], max_new_tokens=2)
