"""Single-token decode attention over a KV cache with per-row lengths (ragged batch), GQA.

Row ``b`` has ``lengths[b]`` valid cache entries ``[0, lengths[b])`` and its query sits at position
``lengths[b] - 1``; with a window, only keys ``s >= lengths[b] - window`` are visible. A row with
length 0 gets output 0. The Pallas kernels read only the valid KV tiles: the Triton kernel bounds
its loop by the row length (and splits the cache across programs, flash-decoding style, combining the
partial softmaxes afterwards); the TPU kernel scalar-prefetches the lengths and clamps the K/V index
map so tiles past the length (or before the window) are never DMA'd.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.kernels import _online_softmax
from jaxrl.kernels._common import LOG2E, NT, dot_f32, next_pow2, pad_axis, round_up
from jaxrl.kernels._reference import MASK_VALUE


_dot = dot_f32  # precision stated (Mosaic refuses an fp32-precision dot on bf16 under "highest")


def _check(q, k_cache, v_cache, lengths):
  b, n, h = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != h:
    raise ValueError(f"k_cache must be [B={b}, S, K, H={h}], got {k_cache.shape}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache shape {v_cache.shape} differs from k_cache {k_cache.shape}")
  if n % k_cache.shape[2]:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({k_cache.shape[2]})")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must have shape ({b},), got {lengths.shape}")


def decode_attention_reference(
    q: jax.Array,  # [B, N, H]
    k_cache: jax.Array,  # [B, S, K, H]
    v_cache: jax.Array,  # [B, S, K, H]
    lengths: jax.Array,  # [B] int
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [B, N, H]
  """``softmax_s(q·k_s·scale) · v`` over the valid cache entries of each row (pure JAX).

  ``valid[b, s] = s < lengths[b]`` (and ``s >= lengths[b] - window``); rows with no valid entry
  return 0. Softmax in float32.
  """
  lengths = jnp.asarray(lengths).astype(jnp.int32)
  _check(q, k_cache, v_cache, lengths)
  b, n, h = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  scale = h**-0.5 if sm_scale is None else sm_scale
  qg = q.reshape(b, kh, n // kh, h)
  logits = jnp.einsum("bkgh,bskh->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  idx = jnp.arange(s, dtype=jnp.int32)[None, :]
  valid = idx < lengths[:, None]
  if window is not None:
    valid &= idx >= lengths[:, None] - window
  valid = valid[:, None, None, :]
  logits = jnp.where(valid, logits, MASK_VALUE)
  p = jnp.where(valid, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum("bkgs,bskh->bkgh", p.astype(v_cache.dtype), v_cache,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, n, h).astype(q.dtype)


def _window_start(length, window):
  return jnp.int32(0) if window is None else jnp.maximum(length - window, 0)


def _masked_logits(q, k, start, length, base, *, scale, softcap):
  """Logits of one ``[G, bk]`` tile with the length/window mask; ``base`` = first key index."""
  s = _dot(q, k, NT) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  idx = base + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  valid = (idx < length) & (idx >= start)
  return jnp.where(valid, s, MASK_VALUE), valid


# ------------------------------------------------------------------------------------------------
# Triton.


def _triton_kernel(len_ref,  # [B] int32
                   q_ref,  # [G', H]
                   k_ref, v_ref,  # [S, H]
                   o_ref,  # [G', H] float32 (this split's normalised partial output)
                   lse_ref,  # [G'] float32
                   *, scale, softcap, window, block_kv, split_len):
  b, p = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]
  q = q_ref[...]
  g, h = q.shape
  lo_tok = jnp.maximum(p * split_len, _window_start(length, window))
  hi_tok = jnp.minimum((p + 1) * split_len, length)
  lo, hi = lax.div(lo_tok, block_kv), lax.div(hi_tok + block_kv - 1, block_kv)

  def step(j, carry):
    sl = pl.ds(j * block_kv, block_kv)
    s, valid = _masked_logits(q, k_ref[sl, :], lo_tok, hi_tok, j * block_kv, scale=scale * LOG2E,
                              softcap=None if softcap is None else softcap * LOG2E)
    return _online_softmax.update(*carry, s, v_ref[sl, :], valid=valid, base2=True)

  carry = lax.fori_loop(lo, jnp.maximum(hi, lo), step, _online_softmax.init((g, h), column=False))
  o_ref[...], lse_ref[...] = _online_softmax.finish(*carry, base2=True)


def _combine(o, lse):  # [B, P, N, H], [B, P, N] -> [B, N, H]
  """Merge per-split softmaxes: weights ``exp(lse_p - max_p lse)``; empty splits weigh 0."""
  m = jnp.max(lse, axis=1, keepdims=True)
  w = jnp.exp(lse - m)
  w = jnp.where(lse > MASK_VALUE / 2, w, 0.0)
  den = jnp.sum(w, axis=1)
  return jnp.sum(o * w[..., None], axis=1) / jnp.where(den > 0, den, 1.0)[..., None]


def decode_attention_triton(q, k_cache, v_cache, lengths, *, sm_scale=None, softcap=None,
                            window=None, block_kv=None, num_splits=None, interpret=False):
  """Pallas Triton decode kernel; see :func:`decode_attention_reference` for the semantics.

  Grid ``(B, K, splits)``; each program handles one kv head's whole q-head group (padded to
  ≥ 16 rows for ``tl.dot``) over one slice of the cache, looping only over tiles below the row
  length.
  """
  from jax.experimental.pallas import triton as plgpu
  lengths = jnp.asarray(lengths).astype(jnp.int32)
  _check(q, k_cache, v_cache, lengths)
  b, n, h = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  lengths = jnp.clip(lengths, 0, s)
  g = n // kh
  scale = h**-0.5 if sm_scale is None else sm_scale
  bk = block_kv or min(64, max(next_pow2(s), 16))
  if num_splits is None:
    num_splits = max(1, min(16, s // 1024))
  split_len = round_up(pl.cdiv(s, num_splits), bk)
  sp = split_len * num_splits
  gp, hp = max(next_pow2(g), 16), max(next_pow2(h), 16)
  qp = pad_axis(pad_axis(q.reshape(b, kh, g, h), 2, gp), 3, hp)
  kp = pad_axis(pad_axis(k_cache, 1, sp), 3, hp)
  vp = pad_axis(pad_axis(v_cache, 1, sp), 3, hp)
  o, lse = pl.pallas_call(
      functools.partial(_triton_kernel, scale=scale, softcap=softcap, window=window, block_kv=bk,
                        split_len=split_len),
      grid=(b, kh, num_splits),
      in_specs=[pl.BlockSpec((b,), lambda b_, h_, p: (0,)),
                pl.BlockSpec((None, None, gp, hp), lambda b_, h_, p: (b_, h_, 0, 0)),
                pl.BlockSpec((None, sp, None, hp), lambda b_, h_, p: (b_, 0, h_, 0)),
                pl.BlockSpec((None, sp, None, hp), lambda b_, h_, p: (b_, 0, h_, 0))],
      out_specs=[pl.BlockSpec((None, None, None, gp, hp), lambda b_, h_, p: (b_, p, h_, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b_, h_, p: (b_, p, h_, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, num_splits, kh, gp, hp), jnp.float32),
                 jax.ShapeDtypeStruct((b, num_splits, kh, gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxrl_decode_triton",
  )(lengths, qp, kp, vp)
  o = o[:, :, :, :g, :h].reshape(b, num_splits, n, h)
  lse = lse[:, :, :, :g].reshape(b, num_splits, n)
  return _combine(o, lse).astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# TPU.


def _tpu_kernel(len_ref,  # SMEM [B]
                q_ref,  # [K, G, H]
                k_ref, v_ref,  # [bk, K, H]
                o_ref,  # [K, G, H]
                m_scr, l_scr,  # [K, G, 1]
                acc_scr,  # [K, G, H]
                *, scale, softcap, window, block_kv, n_kv):
  b, j = pl.program_id(0), pl.program_id(1)
  length = len_ref[b]
  start = _window_start(length, window)
  kh = q_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    m_scr[...], l_scr[...], acc_scr[...] = _online_softmax.init(acc_scr.shape, column=True)

  @pl.when((j * block_kv < length) & ((j + 1) * block_kv > start))
  def _body():
    for h in range(kh):
      s, valid = _masked_logits(q_ref[h], k_ref[:, h, :], start, length, j * block_kv, scale=scale,
                                softcap=softcap)  # [G, bk]
      m_scr[h], l_scr[h], acc_scr[h] = _online_softmax.update(m_scr[h], l_scr[h], acc_scr[h], s,
                                                             v_ref[:, h, :], valid=valid)

  @pl.when(j == n_kv - 1)
  def _finish():
    o, _ = _online_softmax.finish(m_scr[...], l_scr[...], acc_scr[...])
    o_ref[...] = o.astype(o_ref.dtype)


def decode_attention_tpu(q, k_cache, v_cache, lengths, *, sm_scale=None, softcap=None,
                         window=None, block_kv=None, interpret=False):
  """Pallas TPU decode kernel; see :func:`decode_attention_reference` for the semantics.

  Grid ``(B, key tiles)``; a program holds all kv heads of one cache tile (``[bk, K, H]``, the
  cache stays in its ``[B, S, K, H]`` layout) and every q-head group. The lengths are scalar-prefetched and
  the cache index map is clamped to the valid tiles, so tiles past the length cost no DMA.
  """
  from jax.experimental.pallas import tpu as pltpu
  lengths = jnp.asarray(lengths).astype(jnp.int32)
  _check(q, k_cache, v_cache, lengths)
  b, n, h = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  lengths = jnp.clip(lengths, 0, s)
  g = n // kh
  scale = h**-0.5 if sm_scale is None else sm_scale
  bk = block_kv or min(512, max(next_pow2(s), 128))
  sp = round_up(s, bk)
  nk = sp // bk
  kp, vp = pad_axis(k_cache, 1, sp), pad_axis(v_cache, 1, sp)
  if interpret is True:
    interpret = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")

  def kv_map(b_, j, len_ref):
    length = len_ref[b_]
    first = lax.div(_window_start(length, window), bk)  # non-negative: no floor/sign needed
    last = lax.div(jnp.maximum(length - 1, 0), bk)
    return (b_, jnp.maximum(jnp.minimum(j, last), first), 0, 0)

  o = pl.pallas_call(
      functools.partial(_tpu_kernel, scale=scale, softcap=softcap, window=window, block_kv=bk,
                        n_kv=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, nk),
          in_specs=[pl.BlockSpec((None, kh, g, h), lambda b_, j, _: (b_, 0, 0, 0)),
                    pl.BlockSpec((None, bk, kh, h), kv_map),
                    pl.BlockSpec((None, bk, kh, h), kv_map)],
          out_specs=pl.BlockSpec((None, kh, g, h), lambda b_, j, _: (b_, 0, 0, 0)),
          scratch_shapes=[pltpu.VMEM((kh, g, 1), jnp.float32), pltpu.VMEM((kh, g, 1), jnp.float32),
                          pltpu.VMEM((kh, g, h), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, h), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="jaxrl_decode_tpu",
  )(lengths, q.reshape(b, kh, g, h), kp, vp)
  return o.reshape(b, n, h)
