"""Block-skip metadata (``jaxrl/kernels/_blocks.py``) against a dense numpy classification."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernels_testlib import packed_batch, positions_for, run_jitted

from jaxrl import kernels

CONTIGUOUS_ROWS = [0, 1, 2, 3, 4, 5]  # rows of packed_batch whose ids never reappear
RULES = [dict(causal=True, window=None), dict(causal=False, window=None),
         dict(causal=True, window=13), dict(causal=False, window=9)]
RULE_IDS = ["causal", "bidir", "causal_window", "bidir_window"]
TILES = [(16, 16), (8, 32), (32, 8), (16, 32)]  # one (block_q, block_kv) per rule


def dense_tile_classes(seg, pos, bq, bk, *, causal, window, kv_seg=None, kv_pos=None):
  """``(nonzero, full)`` per tile from the dense ``[T, S]`` mask, in numpy."""
  kv_seg = seg if kv_seg is None else kv_seg
  kv_pos = pos if kv_pos is None else kv_pos
  mask = np.asarray(kernels.make_mask(jnp.asarray(seg), jnp.asarray(kv_seg), jnp.asarray(pos),
                                      jnp.asarray(kv_pos), causal=causal, window=window))
  b, t, s = mask.shape
  tiles = mask.reshape(b, t // bq, bq, s // bk, bk)
  return tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))


def classes(seg, pos, bq, bk, rule, kv_seg=None, kv_pos=None):
  kv_seg = seg if kv_seg is None else kv_seg
  kv_pos = pos if kv_pos is None else kv_pos
  visit, full = run_jitted(
      lambda a, b, c, d: kernels.tile_classes(a, b, c, d, block_q=bq, block_kv=bk, **rule),
      jnp.asarray(seg), jnp.asarray(kv_seg), jnp.asarray(pos), jnp.asarray(kv_pos))
  return np.asarray(visit), np.asarray(full)


@pytest.mark.parametrize("rule,tiles", list(zip(RULES, TILES)), ids=RULE_IDS)
def test_tile_classes_equal_dense_classification_for_contiguous_documents(rule, tiles):
  bq, bk = tiles
  seg, pos = packed_batch(seed=bq + bk, t=256)
  seg, pos = seg[CONTIGUOUS_ROWS], pos[CONTIGUOUS_ROWS]
  visit, full = classes(seg, pos, bq, bk, rule)
  nonzero, dense_full = dense_tile_classes(seg, pos, bq, bk, **rule)
  np.testing.assert_array_equal(visit, nonzero)
  np.testing.assert_array_equal(full, dense_full)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_tile_classes_are_conservative_for_reappearing_ids_and_arbitrary_positions(rule):
  rng = np.random.default_rng(7)
  seg, pos = packed_batch(seed=3, t=256)
  # Shuffle ids (non-monotone, reappearing) and scramble positions on extra rows.
  seg2 = rng.integers(0, 4, size=(3, 256)).astype(np.int32)
  pos2 = rng.integers(0, 300, size=(3, 256)).astype(np.int32)
  seg, pos = np.concatenate([seg, seg2]), np.concatenate([pos, pos2])
  visit, full = classes(seg, pos, 16, 32, rule)
  nonzero, dense_full = dense_tile_classes(seg, pos, 16, 32, **rule)
  assert not np.any(nonzero & ~visit), "a tile holding a visible pair would be skipped"
  assert not np.any(full & ~dense_full), "a tile needing a mask would be computed unmasked"


def test_tile_classes_handle_distinct_query_and_key_layouts():
  rng = np.random.default_rng(11)
  lengths = np.array([0, 1, 40, 97, 128])
  kv_seg = (np.arange(128)[None] < lengths[:, None]).astype(np.int32)
  kv_pos = np.broadcast_to(np.arange(128, dtype=np.int32), (5, 128))
  q_seg = np.repeat((lengths > 0).astype(np.int32)[:, None], 16, axis=1)
  q_pos = (lengths[:, None] - 16 + np.arange(16)[None]).astype(np.int32)
  q_seg[:, : int(rng.integers(0, 8))] = 0
  rule = dict(causal=True, window=50)
  visit, full = classes(q_seg, q_pos, 8, 16, rule, kv_seg, kv_pos)
  nonzero, dense_full = dense_tile_classes(q_seg, q_pos, 8, 16, kv_seg=kv_seg, kv_pos=kv_pos,
                                           **rule)
  np.testing.assert_array_equal(visit, nonzero)
  np.testing.assert_array_equal(full, dense_full)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_block_ranges_cover_visible_tiles_and_full_ranges_need_no_mask(rule):
  seg, pos = packed_batch(seed=5, t=256)
  bq, bk = 16, 32
  rows, cols = run_jitted(
      lambda a, b: kernels.block_ranges(a, a, b, b, block_q=bq, block_kv=bk, **rule),
      jnp.asarray(seg), jnp.asarray(pos))
  nonzero, dense_full = dense_tile_classes(seg, pos, bq, bk, **rule)
  b, nq, nk = nonzero.shape
  for ranges, tiles, full, n_inner in ((rows, nonzero, dense_full, nk),
                                       (cols, nonzero.transpose(0, 2, 1),
                                        dense_full.transpose(0, 2, 1), nq)):
    lo, hi, flo, fhi = (np.asarray(x) for x in ranges)
    idx = np.arange(n_inner)[None, None, :]
    in_range = (idx >= lo[..., None]) & (idx < hi[..., None])
    in_full = (idx >= flo[..., None]) & (idx < fhi[..., None])
    assert not np.any(tiles & ~in_range), "a visible tile lies outside [lo, hi)"
    assert not np.any(in_full & ~full), "a tile in [full_lo, full_hi) needs a mask"
    assert np.all((lo <= flo) & (flo <= fhi) & (fhi <= hi))
  # Contiguous rows: the ranges are tight (each row's visible tiles are gap-free).
  visited, _ = kernels.visited_tiles(rows)
  contiguous = np.asarray(CONTIGUOUS_ROWS)
  np.testing.assert_array_equal(np.asarray(visited)[contiguous],
                                nonzero[contiguous].sum(axis=(1, 2)))


def test_sixteen_equal_documents_visit_a_sixteenth_of_the_causal_tiles():
  t, block, docs = 32768, 128, 16
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), t // docs)[None]
  pos = positions_for(seg[0])[None]
  dense = np.ones_like(seg)
  def run(s, p):
    return kernels.visited_tiles(kernels.block_ranges(s, s, p, p, block_q=block, block_kv=block,
                                                      causal=True, window=None)[0])

  packed, packed_masked = run_jitted(run, jnp.asarray(seg), jnp.asarray(pos))
  causal, causal_masked = run_jitted(run, jnp.asarray(dense), jnp.asarray(np.arange(t)[None]))
  m = t // docs // block  # tiles per document side
  n = t // block
  assert int(causal[0]) == n * (n + 1) // 2
  assert int(packed[0]) == docs * m * (m + 1) // 2  # ≈ causal / 16 + the diagonal
  assert int(packed_masked[0]) == int(causal_masked[0]) == n  # only diagonal tiles are masked
  assert int(packed[0]) / int(causal[0]) < 1 / docs + 1 / m


def test_sixteen_equal_documents_triton_kernel_counts_its_visited_tiles():
  t, block, docs = 512, 16, 16
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), t // docs)[None]
  pos = positions_for(seg[0])[None]
  q = jnp.zeros((1, t, 2, 64), jnp.float32)
  k = jnp.zeros((1, t, 1, 64), jnp.float32)
  bs = kernels.BlockSizes(block_q=block, block_kv=block)
  counts = run_jitted(
      lambda q, k, s, p: kernels.visited_tile_counts(q, k, k, segment_ids=s, positions=p,
                                                     block_sizes=bs, backend="triton",
                                                     interpret=True),
      q, k, jnp.asarray(seg), jnp.asarray(pos))
  m = t // docs // block
  assert int(np.sum(counts)) == docs * m * (m + 1) // 2
  rows, _ = kernels.block_ranges(jnp.asarray(seg), jnp.asarray(seg), jnp.asarray(pos),
                                 jnp.asarray(pos), block_q=block, block_kv=block, causal=True,
                                 window=None)
  np.testing.assert_array_equal(np.asarray(counts)[0, 0], np.asarray(rows.hi - rows.lo)[0])
