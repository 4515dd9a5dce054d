"""Pallas TPU (Mosaic) flash attention (``_tpu.py``) in TPU interpret mode against the reference.

Runs under ``pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")``: scratch and
outputs start as NaN, so a missed initialisation or an unwritten block shows up as NaN, and the
race detector must report nothing. The TPU interpreter costs ~0.05 s per grid step on CPU, so each
case uses one kv head (the q-head group still varies) and two layout rows; the four cases together
cover every row of ``packed_batch``.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu
from kernels_testlib import (assert_close, packed_batch, qkv, reference_value_and_grads,
                             run_jitted, value_and_grads)

from jaxrl import kernels

INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")

# (group, head_dim, causal, window, softcap, dtype, layout rows, tiles); T = 200, padded to 256.
CASES = {
    "mha_causal": (1, 128, True, None, None, jnp.float32, [0, 4], (64, 128, 64, 128)),
    "gqa2_bidir_window": (2, 64, False, 24, None, jnp.float32, [1, 6], (32, 128, 64, 128)),
    "gqa4_causal_window_softcap": (4, 128, True, 40, 20.0, jnp.float32, [2, 7], (64, 128, 64, 128)),
    "bf16_gqa8_causal": (8, 128, True, None, None, jnp.bfloat16, [3, 5], (64, 128, 64, 128)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_matches_reference_without_races(name):
  g, h, causal, window, softcap, dtype, rows, tiles = CASES[name]
  t = 200
  seg, pos = packed_batch(0, t)
  seg, pos = seg[rows], pos[rows]
  q, k, v, do = qkv(1, seg.shape[0], t, g, 1, h, dtype)
  kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos), causal=causal,
            window=window, softcap=softcap)
  bs = kernels.BlockSizes(block_q=tiles[0], block_kv=tiles[1], block_q_bwd=tiles[2],
                          block_kv_bwd=tiles[3])
  out, grads = value_and_grads(
      lambda q, k, v: kernels.attention(q, k, v, **kw, block_sizes=bs, impl="pallas_tpu",
                                        interpret=INTERPRET), q, k, v, do)
  ref, ref_grads = reference_value_and_grads(q, k, v, do, **kw)
  assert not tpu_interpret.races.races_found
  assert out.dtype == dtype
  assert_close(out, ref, "out", "out")
  for n, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert_close(got, want, "grad", n)
  pad = seg == 0
  assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(grads[0])[pad] == 0)


def test_tpu_kernel_runs_only_the_visited_tiles():
  t, block, docs = 512, 128, 4
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), t // docs)[None]
  q = jnp.zeros((1, t, 1, 128), jnp.float32)
  bs = kernels.BlockSizes(block_q=block, block_kv=block)
  counts = run_jitted(
      lambda q, s: kernels.visited_tile_counts(q, q, q, segment_ids=s, block_sizes=bs,
                                               backend="tpu", interpret=INTERPRET),
      q, jnp.asarray(seg))
  # Each document is one tile: only the diagonal runs (4 of the 10 causal tiles).
  np.testing.assert_array_equal(np.asarray(counts), np.ones((1, 1, t // block), np.int32))


def test_tpu_index_maps_fetch_each_visited_tile_once():
  """Clamped index maps: a block index changes only inside ``[lo, hi)``, so skipped steps reuse
  the resident block and Pallas issues no DMA for them."""
  from jaxrl.kernels._tpu import tile_schedule
  t, block = 2048, 128
  seg, pos = packed_batch(2, t)
  n = t // block

  def schedules(s, p):
    rows, cols = kernels.block_ranges(s, s, p, p, block_q=block, block_kv=block, causal=True,
                                      window=None)
    return (rows, tile_schedule(rows, n)), (cols, tile_schedule(cols, n))

  for ranges, sched in run_jitted(schedules, jnp.asarray(seg), jnp.asarray(pos)):
    sched = np.asarray(sched)
    fetches = 1 + np.sum(sched[..., 1:] != sched[..., :-1], axis=-1)
    visited = np.asarray(ranges.hi - ranges.lo)
    np.testing.assert_array_equal(fetches, np.maximum(visited, 1))
    idx = np.arange(n)
    inside = (idx >= np.asarray(ranges.lo)[..., None]) & (idx < np.asarray(ranges.hi)[..., None])
    np.testing.assert_array_equal(sched[inside], np.broadcast_to(idx, sched.shape)[inside])
