"""The sampler's and the engine's decode steps run the model's own block code (one implementation)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sampling_testlib import HF_FIXTURES, recomputed_logprobs

from jaxrl import models, sampling
from jaxrl.models._transformer import Attention
from jaxrl.sampling import _decode, _engine


def _eager_logprobs(model, prompts: np.ndarray, tokens: np.ndarray) -> np.ndarray:  # [B, G]
  """Trainer-style log-probs from an un-jitted forward (so it sees a patched module at once)."""
  seq = jnp.asarray(np.concatenate([prompts, tokens], axis=1), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape)
  lp = np.asarray(jax.nn.log_softmax(model(seq, positions=pos, segment_ids=jnp.ones_like(seq)), axis=-1))
  lp = lp[:, prompts.shape[1] - 1:-1]
  return np.take_along_axis(lp, tokens[..., None].astype(np.int64), axis=-1)[..., 0]


def test_decode_code_has_no_copy_of_the_attention_block():
  for module in (_decode, _engine):
    src = inspect.getsource(module)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "apply_rope", "add_lora", "rope_frequencies"):
      assert name not in src, f"{module.__name__} re-implements the block ({name})"


def test_a_change_to_the_model_block_reaches_the_sampler_and_the_engine(monkeypatch):
  # A config no other test uses: every jitted program below traces under the patch.
  model = models.init_model(models.ModelConfig.tiny(model_type="qwen3", vocab_size=96, num_layers=1, qk_norm=True),
                            seed=3)
  prompts = np.asarray([[5, 9, 17, 3], [40, 41, 42, 43]], np.int32)
  tokens = np.asarray([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], np.int32)
  plain = _eager_logprobs(model, prompts, tokens)
  project, output = Attention.project, Attention.output

  def changed_project(self, x, positions, **kw):
    q, k, v = project(self, x, positions, **kw)
    return q, k, 3.0 * v

  monkeypatch.setattr(Attention, "project", changed_project)
  monkeypatch.setattr(Attention, "output", lambda self, out, **kw: 0.5 * output(self, out, **kw) + 0.1)
  sampler = sampling.Sampler(model, None, max_len=16, eos_token_ids=[])
  engine = sampling.Engine(model, None, max_len=16, num_slots=2, block_size=4, num_blocks=16, eos_token_ids=[])
  for backend in (sampler, engine):
    out = backend.generate(prompts.tolist(), max_new_tokens=6, temperature=1.0, seed=1)
    ref = _eager_logprobs(model, prompts, out.tokens)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5, rtol=0)
  assert np.abs(_eager_logprobs(model, prompts, tokens) - plain).max() > 1e-2  # the patch changes the model


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_engine_decodes_unmerged_lora_like_the_trainer(prefill_chunk):
  """The engine's prefill and paged decode add every adapter's s·(x·A)·B, chunked or not."""
  base = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32")
  adapted = models.apply_lora(models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32"),
                              models.LoraConfig(rank=4, alpha=32), seed=0)
  graphdef, adapters, frozen = models.split_lora(adapted)
  rng = np.random.default_rng(0)
  adapters = nnx.map_state(lambda path, v: v.replace(jnp.asarray(rng.normal(0.0, 0.05, v.shape), v.dtype))
                           if str(path[-1]).endswith("_lora_b") else v, adapters)
  adapted = nnx.merge(graphdef, adapters, frozen)
  prompt = np.asarray([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]], np.int32)
  engine = sampling.Engine(adapted, None, max_len=32, num_slots=2, block_size=4, num_blocks=32, eos_token_ids=[],
                           prefill_chunk=prefill_chunk)
  out = engine.generate(prompt.tolist(), max_new_tokens=8, temperature=1.0, seed=2)
  np.testing.assert_allclose(out.logprobs, recomputed_logprobs(adapted, prompt, out.tokens, 1.0), atol=1e-5, rtol=0)
  assert np.abs(out.logprobs - recomputed_logprobs(base, prompt, out.tokens, 1.0)).max() > 1e-3  # adapters applied
