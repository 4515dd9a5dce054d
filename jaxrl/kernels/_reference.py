"""Pure-JAX (XLA) reference attention over packed sequences.

This is the numerical reference every other implementation is tested against. It materialises the
``[B, K, G, T, S]`` logits, so it is meant for tests, CPU runs and short sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite mask value: -inf would turn 0 * inf into NaN in gradients of fully-masked rows.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pair(x, name):
  """``x`` or ``(x_q, x_kv)`` → ``(x_q, x_kv)``."""
  if isinstance(x, (tuple, list)):
    if len(x) != 2:
      raise ValueError(f"{name} must be an array or a (q, kv) pair, got {len(x)} items")
    return x[0], x[1]
  return x, x


def make_mask(
    q_segment_ids: jax.Array,  # [B, T]
    kv_segment_ids: jax.Array,  # [B, S]
    q_positions: jax.Array,  # [B, T]
    kv_positions: jax.Array,  # [B, S]
    *,
    causal: bool,
    window: int | None,
) -> jax.Array:  # [B, T, S] bool
  """Which (query, key) pairs may attend: same non-zero segment, causal and windowed by position."""
  mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
  delta = q_positions[:, :, None] - kv_positions[:, None, :]
  if causal:
    mask &= delta >= 0
  if window is not None:
    mask &= delta < window
    if not causal:
      mask &= delta > -window
  return mask


def attention_reference(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids,  # [B, T] or ([B, T], [B, S])
    positions=None,  # [B, T] or ([B, T], [B, S]); default: arange
    causal: bool = True,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [B, T, N, H]
  """softmax(mask(q·kᵀ·scale)) · v with GQA, packing, causality, sliding window and soft-cap.

  ``mask[b, t, s]`` is true when query ``t`` and key ``s`` carry the same non-zero segment id, and
  (if causal) ``pos[t] >= pos[s]``, and (if ``window``) ``pos[t] - pos[s] < window``. Queries with no
  visible key (padding, segment 0) get output 0 and gradient 0. Softmax runs in float32.
  """
  b, t, n, h = q.shape
  _, s, kh, _ = k.shape
  if n % kh:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kh})")
  g = n // kh
  q_seg, kv_seg = pair(segment_ids, "segment_ids")
  if positions is None:
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  else:
    q_pos, kv_pos = pair(positions, "positions")
  scale = h**-0.5 if sm_scale is None else sm_scale
  qg = q.reshape(b, t, kh, g, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = make_mask(q_seg, kv_seg, q_pos, kv_pos, causal=causal, window=window)[:, None, None]
  logits = jnp.where(mask, logits, MASK_VALUE)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, h).astype(q.dtype)
