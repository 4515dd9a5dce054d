"""Flash attention over packed sequences: Pallas GPU kernels lowered through Triton.

Layout. Inputs stay in the model's ``[B, T, N, H]`` / ``[B, S, K, H]`` layout (no transposes): a
program owns one query tile of ``block_q`` positions for all ``G = N / K`` query heads of one kv
head, loaded as ``[block_q, G, H]`` and flattened to ``block_q·G`` rows (row ``r`` is position
``r // G``, head ``r % G``), so each K/V tile is loaded once per group. Triton needs power-of-two
tensor dims: a non-power-of-two group (or head dim) is zero-padded outside the kernel, and zero
query heads contribute exactly nothing to dk/dv.

Passes (grid ``(tiles, B, K)``; causal query-tile grids run the last, longest tiles first):
  forward   per query tile, loop over key tiles ``[lo, hi)`` from :mod:`._blocks`, split into
            masked / unmasked (``full``) / masked sub-loops; writes ``o`` and float32 ``lse``.
  dq        per query tile, same loop; ``dq = Σ_j dS_j K_j · scale``.
  dk/dv     per key tile, loop over query tiles ``[lo, hi)``; the whole q-head group is in the rows,
            so ``dk``/``dv`` are summed over the group in registers: no atomics, no repeated K/V.

Softmax runs in base 2 (``exp2``, with ``log2 e`` folded into the logit scale); ``lse`` is stored in
natural log. The running max starts at the finite ``MASK_VALUE`` and masked probabilities are
zeroed explicitly, so a query that sees no key gets ``l = 0`` → output 0, ``lse = EMPTY_LSE`` and
zero gradients, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.kernels import _blocks, _online_softmax
from jaxrl.kernels._common import (EMPTY_LSE, LOG2E, NN, NT, TN, BlockSizes, Config, next_pow2,
                                  pad_axis, visible)
from jaxrl.kernels._reference import MASK_VALUE


def _dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def default_blocks(head_dim: int, group: int) -> BlockSizes:
  """Tiles sized for Hopper: 128 query rows × 64 keys forward, 64 × 64 backward (head dim ≤ 128)."""
  g = next_pow2(group)
  rows_f, rows_b, kv = (128, 64, 64) if head_dim <= 128 else (64, 32, 32)
  return BlockSizes(block_q=max(rows_f // g, 1), block_kv=kv, block_q_bwd=max(rows_b // g, 1),
                    block_kv_bwd=kv, num_warps=4 if head_dim <= 64 else 8,
                    num_stages=3 if head_dim <= 128 else 2)


def resolve_blocks(blocks: BlockSizes, *, t: int, s: int, head_dim: int, group: int) -> BlockSizes:
  """Fill defaults and clip tiles to the (power-of-two-rounded) sequence lengths.

  Triton's ``tl.dot`` needs every dim ≥ 16, so a query tile keeps ``block_q · G ≥ 16`` rows.
  """
  d = default_blocks(head_dim, group)
  g = next_pow2(group)
  pick = lambda x, y: y if x is None else x  # noqa: E731
  min_q = max(16 // g, 1)
  bq = max(min(pick(blocks.block_q, d.block_q), next_pow2(t)), min_q)
  bqb = max(min(pick(blocks.block_q_bwd, d.block_q_bwd), next_pow2(t)), min_q)
  bk = max(min(pick(blocks.block_kv, d.block_kv), next_pow2(s)), 16)
  bkb = max(min(pick(blocks.block_kv_bwd, d.block_kv_bwd), next_pow2(s)), 16)
  return BlockSizes(block_q=bq, block_kv=bk, block_q_bwd=bqb, block_kv_bwd=bkb,
                    num_warps=pick(blocks.num_warps, d.num_warps),
                    num_stages=pick(blocks.num_stages, d.num_stages))


def _q_tile(x, n_q: int, causal: bool):
  """Query tile of program ``x``: causal grids run the longest rows (last tiles) first."""
  return n_q - 1 - x if causal else x


def _rows(x: jax.Array, g: int) -> jax.Array:  # [bq] -> [bq * g]
  return jnp.broadcast_to(x[:, None], (x.shape[0], g)).reshape(x.shape[0] * g)


def _logits(q, k, cfg):
  """Scaled (and soft-capped) logits in base-2 units, plus ``tanh`` for the soft-cap gradient."""
  if cfg.softcap is None:
    return _dot(q, k, NT) * (cfg.sm_scale * LOG2E), None
  t = jnp.tanh(_dot(q, k, NT) * (cfg.sm_scale / cfg.softcap))
  return t * (cfg.softcap * LOG2E), t


# ------------------------------------------------------------------------------------------------
# Forward.


def _fwd_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # [nq] int32 tile ranges
                q_ref,  # [bq, G, H]
                k_ref, v_ref,  # [S, H]
                qs_ref, qp_ref,  # [bq]
                ks_ref, kp_ref,  # [S]
                o_ref,  # [bq, G, H]
                lse_ref,  # [bq, G]
                *cnt_ref,  # optional [1] debug counter of tiles computed
                cfg: Config, block_kv: int, n_q: int):
  i = _q_tile(pl.program_id(0), n_q, cfg.causal)
  bq, g, h = q_ref.shape
  rows = bq * g
  q = q_ref[...].reshape(rows, h)
  q_seg, q_pos = _rows(qs_ref[...], g), _rows(qp_ref[...], g)

  def step(j, carry, masked):
    m, l, acc, n = carry
    sl = pl.ds(j * block_kv, block_kv)
    s, _ = _logits(q, k_ref[sl, :], cfg)  # [rows, bk]
    mask = None
    if masked:
      mask = visible(q_seg, q_pos, ks_ref[sl], kp_ref[sl], causal=cfg.causal, window=cfg.window)
      s = jnp.where(mask, s, MASK_VALUE)
    m, l, acc = _online_softmax.update(m, l, acc, s, v_ref[sl, :], valid=mask, base2=True, dot=_dot)
    return m, l, acc, n + 1

  carry = (*_online_softmax.init((rows, h), column=False), jnp.int32(0))
  lo, hi, flo, fhi = lo_ref[i], hi_ref[i], flo_ref[i], fhi_ref[i]
  carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
  m, l, acc, n = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
  o, lse = _online_softmax.finish(m, l, acc, base2=True, empty_lse=EMPTY_LSE)
  o_ref[...] = o.reshape(bq, g, h).astype(o_ref.dtype)
  lse_ref[...] = lse.reshape(bq, g)
  if cnt_ref:
    cnt_ref[0][...] = jnp.full((1,), n, jnp.int32)


def _compiler_params(blocks: BlockSizes):
  return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _pad_group(x: jax.Array, kh: int, g_pad: int) -> jax.Array:  # [B,T,K*G,H] -> [B,T,K*g_pad,H]
  b, t, n, h = x.shape
  g = n // kh
  if g == g_pad:
    return x
  x = pad_axis(x.reshape(b, t, kh, g, h), 3, g_pad)
  return x.reshape(b, t, kh * g_pad, h)


def _unpad_group(x: jax.Array, kh: int, g: int) -> jax.Array:
  b, t, n, h = x.shape
  if n == kh * g:
    return x
  return x.reshape(b, t, kh, n // kh, h)[:, :, :, :g].reshape(b, t, kh * g, h)


def _prep(q, k, v):
  """Pad the head group and head dim to powers of two (a no-op for the usual shapes)."""
  kh, h = k.shape[2], k.shape[3]
  g = q.shape[2] // kh
  g_pad, h_pad = next_pow2(g), max(next_pow2(h), 16)
  q = pad_axis(_pad_group(q, kh, g_pad), 3, h_pad)
  k, v = pad_axis(k, 3, h_pad), pad_axis(v, 3, h_pad)
  return q, k, v, g, g_pad


def forward(
    cfg: Config,
    q: jax.Array,  # [B, T, N, H], T a multiple of the query tiles
    k: jax.Array,  # [B, S, K, H], S a multiple of the key tiles
    v: jax.Array,  # [B, S, K, H]
    q_seg: jax.Array,  # [B, T] int32
    kv_seg: jax.Array,  # [B, S]
    q_pos: jax.Array,  # [B, T]
    kv_pos: jax.Array,  # [B, S]
):
  """Forward pass: ``(o [B, T, N, H], lse [B, T, N'] float32)`` (+ visited-tile counts if debug).

  ``N'`` is ``N`` with the head group padded to a power of two; ``lse`` stays in that layout.
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  bl = cfg.blocks
  bq, bk = bl.block_q, bl.block_kv
  nq = t // bq
  rows, _ = _blocks.block_ranges(q_seg, kv_seg, q_pos, kv_pos, block_q=bq, block_kv=bk,
                                 causal=cfg.causal, window=cfg.window)
  qp, kp, vp, g, g_pad = _prep(q, k, v)
  hp = qp.shape[-1]
  qt = functools.partial(_q_tile, n_q=nq, causal=cfg.causal)
  meta_spec = pl.BlockSpec((None, nq), lambda i, b_, h_: (b_, 0))
  in_specs = [meta_spec] * 4 + [
      pl.BlockSpec((None, bq, g_pad, hp), lambda i, b_, h_: (b_, qt(i), h_, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, b_, h_: (b_, 0, h_, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, b_, h_: (b_, 0, h_, 0)),
      pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, qt(i))),
      pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, qt(i))),
      pl.BlockSpec((None, s), lambda i, b_, h_: (b_, 0)),
      pl.BlockSpec((None, s), lambda i, b_, h_: (b_, 0)),
  ]
  out_shape = [jax.ShapeDtypeStruct(qp.shape, q.dtype),
               jax.ShapeDtypeStruct((b, t, kh * g_pad), jnp.float32)]
  out_specs = [pl.BlockSpec((None, bq, g_pad, hp), lambda i, b_, h_: (b_, qt(i), h_, 0)),
               pl.BlockSpec((None, bq, g_pad), lambda i, b_, h_: (b_, qt(i), h_))]
  if cfg.debug:
    out_shape.append(jax.ShapeDtypeStruct((b, kh, nq), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, 1), lambda i, b_, h_: (b_, h_, qt(i))))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, block_kv=bk, n_q=nq),
      grid=(nq, b, kh),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(bl),
      interpret=cfg.interpret,
      name="jaxrl_flash_fwd",
  )(*rows, qp, kp, vp, q_seg, q_pos, kv_seg, kv_pos)
  o = _unpad_group(outs[0], kh, g)[..., :h]
  if cfg.debug:
    return o, outs[1], outs[2]
  return o, outs[1]


# ------------------------------------------------------------------------------------------------
# Backward.


def _dq_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # [nq]
               q_ref, do_ref,  # [bq, G, H]
               lse_ref, delta_ref,  # [bq, G]
               k_ref, v_ref,  # [S, H]
               qs_ref, qp_ref,  # [bq]
               ks_ref, kp_ref,  # [S]
               dq_ref,  # [bq, G, H]
               *, cfg: Config, block_kv: int, n_q: int):
  i = _q_tile(pl.program_id(0), n_q, cfg.causal)
  bq, g, h = q_ref.shape
  rows = bq * g
  q = q_ref[...].reshape(rows, h)
  do = do_ref[...].reshape(rows, h)
  lse2 = lse_ref[...].reshape(rows) * LOG2E
  delta = delta_ref[...].reshape(rows)
  q_seg, q_pos = _rows(qs_ref[...], g), _rows(qp_ref[...], g)

  def step(j, dq, masked):
    sl = pl.ds(j * block_kv, block_kv)
    k, v = k_ref[sl, :], v_ref[sl, :]
    s, t = _logits(q, k, cfg)
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      mask = visible(q_seg, q_pos, ks_ref[sl], kp_ref[sl], causal=cfg.causal, window=cfg.window)
      p = jnp.where(mask, p, 0.0)
    ds = p * (_dot(do, v, NT) - delta[:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _dot(ds.astype(k.dtype), k, NN)

  dq = jnp.zeros((rows, h), jnp.float32)
  lo, hi, flo, fhi = lo_ref[i], hi_ref[i], flo_ref[i], fhi_ref[i]
  dq = lax.fori_loop(lo, flo, functools.partial(step, masked=True), dq)
  dq = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), dq)
  dq = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), dq)
  dq_ref[...] = (dq * cfg.sm_scale).reshape(bq, g, h).astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, flo_ref, fhi_ref,  # [nk]
                q_ref, do_ref,  # [T, G, H]
                lse_ref, delta_ref,  # [T, G]
                k_ref, v_ref,  # [bk, H]
                qs_ref, qp_ref,  # [T]
                ks_ref, kp_ref,  # [bk]
                dk_ref, dv_ref,  # [bk, H]
                *, cfg: Config, block_q: int):
  j = pl.program_id(0)
  _, g, h = q_ref.shape
  rows = block_q * g
  k, v = k_ref[...], v_ref[...]
  kv_seg, kv_pos = ks_ref[...], kp_ref[...]

  def step(i, carry, masked):
    dk, dv = carry
    sl = pl.ds(i * block_q, block_q)
    q = q_ref[sl, :, :].reshape(rows, h)
    do = do_ref[sl, :, :].reshape(rows, h)
    lse2 = lse_ref[sl, :].reshape(rows) * LOG2E
    delta = delta_ref[sl, :].reshape(rows)
    s, t = _logits(q, k, cfg)  # [rows, bk]
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      mask = visible(_rows(qs_ref[sl], g), _rows(qp_ref[sl], g), kv_seg, kv_pos,
                     causal=cfg.causal, window=cfg.window)
      p = jnp.where(mask, p, 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, TN)
    ds = p * (_dot(do, v, NT) - delta[:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    dk = dk + _dot(ds.astype(q.dtype), q, TN)
    return dk, dv

  carry = (jnp.zeros((k.shape[0], h), jnp.float32), jnp.zeros((k.shape[0], h), jnp.float32))
  lo, hi, flo, fhi = lo_ref[j], hi_ref[j], flo_ref[j], fhi_ref[j]
  carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
  dk, dv = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
  dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse, do):
  """Backward pass: ``(dq, dk, dv)`` from the forward residuals and the output cotangent."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  bl = cfg.blocks
  bq, bk = bl.block_q_bwd, bl.block_kv_bwd
  nq, nk = t // bq, s // bk
  rows, cols = _blocks.block_ranges(q_seg, kv_seg, q_pos, kv_pos, block_q=bq, block_kv=bk,
                                    causal=cfg.causal, window=cfg.window)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, N]
  qp, kp, vp, g, g_pad = _prep(q, k, v)
  dop = pad_axis(_pad_group(do, kh, g_pad), 3, qp.shape[-1])
  delta = pad_axis(delta.reshape(b, t, kh, g), 3, g_pad).reshape(b, t, kh * g_pad)
  hp = qp.shape[-1]
  params = _compiler_params(bl)

  qt = functools.partial(_q_tile, n_q=nq, causal=cfg.causal)
  meta_q = pl.BlockSpec((None, nq), lambda i, b_, h_: (b_, 0))
  q_tile = pl.BlockSpec((None, bq, g_pad, hp), lambda i, b_, h_: (b_, qt(i), h_, 0))
  row_tile = pl.BlockSpec((None, bq, g_pad), lambda i, b_, h_: (b_, qt(i), h_))
  kv_all = pl.BlockSpec((None, s, None, hp), lambda i, b_, h_: (b_, 0, h_, 0))
  ids_q_tile = pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, qt(i)))
  ids_kv_all = pl.BlockSpec((None, s), lambda i, b_, h_: (b_, 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, block_kv=bk, n_q=nq),
      grid=(nq, b, kh),
      in_specs=[meta_q] * 4 + [q_tile, q_tile, row_tile, row_tile, kv_all, kv_all,
                               ids_q_tile, ids_q_tile, ids_kv_all, ids_kv_all],
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
      compiler_params=params,
      interpret=cfg.interpret,
      name="jaxrl_flash_dq",
  )(*rows, qp, dop, lse, delta, kp, vp, q_seg, q_pos, kv_seg, kv_pos)

  meta_k = pl.BlockSpec((None, nk), lambda j, b_, h_: (b_, 0))
  q_all = pl.BlockSpec((None, t, g_pad, hp), lambda j, b_, h_: (b_, 0, h_, 0))
  row_all = pl.BlockSpec((None, t, g_pad), lambda j, b_, h_: (b_, 0, h_))
  kv_tile = pl.BlockSpec((None, bk, None, hp), lambda j, b_, h_: (b_, j, h_, 0))
  ids_q_all = pl.BlockSpec((None, t), lambda j, b_, h_: (b_, 0))
  ids_kv_tile = pl.BlockSpec((None, bk), lambda j, b_, h_: (b_, j))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, block_q=bq),
      grid=(nk, b, kh),
      in_specs=[meta_k] * 4 + [q_all, q_all, row_all, row_all, kv_tile, kv_tile,
                               ids_q_all, ids_q_all, ids_kv_tile, ids_kv_tile],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
      compiler_params=params,
      interpret=cfg.interpret,
      name="jaxrl_flash_dkv",
  )(*cols, qp, dop, lse, delta, kp, vp, q_seg, q_pos, kv_seg, kv_pos)
  return _unpad_group(dq, kh, g)[..., :h], dk[..., :h], dv[..., :h]
