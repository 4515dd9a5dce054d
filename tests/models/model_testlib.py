"""Helpers shared by the model tests: fixture paths, a small shardable config, and jitted entry points.

The jitted functions take the ``GraphDef`` as a static argument, so every test that runs the same
architecture at the same shapes reuses one compilation.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import models
from jaxrl.models import ModelConfig

HF_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FIXTURE_NAMES = ("llama_gqa", "qwen2_tied", "qwen3")

TEST_CFG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=8, qk_norm=True, tie_word_embeddings=False)
"""Every dimension divides the 8-device meshes of test_sharding: D=64, F=128, V=256, N=8, K=4."""


@functools.partial(jax.jit, static_argnames=("graphdef", "return_hidden"))
def _forward(graphdef, state, tokens, positions, segment_ids, return_hidden=False):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions=positions, segment_ids=segment_ids, return_hidden=return_hidden)


def forward(model, tokens, positions, segment_ids, *, return_hidden=False) -> jax.Array:
  graphdef, state = nnx.split(model)
  return _forward(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids),
                  return_hidden=return_hidden)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _cached(graphdef, state, cache, tokens, positions, segment_ids, start):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions=positions, segment_ids=segment_ids, cache=cache, cache_start=start)


def cached_step(model, cache, tokens, positions, segment_ids, start):
  """``(logits, new_cache)`` of one prefill or decode call."""
  graphdef, state = nnx.split(model)
  return _cached(graphdef, state, cache, *(jnp.asarray(x, jnp.int32) for x in (tokens, positions, segment_ids, start)))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits_and_grads(graphdef, state, tokens, positions, segment_ids):
  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segment_ids)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return jnp.sum(nll * mask) / jnp.sum(mask), logits

  (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(state)
  return logits, grads


def logits_and_grads(model, tokens, positions, segment_ids):
  """Logits and the gradient of the next-token NLL (mean over in-segment pairs) w.r.t. every parameter."""
  graphdef, state = nnx.split(model)
  return _logits_and_grads(graphdef, state, tokens, positions, segment_ids)


def flat_arrays(state) -> dict:
  """``{path: np.ndarray}``; a loop model's ``('layers', i, ...)`` entries are stacked as in a scanned one."""
  out, per_layer = {}, {}
  for path, var in nnx.to_flat_state(state):
    if path[0] == "layers" and isinstance(path[1], int):
      per_layer.setdefault(("layers", *path[2:]), {})[path[1]] = np.asarray(var.get_value())
    else:
      out[path] = np.asarray(var.get_value())
  for path, layers in per_layer.items():
    out[path] = np.stack([layers[i] for i in sorted(layers)])
  return out


def packed_batch():
  """``[8, 16]`` rows each packing two sequences (lengths 9 and 5) and 2 padding tokens."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, TEST_CFG.vocab_size, size=(8, 16)).astype(np.int32)
  seg = np.concatenate([np.full(9, 1), np.full(5, 2), np.zeros(2)]).astype(np.int32)
  pos = np.concatenate([np.arange(9), np.arange(5), np.zeros(2)]).astype(np.int32)
  return tokens, np.tile(pos, (8, 1)), np.tile(seg, (8, 1))


def arange_positions(tokens: np.ndarray) -> np.ndarray:
  return np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape).copy()


def o1_model(cfg: ModelConfig = TEST_CFG, seed: int = 0):
  """A random model with O(1) logits: the 0.02-std matrices of the default init scaled by 6."""
  model = models.init_model(cfg, seed=seed)
  graphdef, state = nnx.split(model)
  state = nnx.map_state(
      lambda path, v: v.replace(v.get_value() * (1.0 if any("norm" in str(p) for p in path) else 6.0)), state)
  return nnx.merge(graphdef, state)
