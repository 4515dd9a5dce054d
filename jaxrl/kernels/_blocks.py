"""Block-skip metadata for packed-sequence attention, built from segment ids inside ``jit``.

A flash-attention kernel walks a grid of ``(query block, key block)`` tiles. With packing most tiles
are empty (their queries and keys belong to different documents) and many need no element mask at
all (every pair is visible). This module summarises each block by at most three *components* and
decides, per tile, whether it may hold a visible pair ("visit") and whether every pair is visible
("full"). The kernels only see the compressed per-row ranges:

* per query block ``i``: key blocks ``[lo_i, hi_i)`` to visit, of which ``[full_lo_i, full_hi_i)``
  need no mask (used by the forward and dq passes);
* per key block ``j``: query blocks ``[lo_j, hi_j)`` and full sub-range (dk/dv pass).

Block summaries. The non-padding tokens of a block are split into: the tokens carrying the segment
id of the block's first non-padding token (component ``first``), those carrying the id of its last
non-padding token (``last``), and the rest (``mid``). Each component keeps its id range and its
position range ``[pmin, pmax]``. A tile may hold a visible pair only if some (query component,
key component) pair has overlapping id ranges and position ranges compatible with causality and the
window. For contiguous documents with consecutive positions (the packing layout) this test is
exact; for anything else (an id that reappears later in a row, arbitrary positions) it is
conservative, and the kernels still apply the element-wise mask on every non-full tile, so results
are always right.

Cost: O(T) to summarise blocks, O((T/bq)·(S/bk)) scalar comparisons (fused into the range
reductions) to classify tiles — never a ``T × S`` mask. The stored metadata is O(T/b) int32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max
_SMALL = jnp.iinfo(jnp.int32).min


class BlockRanges(NamedTuple):
  """Per-block ranges of the other axis' blocks, half-open, all ``[B, n_blocks]`` int32.

  ``[lo, hi)`` are the blocks to visit (``lo == hi`` when none); ``[full_lo, full_hi)`` is a
  sub-range of it whose tiles need no masking (``full_lo == full_hi`` when none).
  """
  lo: jax.Array
  hi: jax.Array
  full_lo: jax.Array
  full_hi: jax.Array


class _BlockSummary(NamedTuple):
  """Per-block summaries; component arrays are ``[B, n, 3]`` (first, last, mid)."""
  smin: jax.Array
  smax: jax.Array
  pmin: jax.Array
  pmax: jax.Array
  valid: jax.Array  # bool: the component has tokens
  single: jax.Array  # [B, n] bool: every token carries the same non-zero id
  seg: jax.Array  # [B, n] that id (meaningful where single)
  block_pmin: jax.Array  # [B, n] position range of the whole block (meaningful where single)
  block_pmax: jax.Array  # [B, n]


def _summarise(
    seg: jax.Array,  # [B, L] int, L a multiple of block
    pos: jax.Array,  # [B, L] int
    block: int,
) -> _BlockSummary:
  b, length = seg.shape
  seg = seg.astype(jnp.int32).reshape(b, length // block, block)
  pos = pos.astype(jnp.int32).reshape(b, length // block, block)
  nz = seg != 0
  idx = jnp.arange(block, dtype=jnp.int32)
  first_i = jnp.min(jnp.where(nz, idx, block - 1), axis=-1, keepdims=True)
  last_i = jnp.max(jnp.where(nz, idx, 0), axis=-1, keepdims=True)
  first = jnp.max(jnp.where(idx == first_i, seg, 0), axis=-1, keepdims=True)  # [B, n, 1]
  last = jnp.max(jnp.where(idx == last_i, seg, 0), axis=-1, keepdims=True)
  in_first = nz & (seg == first)
  in_last = nz & (seg == last)
  member = jnp.stack([in_first, in_last, nz & ~in_first & ~in_last], axis=2)  # [B, n, 3, block]
  seg3, pos3 = seg[:, :, None, :], pos[:, :, None, :]
  smin = jnp.min(jnp.where(member, seg3, _BIG), axis=-1)
  smax = jnp.max(jnp.where(member, seg3, _SMALL), axis=-1)
  pmin = jnp.min(jnp.where(member, pos3, _BIG), axis=-1)
  pmax = jnp.max(jnp.where(member, pos3, _SMALL), axis=-1)
  single = jnp.all(seg == first, axis=-1) & (first[..., 0] != 0)
  return _BlockSummary(smin, smax, pmin, pmax, jnp.any(member, axis=-1), single, first[..., 0],
                       jnp.min(pos, axis=-1), jnp.max(pos, axis=-1))


def tile_classes(
    q_segment_ids: jax.Array,  # [B, T], T a multiple of block_q
    kv_segment_ids: jax.Array,  # [B, S], S a multiple of block_kv
    q_positions: jax.Array,  # [B, T]
    kv_positions: jax.Array,  # [B, S]
    *,
    block_q: int,
    block_kv: int,
    causal: bool,
    window: int | None,
) -> tuple[jax.Array, jax.Array]:  # ([B, nq, nk] bool, [B, nq, nk] bool)
  """Classify every ``(query block, key block)`` tile from block summaries.

  Returns ``(visit, full)``: ``visit`` is false only where the tile provably holds no visible pair;
  ``full`` is true only where every pair of the tile is visible (same non-zero segment, causal and
  inside the window). Semantics of "visible" are those of :func:`make_mask`.
  """
  qs = _summarise(q_segment_ids, q_positions, block_q)
  ks = _summarise(kv_segment_ids, kv_positions, block_kv)
  # Query components on axes (1, 2), key components on axes (3, 4): [B, nq, 3, nk, 3].
  a = lambda x: x[:, :, :, None, None]  # noqa: E731
  c = lambda x: x[:, None, None, :, :]  # noqa: E731
  ok = a(qs.valid) & c(ks.valid) & (a(qs.smin) <= c(ks.smax)) & (c(ks.smin) <= a(qs.smax))
  if causal:
    ok &= a(qs.pmax) >= c(ks.pmin)
  if window is not None:
    ok &= a(qs.pmin) - c(ks.pmax) < window
    if not causal:
      ok &= c(ks.pmin) - a(qs.pmax) < window
  visit = jnp.any(ok, axis=(2, 4))
  full = qs.single[:, :, None] & ks.single[:, None, :] & (qs.seg[:, :, None] == ks.seg[:, None, :])
  q_pmin, q_pmax = qs.block_pmin[:, :, None], qs.block_pmax[:, :, None]
  k_pmin, k_pmax = ks.block_pmin[:, None, :], ks.block_pmax[:, None, :]
  if causal:
    full &= k_pmax <= q_pmin
  if window is not None:
    full &= q_pmax - k_pmin < window
    if not causal:
      full &= k_pmax - q_pmin < window
  return visit, full & visit


def _ranges(visit, full, axis):
  """Compress tile classes along ``axis`` into :class:`BlockRanges`."""
  n = visit.shape[axis]
  shape = [1, 1, 1]
  shape[axis] = n
  idx = jnp.arange(n, dtype=jnp.int32).reshape(shape)
  lo = jnp.min(jnp.where(visit, idx, n), axis=axis)
  hi = jnp.max(jnp.where(visit, idx + 1, 0), axis=axis)
  empty = hi == 0
  lo = jnp.where(empty, 0, lo)
  f_lo = jnp.min(jnp.where(full, idx, n), axis=axis)
  f_hi = jnp.max(jnp.where(full, idx + 1, 0), axis=axis)
  n_full = jnp.sum(full, axis=axis, dtype=jnp.int32)
  # Only a gap-free run of full tiles can be processed without masks.
  contiguous = (n_full > 0) & (n_full == f_hi - f_lo)
  f_lo = jnp.where(contiguous, f_lo, hi)
  f_hi = jnp.where(contiguous, f_hi, hi)
  return BlockRanges(lo, hi, f_lo, f_hi)


def block_ranges(
    q_segment_ids: jax.Array,  # [B, T], T a multiple of block_q
    kv_segment_ids: jax.Array,  # [B, S], S a multiple of block_kv
    q_positions: jax.Array,  # [B, T]
    kv_positions: jax.Array,  # [B, S]
    *,
    block_q: int,
    block_kv: int,
    causal: bool,
    window: int | None,
) -> tuple[BlockRanges, BlockRanges]:
  """Per-query-block key ranges and per-key-block query ranges (see the module docstring).

  Args:
    q_segment_ids, kv_segment_ids: segment ids (0 = padding), lengths multiples of the blocks.
    q_positions, kv_positions: token positions used for causality and the window.
    block_q, block_kv: tile sizes, in tokens.
    causal, window: the masking rules of :func:`make_mask`.

  Returns:
    ``(rows, cols)``: ``rows`` has ``[B, T / block_q]`` ranges over key blocks (forward, dq pass),
    ``cols`` has ``[B, S / block_kv]`` ranges over query blocks (dk/dv pass).
  """
  visit, full = tile_classes(q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                             block_q=block_q, block_kv=block_kv, causal=causal, window=window)
  return _ranges(visit, full, 2), _ranges(visit, full, 1)


def visited_tiles(ranges: BlockRanges) -> tuple[jax.Array, jax.Array]:  # ([B], [B]) int32
  """Tiles a kernel driven by ``ranges`` computes: ``(visited, masked)`` per batch row.

  ``visited`` counts every tile inside ``[lo, hi)``; ``masked`` those outside the full sub-range.
  This is exactly the loop trip count of the Triton kernels and the number of ``pl.when`` bodies the
  TPU kernels run (per kv head).
  """
  visited = jnp.sum(ranges.hi - ranges.lo, axis=-1)
  masked = visited - jnp.sum(ranges.full_hi - ranges.full_lo, axis=-1)
  return visited, masked
