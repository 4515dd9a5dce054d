"""Ragged decode attention (``_decode.py``): reference and Pallas kernels (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernels_testlib import assert_close, run_jitted

from jaxrl import kernels

LENGTHS = [0, 1, 37, 128, 257, 300]  # empty row, single key, mid-tile, tile edge, full cache
S, KH, G, H = 300, 2, 4, 64


def cache(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  q = jnp.asarray(rng.normal(size=(b, KH * G, H)), dtype)
  k = jnp.asarray(rng.normal(size=(b, S, KH, H)), dtype)
  v = jnp.asarray(rng.normal(size=(b, S, KH, H)), dtype)
  return q, k, v, jnp.asarray(LENGTHS, jnp.int32)


def attention_with_segment_pair(q, k, v, lengths, **kw):
  """The same decode step written as packed attention with a ``(q_ids, kv_ids)`` pair."""
  b, s = k.shape[0], k.shape[1]
  q_ids = (lengths > 0).astype(jnp.int32)[:, None]
  kv_ids = (jnp.arange(s)[None, :] < lengths[:, None]).astype(jnp.int32)
  q_pos = (lengths - 1)[:, None]
  kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return kernels.attention_reference(q[:, None], k, v, segment_ids=(q_ids, kv_ids),
                                     positions=(q_pos, kv_pos), causal=True, **kw)[:, 0]


@pytest.mark.parametrize("kw", [dict(), dict(window=50, softcap=5.0)], ids=["plain", "window"])
def test_decode_reference_equals_attention_with_segment_pair(kw):
  q, k, v, lengths = cache(0)
  got = kernels.decode_attention(q, k, v, lengths, impl="reference", **kw)
  want = attention_with_segment_pair(q, k, v, lengths, **kw)
  assert_close(got, want, "out")
  assert np.all(np.asarray(got)[0] == 0)  # length 0: output 0


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_decode_pallas_matches_attention_with_segment_pair(impl):
  q, k, v, lengths = cache(1)
  kw = dict(window=70, softcap=5.0)
  interpret = (pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
               if impl == "pallas_tpu" else True)
  got = run_jitted(lambda q, k, v, n: kernels.decode_attention(q, k, v, n, impl=impl,
                                                               interpret=interpret, **kw),
                   q, k, v, lengths)
  assert_close(got, attention_with_segment_pair(q, k, v, lengths, **kw), "out")
  assert np.all(np.asarray(got)[0] == 0)


def test_decode_triton_splits_combine_to_the_reference():
  q, k, v, lengths = cache(2, jnp.bfloat16)
  from jaxrl.kernels._decode import decode_attention_triton
  got = run_jitted(lambda q, k, v, n: decode_attention_triton(q, k, v, n, block_kv=32,
                                                              num_splits=3, interpret=True),
                   q, k, v, lengths)
  want = attention_with_segment_pair(*(x.astype(jnp.float32) for x in (q, k, v)), lengths)
  assert got.dtype == jnp.bfloat16
  assert_close(got, want, "out")
