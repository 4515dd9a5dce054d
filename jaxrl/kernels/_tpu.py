"""Flash attention over packed sequences: Pallas TPU (Mosaic) kernels.

Layout. Heads move in front of the sequence (``q → [B, K, G, T, H]``, ``k, v → [B, K, S, H]``) so
every block's minor dims are ``(tokens, H)``. A program owns one query tile for the whole q-head
group of one kv head (``[G, bq, H]``), so each K/V tile is DMA'd once per group and dk/dv are summed
over the group in VMEM (no atomics, no repeated K/V). Query ids/positions are ``[T, 1]`` columns and
key ids/positions ``[1, S]`` rows, so the element mask is a broadcast compare.

Block skipping (``splash``'s ``_next_nonzero`` idea, with ranges). The grid's innermost axis walks
every tile of the other sequence, but the per-block ranges from :mod:`._blocks` are
scalar-prefetched into SMEM and the K/V (or Q) index map clamps the tile index into ``[lo, hi)``: steps outside the
range keep the previous block index, so Pallas issues no new DMA, and the body runs under
``pl.when(lo <= j < hi)``. Tiles inside ``[full_lo, full_hi)`` skip the mask.

Passes: forward (``o``, float32 ``lse``), dq (grid over query tiles, key tiles innermost) and dk/dv
(grid over key tiles, query tiles innermost). The running max starts at the finite ``MASK_VALUE``
and masked probabilities are zeroed, so a query that sees no key gets output 0 and zero gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.kernels import _blocks, _online_softmax
from jaxrl.kernels._common import EMPTY_LSE, NN, NT, TN, BlockSizes, Config, dot_f32, next_pow2, visible
from jaxrl.kernels._reference import MASK_VALUE


_dot = dot_f32  # precision stated: see _common.dot_f32


def default_interpret():
  """TPU interpret mode with the race detector and NaN-filled fresh buffers."""
  return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def resolve_blocks(blocks: BlockSizes, *, t: int, s: int, head_dim: int, group: int) -> BlockSizes:
  """Fill defaults and clip to the lengths.

  Defaults: forward tiles of 512 query rows (``block_q · G``) × 512 keys, backward 256 × 256.
  Key tiles are lane-dim arrays (multiples of 128); query tiles are sublane-dim (multiples of 16,
  which also suits bf16 packing).
  """
  del head_dim
  pick = lambda x, y: y if x is None else x  # noqa: E731
  g = next_pow2(group)
  bq = max(min(pick(blocks.block_q, max(512 // g, 64)), next_pow2(t)), 16)
  bqb = max(min(pick(blocks.block_q_bwd, max(256 // g, 32)), next_pow2(t)), 16)
  bk = max(min(pick(blocks.block_kv, 512), next_pow2(s)), 128)
  bkb = max(min(pick(blocks.block_kv_bwd, 256), next_pow2(s)), 128)
  return BlockSizes(block_q=bq, block_kv=bk, block_q_bwd=bqb, block_kv_bwd=bkb)


def _clamp(j, lo, hi):
  """Tile index for grid step ``j``: inside ``[lo, hi)``, frozen outside (no new DMA)."""
  return jnp.maximum(jnp.minimum(j, hi - 1), lo)


def tile_schedule(ranges: _blocks.BlockRanges, n_inner: int) -> jax.Array:  # [B, n, n_inner]
  """The inner-axis tile index the TPU index maps request at every grid step.

  Pallas only issues a DMA when a block index changes between consecutive steps, so the number of
  fetches of a row is 1 + the number of changes along the last axis.
  """
  j = jnp.arange(n_inner, dtype=jnp.int32)
  return _clamp(j, ranges.lo[..., None], ranges.hi[..., None])


def _logits(q, k, cfg):
  s = _dot(q, k, NT) * cfg.sm_scale
  t = None
  if cfg.softcap is not None:
    t = jnp.tanh(s / cfg.softcap)
    s = cfg.softcap * t
  return s, t


def _to_heads_major(x, kh):  # [B, T, K*G, H] -> [B, K, G, T, H]
  b, t, n, h = x.shape
  return x.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)


def _from_heads_major(x):  # [B, K, G, T, H] -> [B, T, K*G, H]
  b, kh, g, t, h = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, h)


def _params(n_parallel: int, n_arbitrary: int):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


def _run_flags(ranges_refs, b, i, j):
  lo_ref, hi_ref, flo_ref, fhi_ref = ranges_refs
  run = (j >= lo_ref[b, i]) & (j < hi_ref[b, i])
  full = (j >= flo_ref[b, i]) & (j < fhi_ref[b, i])
  return run, full


# ------------------------------------------------------------------------------------------------
# Forward.


def _flat(x):  # [G, bq, D] -> [G * bq, D]
  return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _tile_mask(qs_ref, qp_ref, ks_ref, kp_ref, g, cfg):
  """Element mask of the tile, repeated for the ``g`` heads of the group: ``[g * bq, bk]``."""
  mask = visible(qs_ref[...], qp_ref[...], ks_ref[...], kp_ref[...], causal=cfg.causal,
                 window=cfg.window)  # [bq, bk]
  return mask if g == 1 else jnp.concatenate([mask] * g, axis=0)


def _fwd_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # SMEM [B, nq]
                q_ref,  # [G, bq, H]
                k_ref, v_ref,  # [bk, H]
                qs_ref, qp_ref,  # [bq, 1]
                ks_ref, kp_ref,  # [1, bk]
                o_ref,  # [G, bq, H]
                lse_ref,  # [G, bq, 1]
                *rest,  # (debug counter,) m [G*bq, 1], l [G*bq, 1], acc [G*bq, H] scratch
                cfg: Config, n_kv: int):
  if cfg.debug:
    cnt_ref, m_scr, l_scr, acc_scr = rest
  else:
    m_scr, l_scr, acc_scr = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  g, bq, h = q_ref.shape

  @pl.when(j == 0)
  def _init():
    m_scr[...], l_scr[...], acc_scr[...] = _online_softmax.init(acc_scr.shape, column=True)
    if cfg.debug:
      cnt_ref[0] = 0

  run, full = _run_flags((lo_ref, hi_ref, flo_ref, fhi_ref), b, i, j)

  def body(masked):
    s, _ = _logits(_flat(q_ref[...]), k_ref[...], cfg)  # [G*bq, bk]
    mask = None
    if masked:
      mask = _tile_mask(qs_ref, qp_ref, ks_ref, kp_ref, g, cfg)
      s = jnp.where(mask, s, MASK_VALUE)
    m_scr[...], l_scr[...], acc_scr[...] = _online_softmax.update(
        m_scr[...], l_scr[...], acc_scr[...], s, v_ref[...], valid=mask)
    if cfg.debug:
      cnt_ref[0] += 1

  pl.when(run & full)(lambda: body(False))
  pl.when(run & ~full)(lambda: body(True))

  @pl.when(j == n_kv - 1)
  def _finish():
    o, lse = _online_softmax.finish(m_scr[...], l_scr[...], acc_scr[...], empty_lse=EMPTY_LSE)
    o_ref[...] = o.reshape(g, bq, h).astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(g, bq, 1)


def _specs_common(g, h, bq, bk, q_tiles_outer: bool):
  """Block specs for the (query tile, key tile) grid; clamped by the prefetched ranges."""
  if q_tiles_outer:
    def qi(i, j, lo, hi):
      del j, lo, hi
      return i

    def kj(i, j, lo, hi):
      return _clamp(j, lo, hi)
  else:  # grid (b, h, key tile j, query tile i): ranges are per key tile.
    def qi(j, i, lo, hi):
      return _clamp(i, lo, hi)

    def kj(j, i, lo, hi):
      del i, lo, hi
      return j

  def q_map(b_, h_, x, y, lo, hi, *_):
    return (b_, h_, 0, qi(x, y, lo[b_, x], hi[b_, x]), 0)

  def k_map(b_, h_, x, y, lo, hi, *_):
    return (b_, h_, kj(x, y, lo[b_, x], hi[b_, x]), 0)

  def qid_map(b_, h_, x, y, lo, hi, *_):
    return (b_, qi(x, y, lo[b_, x], hi[b_, x]), 0)

  def kid_map(b_, h_, x, y, lo, hi, *_):
    return (b_, 0, kj(x, y, lo[b_, x], hi[b_, x]))

  return dict(
      q=pl.BlockSpec((None, None, g, bq, h), q_map),
      row=pl.BlockSpec((None, None, g, bq, 1), q_map),
      k=pl.BlockSpec((None, None, bk, h), k_map),
      qid=pl.BlockSpec((None, bq, 1), qid_map),
      kid=pl.BlockSpec((None, 1, bk), kid_map),
  )


def forward(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  """Forward pass: ``(o [B, T, N, H], lse [B, K, G, T, 1] float32)`` (+ tile counts if debug)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_kv
  nq, nk = t // bq, s // bk
  rows, _ = _blocks.block_ranges(q_seg, kv_seg, q_pos, kv_pos, block_q=bq, block_kv=bk,
                                 causal=cfg.causal, window=cfg.window)
  qh = _to_heads_major(q, kh)
  kh_, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  sp = _specs_common(g, h, bq, bk, q_tiles_outer=True)
  out_shape = [jax.ShapeDtypeStruct(qh.shape, q.dtype),
               jax.ShapeDtypeStruct((b, kh, g, t, 1), jnp.float32)]
  out_specs = [sp["q"], sp["row"]]
  if cfg.debug:
    out_shape.append(jax.ShapeDtypeStruct((b, kh, nq), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, 1), lambda b_, h_, i, j, *_: (b_, h_, i),
                                  memory_space=pltpu.SMEM))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, n_kv=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(b, kh, nq, nk),
          in_specs=[sp["q"], sp["k"], sp["k"], sp["qid"], sp["qid"], sp["kid"], sp["kid"]],
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((g * bq, 1), jnp.float32),
                          pltpu.VMEM((g * bq, 1), jnp.float32),
                          pltpu.VMEM((g * bq, h), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=_params(3, 1),
      interpret=cfg.interpret,
      name="jaxrl_flash_fwd_tpu",
  )(*rows, qh, kh_, vh, q_seg[..., None], q_pos[..., None], kv_seg[:, None], kv_pos[:, None])
  o = _from_heads_major(outs[0])
  if cfg.debug:
    return o, outs[1], outs[2]
  return o, outs[1]


# ------------------------------------------------------------------------------------------------
# Backward.


def _dq_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # SMEM [B, nq]
               q_ref, do_ref,  # [G, bq, H]
               lse_ref, delta_ref,  # [G, bq, 1]
               k_ref, v_ref,  # [bk, H]
               qs_ref, qp_ref,  # [bq, 1]
               ks_ref, kp_ref,  # [1, bk]
               dq_ref,  # [G, bq, H]
               dq_scr,  # [G*bq, H] f32
               *, cfg: Config, n_kv: int):
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  g, bq, h = q_ref.shape

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  run, full = _run_flags((lo_ref, hi_ref, flo_ref, fhi_ref), b, i, j)

  def body(masked):
    k, v = k_ref[...], v_ref[...]
    s, t = _logits(_flat(q_ref[...]), k, cfg)  # [G*bq, bk]
    p = jnp.exp(s - _flat(lse_ref[...]))
    if masked:
      p = jnp.where(_tile_mask(qs_ref, qp_ref, ks_ref, kp_ref, g, cfg), p, 0.0)
    ds = p * (_dot(_flat(do_ref[...]), v, NT) - _flat(delta_ref[...]))
    if t is not None:
      ds = ds * (1.0 - t * t)
    dq_scr[...] += _dot(ds.astype(k.dtype), k, NN)

  pl.when(run & full)(lambda: body(False))
  pl.when(run & ~full)(lambda: body(True))

  @pl.when(j == n_kv - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * cfg.sm_scale).reshape(g, bq, h).astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # SMEM [B, nk]
                q_ref, do_ref,  # [G, bq, H]
                lse_ref, delta_ref,  # [G, bq, 1]
                k_ref, v_ref,  # [bk, H]
                qs_ref, qp_ref,  # [bq, 1]
                ks_ref, kp_ref,  # [1, bk]
                dk_ref, dv_ref,  # [bk, H]
                dk_scr, dv_scr,  # [bk, H] f32
                *, cfg: Config, n_q: int):
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  g = q_ref.shape[0]

  @pl.when(i == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  run, full = _run_flags((lo_ref, hi_ref, flo_ref, fhi_ref), b, j, i)

  def body(masked):
    k, v = k_ref[...], v_ref[...]
    q, do = _flat(q_ref[...]), _flat(do_ref[...])  # the whole group: dk/dv sum over its heads
    s, t = _logits(q, k, cfg)  # [G*bq, bk]
    p = jnp.exp(s - _flat(lse_ref[...]))
    if masked:
      p = jnp.where(_tile_mask(qs_ref, qp_ref, ks_ref, kp_ref, g, cfg), p, 0.0)
    dv_scr[...] += _dot(p.astype(do.dtype), do, TN)
    ds = p * (_dot(do, v, NT) - _flat(delta_ref[...]))
    if t is not None:
      ds = ds * (1.0 - t * t)
    dk_scr[...] += _dot(ds.astype(q.dtype), q, TN)

  pl.when(run & full)(lambda: body(False))
  pl.when(run & ~full)(lambda: body(True))

  @pl.when(i == n_q - 1)
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse, do):
  """Backward pass: ``(dq, dk, dv)`` from the forward residuals and the output cotangent."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_kv_bwd
  nq, nk = t // bq, s // bk
  rows, cols = _blocks.block_ranges(q_seg, kv_seg, q_pos, kv_pos, block_q=bq, block_kv=bk,
                                    causal=cfg.causal, window=cfg.window)
  qh, doh = _to_heads_major(q, kh), _to_heads_major(do, kh)
  delta = jnp.sum(_to_heads_major(o, kh).astype(jnp.float32) * doh.astype(jnp.float32), axis=-1,
                  keepdims=True)  # [B, K, G, T, 1]
  kh_, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  ids = (q_seg[..., None], q_pos[..., None], kv_seg[:, None], kv_pos[:, None])

  sp = _specs_common(g, h, bq, bk, q_tiles_outer=True)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, n_kv=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(b, kh, nq, nk),
          in_specs=[sp["q"], sp["q"], sp["row"], sp["row"], sp["k"], sp["k"], sp["qid"], sp["qid"],
                    sp["kid"], sp["kid"]],
          out_specs=sp["q"],
          scratch_shapes=[pltpu.VMEM((g * bq, h), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
      compiler_params=_params(3, 1),
      interpret=cfg.interpret,
      name="jaxrl_flash_dq_tpu",
  )(*rows, qh, doh, lse, delta, kh_, vh, *ids)

  sp = _specs_common(g, h, bq, bk, q_tiles_outer=False)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, n_q=nq),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(b, kh, nk, nq),
          in_specs=[sp["q"], sp["q"], sp["row"], sp["row"], sp["k"], sp["k"], sp["qid"], sp["qid"],
                    sp["kid"], sp["kid"]],
          out_specs=[sp["k"], sp["k"]],
          scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(kh_.shape, k.dtype), jax.ShapeDtypeStruct(vh.shape, v.dtype)],
      compiler_params=_params(3, 1),
      interpret=cfg.interpret,
      name="jaxrl_flash_dkv_tpu",
  )(*cols, qh, doh, lse, delta, kh_, vh, *ids)
  return _from_heads_major(dq), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
