"""Ragged decode attention over a *paged* KV cache: one query token per row, keys in fixed-size blocks.

The cache is a pool of ``NB`` blocks of ``bs`` slots, ``k_pages [NB, bs, K, H]``; row ``b`` owns the
blocks listed in ``block_tables[b]`` (logical block ``j`` of the row = physical block
``block_tables[b, j]``), holds ``lengths[b]`` valid keys (logical slots ``[0, lengths[b])``) and its
query sits at position ``lengths[b] - 1``. Entries of a table past the row's last block are never
read by the kernels (the reference clamps them into range and masks them).

Implementations, as in :func:`jaxrl.kernels.decode_attention`:
  ``reference``      gathers each row's blocks into a contiguous ``[B, MB·bs, K, H]`` cache and calls
                     :func:`decode_attention_reference` (pure XLA).
  ``pallas_tpu``     grid ``(B, MB)``; the lengths and tables are scalar-prefetched and the K/V index
                     map returns the *physical* block of logical tile ``j`` (clamped to the row's valid
                     tiles), so only the row's own blocks are DMA'd.
  ``pallas_triton``  grid ``(B, K, splits)``; each program walks its share of the row's logical blocks,
                     loading physical block ``table[j]`` from the pool (flash-decoding split, combined
                     afterwards like :func:`decode_attention_triton`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.kernels import _decode, _dispatch, _online_softmax
from jaxrl.kernels._common import LOG2E, next_pow2, pad_axis

PAGED_IMPLS = ("auto", "reference", "pallas_triton", "pallas_tpu")


def _check(q, k_pages, v_pages, block_tables, lengths):
  b, n, h = q.shape
  if k_pages.ndim != 4 or k_pages.shape[3] != h:
    raise ValueError(f"k_pages must be [NB, bs, K, H={h}], got {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages {k_pages.shape}")
  if n % k_pages.shape[2]:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({k_pages.shape[2]})")
  if block_tables.ndim != 2 or block_tables.shape[0] != b:
    raise ValueError(f"block_tables must be [B={b}, MB], got {block_tables.shape}")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must have shape ({b},), got {lengths.shape}")


def _prepare(q, k_pages, v_pages, block_tables, lengths):
  lengths = jnp.asarray(lengths).astype(jnp.int32)
  block_tables = jnp.asarray(block_tables).astype(jnp.int32)
  _check(q, k_pages, v_pages, block_tables, lengths)
  nb, bs = k_pages.shape[0], k_pages.shape[1]
  lengths = jnp.clip(lengths, 0, block_tables.shape[1] * bs)
  return jnp.clip(block_tables, 0, nb - 1), lengths


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:  # [NB,bs,K,H], [B,MB] -> [B,MB·bs,K,H]
  """Each row's blocks in logical order, as one contiguous cache (table entries clamped into range)."""
  nb, bs, kh, h = pages.shape
  b, mb = block_tables.shape
  return jnp.take(pages, jnp.clip(block_tables, 0, nb - 1), axis=0).reshape(b, mb * bs, kh, h)


def paged_decode_attention_reference(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [NB, bs, K, H]
    v_pages: jax.Array,  # [NB, bs, K, H]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [B, N, H]
  """``softmax_s(q·k_s·scale)·v`` over logical slots ``s < lengths[b]`` of each row's blocks (pure JAX).

  Equal to :func:`decode_attention_reference` on ``gather_pages(k_pages, block_tables)``.
  """
  block_tables, lengths = _prepare(q, k_pages, v_pages, block_tables, lengths)
  return _decode.decode_attention_reference(q, gather_pages(k_pages, block_tables),
                                            gather_pages(v_pages, block_tables), lengths,
                                            sm_scale=sm_scale, softcap=softcap, window=window)


# ------------------------------------------------------------------------------------------------
# TPU.


def paged_decode_attention_tpu(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, softcap=None,
                               window=None, interpret=False):
  """Pallas TPU paged decode kernel; see :func:`paged_decode_attention_reference` for the semantics.

  Grid ``(B, MB)``, one block of ``bs`` keys (all kv heads) per program, the row's whole query-head
  group resident. The K/V index map reads ``block_tables[b, clamp(j, first, last)]`` from SMEM, so a
  tile past the row's length repeats the last valid block's index and costs no new DMA.
  """
  from jax.experimental.pallas import tpu as pltpu
  block_tables, lengths = _prepare(q, k_pages, v_pages, block_tables, lengths)
  b, n, h = q.shape
  bs, kh = k_pages.shape[1], k_pages.shape[2]
  mb = block_tables.shape[1]
  g = n // kh
  scale = h**-0.5 if sm_scale is None else sm_scale
  if interpret is True:
    interpret = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")

  def kv_map(b_, j, len_ref, table_ref):
    length = len_ref[b_]
    first = lax.div(_decode._window_start(length, window), bs)
    last = lax.div(jnp.maximum(length - 1, 0), bs)
    return (table_ref[b_, jnp.maximum(jnp.minimum(j, last), first)], 0, 0, 0)

  def kernel(len_ref, table_ref, *refs):
    del table_ref
    _decode._tpu_kernel(len_ref, *refs, scale=scale, softcap=softcap, window=window, block_kv=bs, n_kv=mb)

  o = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, mb),
          in_specs=[pl.BlockSpec((None, kh, g, h), lambda b_, j, *_: (b_, 0, 0, 0)),
                    pl.BlockSpec((None, bs, kh, h), kv_map),
                    pl.BlockSpec((None, bs, kh, h), kv_map)],
          out_specs=pl.BlockSpec((None, kh, g, h), lambda b_, j, *_: (b_, 0, 0, 0)),
          scratch_shapes=[pltpu.VMEM((kh, g, 1), jnp.float32), pltpu.VMEM((kh, g, 1), jnp.float32),
                          pltpu.VMEM((kh, g, h), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, h), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="jaxrl_paged_decode_tpu",
  )(lengths, block_tables, q.reshape(b, kh, g, h), k_pages, v_pages)
  return o.reshape(b, n, h)


# ------------------------------------------------------------------------------------------------
# Triton.


def _triton_kernel(len_ref,  # [B] int32
                   table_ref,  # [MB] int32 (this row's table)
                   q_ref,  # [G', H']
                   k_ref, v_ref,  # [NB, bs, H'] (this kv head, the whole pool)
                   o_ref,  # [G', H'] float32
                   lse_ref,  # [G'] float32
                   *, scale, softcap, window, block_size, blocks_per_split):
  b, p = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]
  q = q_ref[...]
  g, h = q.shape
  bs = block_size
  lo_tok = jnp.maximum(p * blocks_per_split * bs, _decode._window_start(length, window))
  hi_tok = jnp.minimum((p + 1) * blocks_per_split * bs, length)
  lo, hi = lax.div(lo_tok, bs), lax.div(hi_tok + bs - 1, bs)

  def step(j, carry):
    page = table_ref[j]
    s, valid = _decode._masked_logits(q, k_ref[page], lo_tok, hi_tok, j * bs, scale=scale * LOG2E,
                                      softcap=None if softcap is None else softcap * LOG2E)  # [G', bs]
    return _online_softmax.update(*carry, s, v_ref[page], valid=valid, base2=True)

  carry = lax.fori_loop(lo, jnp.maximum(hi, lo), step, _online_softmax.init((g, h), column=False))
  o_ref[...], lse_ref[...] = _online_softmax.finish(*carry, base2=True)


def paged_decode_attention_triton(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, softcap=None,
                                  window=None, num_splits=None, interpret=False):
  """Pallas Triton paged decode kernel; see :func:`paged_decode_attention_reference` for the semantics.

  Grid ``(B, K, splits)``; split ``p`` handles logical blocks ``[p·M, (p+1)·M)`` of its row and loops
  only over those below the row's length, loading each physical block through the table. The block
  size must be a power of two ``>= 16`` on a GPU (``tl.dot`` tiles); interpret mode takes any.
  """
  from jax.experimental.pallas import triton as plgpu
  block_tables, lengths = _prepare(q, k_pages, v_pages, block_tables, lengths)
  b, n, h = q.shape
  nb, bs, kh = k_pages.shape[0], k_pages.shape[1], k_pages.shape[2]
  mb = block_tables.shape[1]
  g = n // kh
  scale = h**-0.5 if sm_scale is None else sm_scale
  if num_splits is None:
    num_splits = max(1, min(16, (mb * bs) // 1024))
  num_splits = max(1, min(num_splits, mb))
  per_split = pl.cdiv(mb, num_splits)
  gp, hp = max(next_pow2(g), 16), max(next_pow2(h), 16)
  qp = pad_axis(pad_axis(q.reshape(b, kh, g, h), 2, gp), 3, hp)
  kp = pad_axis(k_pages, 3, hp)  # a no-op for the usual head dims (64, 128)
  vp = pad_axis(v_pages, 3, hp)
  o, lse = pl.pallas_call(
      functools.partial(_triton_kernel, scale=scale, softcap=softcap, window=window, block_size=bs,
                        blocks_per_split=per_split),
      grid=(b, kh, num_splits),
      in_specs=[pl.BlockSpec((b,), lambda b_, h_, p: (0,)),
                pl.BlockSpec((None, mb), lambda b_, h_, p: (b_, 0)),
                pl.BlockSpec((None, None, gp, hp), lambda b_, h_, p: (b_, h_, 0, 0)),
                pl.BlockSpec((nb, bs, None, hp), lambda b_, h_, p: (0, 0, h_, 0)),
                pl.BlockSpec((nb, bs, None, hp), lambda b_, h_, p: (0, 0, h_, 0))],
      out_specs=[pl.BlockSpec((None, None, None, gp, hp), lambda b_, h_, p: (b_, p, h_, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b_, h_, p: (b_, p, h_, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, num_splits, kh, gp, hp), jnp.float32),
                 jax.ShapeDtypeStruct((b, num_splits, kh, gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxrl_paged_decode_triton",
  )(lengths, block_tables, qp, kp, vp)
  o = o[:, :, :, :g, :h].reshape(b, num_splits, n, h)
  lse = lse[:, :, :, :g].reshape(b, num_splits, n)
  return _decode._combine(o, lse).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [NB, bs, K, H]
    v_pages: jax.Array,  # [NB, bs, K, H]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    impl: str = "auto",
    interpret=False,
) -> jax.Array:  # [B, N, H]
  """One query token per row against the first ``lengths[b]`` keys of its paged cache.

  Args:
    q: ``[B, N, H]`` queries of the new token; ``N`` a multiple of ``K``.
    k_pages, v_pages: the block pool ``[NB, bs, K, H]``.
    block_tables: ``[B, MB]`` physical block of each logical block of each row.
    lengths: ``[B]`` valid keys per row (including the new token's); 0 gives output 0.
    sm_scale, softcap, window: as in :func:`jaxrl.kernels.attention`.
    impl: ``"auto"`` (Pallas TPU on TPU, Pallas Triton on GPU, reference on CPU) or one of
      :data:`PAGED_IMPLS`.
    interpret: Pallas interpret mode (CPU).

  Returns:
    ``[B, N, H]`` in ``q.dtype``.
  """
  if impl not in PAGED_IMPLS:
    raise ValueError(f"unknown paged decode impl {impl!r}; choose one of {PAGED_IMPLS}")
  if impl == "auto":
    impl = _dispatch.auto_impl()
  kw = dict(sm_scale=sm_scale, softcap=softcap, window=window)
  if impl == "reference":
    return paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, **kw)
  if impl == "pallas_triton":
    return paged_decode_attention_triton(q, k_pages, v_pages, block_tables, lengths, **kw, interpret=interpret)
  return paged_decode_attention_tpu(q, k_pages, v_pages, block_tables, lengths, **kw, interpret=interpret)
