"""Pallas Triton flash attention (``_triton.py``, interpret mode) against the float32 reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from kernels_testlib import (assert_close, packed_batch, qkv, reference_value_and_grads,
                             value_and_grads)

from jaxrl import kernels

# (group, head_dim, causal, window, softcap, dtype, T, tiles); T is never a multiple of the tiles.
CASES = {
    "mha_causal": (1, 64, True, None, None, jnp.float32, 200, (16, 32, 32, 16)),
    "gqa4_causal_window_softcap": (4, 64, True, 24, 20.0, jnp.float32, 200, (16, 32, 16, 32)),
    "gqa8_bidir_window": (8, 64, False, 16, None, jnp.float32, 200, (16, 16, 16, 16)),
    "gqa3_causal_d256": (3, 256, True, None, None, jnp.float32, 120, (16, 32, 16, 32)),
    "bf16_gqa2_causal_softcap": (2, 128, True, None, 30.0, jnp.bfloat16, 200, (16, 32, 16, 32)),
}


def run_and_compare(q, k, v, do, kw, tiles, *, pad=None):
  bs = kernels.BlockSizes(block_q=tiles[0], block_kv=tiles[1], block_q_bwd=tiles[2],
                          block_kv_bwd=tiles[3])
  out, grads = value_and_grads(
      lambda q, k, v: kernels.attention(q, k, v, **kw, block_sizes=bs, impl="pallas_triton",
                                        interpret=True), q, k, v, do)
  ref, ref_grads = reference_value_and_grads(q, k, v, do, **kw)
  assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
  assert_close(out, ref, "out", "out")
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert_close(got, want, "grad", name)
  if pad is not None:  # padding queries: output 0 and gradient 0, exactly
    assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(grads[0])[pad] == 0)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference_on_packed_layouts(name):
  g, h, causal, window, softcap, dtype, t, tiles = CASES[name]
  seg, pos = packed_batch(0, t)
  q, k, v, do = qkv(1, seg.shape[0], t, 2 * g, 2, h, dtype)
  kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos), causal=causal,
            window=window, softcap=softcap)
  run_and_compare(q, k, v, do, kw, tiles, pad=seg == 0)


def test_triton_long_bidirectional_sequence_matches_reference():
  t = 1000
  seg, pos = packed_batch(9, t)
  seg, pos = seg[[0, 6]], pos[[0, 6]]
  q, k, v, do = qkv(3, 2, t, 4, 2, 128, jnp.float32)
  kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos), causal=False)
  run_and_compare(q, k, v, do, kw, (64, 64, 32, 64), pad=seg == 0)


def test_triton_segment_pair_with_longer_keys_matches_reference():
  """Distinct query/key ids and positions (``S != T``): a chunk of queries over a longer context."""
  rng = np.random.default_rng(4)
  b, t, s = 3, 48, 136
  kv_seg = np.zeros((b, s), np.int32)
  kv_seg[0, :100], kv_seg[1, :40], kv_seg[1, 40:130] = 1, 1, 2
  q_seg = np.stack([np.full(t, 1), np.full(t, 2), np.zeros(t)]).astype(np.int32)
  kv_pos = np.stack([np.arange(s), np.concatenate([np.arange(40), np.arange(s - 40)]),
                     np.arange(s)]).astype(np.int32)
  q_pos = np.stack([52 + np.arange(t), 42 + np.arange(t), np.arange(t)]).astype(np.int32)
  q_seg[0, rng.integers(0, t, 5)] = 0
  q, k, v, do = qkv(5, b, t, 4, 2, 64, jnp.float32, s=s)
  kw = dict(segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)),
            positions=(jnp.asarray(q_pos), jnp.asarray(kv_pos)), causal=True, window=60)
  run_and_compare(q, k, v, do, kw, (16, 32, 16, 32), pad=q_seg == 0)
