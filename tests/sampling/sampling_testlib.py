"""Helpers shared by the sampler tests: fixture paths and trainer-style log-prob recomputation."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HF_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FIXTURE_NAMES = ("llama_gqa", "qwen2_tied", "qwen3")


@functools.lru_cache(maxsize=8)
def _log_softmax_fn(graphdef):
  @jax.jit
  def f(state, tokens, temperature):  # [B, T], [] -> [B, T, V]
    m = nnx.merge(graphdef, state)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits = m(tokens, positions=pos, segment_ids=jnp.ones_like(tokens))
    return jax.nn.log_softmax(logits / temperature, axis=-1)
  return f


def recomputed_log_softmax(model, prompts: np.ndarray, tokens: np.ndarray, temperature: float) -> np.ndarray:
  """Trainer-style: one forward over prompt + completion; ``log_softmax(logits / T)`` per completion slot.

  Args:
    model: the model.
    prompts: ``[B, P]`` prompts (all of length P).
    tokens: ``[B, G]`` completions.
    temperature: T.

  Returns:
    ``[B, G, V]`` float32: the distribution that produced completion token t.
  """
  graphdef, state = nnx.split(model)
  seq = np.concatenate([prompts, tokens], axis=1).astype(np.int32)
  lp = _log_softmax_fn(graphdef)(state, jnp.asarray(seq), jnp.float32(temperature))
  return np.asarray(lp)[:, prompts.shape[1] - 1:-1]


def recomputed_logprobs(model, prompts: np.ndarray, tokens: np.ndarray, temperature: float) -> np.ndarray:
  """``[B, G]`` log-prob of each completion token (see :func:`recomputed_log_softmax`)."""
  lp = recomputed_log_softmax(model, prompts, tokens, temperature)
  return np.take_along_axis(lp, tokens[..., None].astype(np.int64), axis=-1)[..., 0]
