"""Online (flash) softmax: the running max / sum / rescaled-accumulator update, shared by every kernel.

A row's softmax-weighted sum of values is built one key tile at a time. With running max ``m``,
running sum ``l`` and unnormalised output ``acc`` (all float32), a tile of logits ``s [R, bk]`` and
values ``v [bk, H]`` update them as

    m' = max(m, max_j s_j),  α = exp(m - m'),  p_j = exp(s_j - m')  (0 where masked),
    l' = α·l + Σ_j p_j,      acc' = α·acc + p·v.

After the last tile, ``o = acc / l`` and ``lse = m + log l``. The kernels that fold ``log2 e`` into
the logit scale use ``base2`` (``exp2``; ``lse`` is still returned in natural log). The running max
starts at the finite ``MASK_VALUE`` and masked probabilities are zeroed, so a row that sees no key
keeps ``l = 0`` and gets output 0 and the ``empty_lse`` sentinel, never NaN.

The functions work on values, not refs, so the same code runs in the Triton kernels (``fori_loop``
carries, running max/sum ``[R]``) and the Mosaic TPU kernels (VMEM scratch, ``[..., R, 1]`` columns):
a 1-D ``m`` selects the first layout, ``m`` with a trailing axis of 1 the second.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.kernels._common import LN2, NN, dot_f32
from jaxrl.kernels._reference import MASK_VALUE


def init(acc_shape: tuple[int, ...], *, column: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Start state ``(m, l, acc)``: ``m = MASK_VALUE``, ``l = 0``, ``acc = 0``, all float32.

  ``acc`` has ``acc_shape`` (``[..., R, H]``); ``m`` and ``l`` are ``[..., R, 1]`` when ``column``
  (the TPU scratch layout), else ``[..., R]``.
  """
  stat_shape = acc_shape[:-1] + (1,) if column else acc_shape[:-1]
  return (jnp.full(stat_shape, MASK_VALUE, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
          jnp.zeros(acc_shape, jnp.float32))


def update(
    m: jax.Array,  # [R] or [R, 1] float32
    l: jax.Array,  # like m
    acc: jax.Array,  # [R, H] float32
    s: jax.Array,  # [R, bk] float32 logits, masked entries already MASK_VALUE
    v: jax.Array,  # [bk, H]
    *,
    valid: jax.Array | None = None,  # [R, bk] bool; None: every entry is visible
    base2: bool = False,
    dot: Callable[..., jax.Array] = dot_f32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One key tile of online softmax: ``(m', l', acc')`` as in the module docstring.

  Args:
    m, l, acc: the running max, running sum and unnormalised output.
    s: this tile's logits (in base-2 units when ``base2``).
    v: this tile's values; ``p`` is cast to ``v.dtype`` for the product.
    valid: the probabilities to keep; the others are set to exactly 0.
    base2: use ``exp2`` (the logits carry the ``log2 e`` factor).
    dot: ``dot(a, b, dimension_numbers)`` accumulating in float32 (the backend's matmul).

  Returns:
    The updated ``(m, l, acc)``, same shapes and dtypes.
  """
  exp = jnp.exp2 if base2 else jnp.exp
  column = m.ndim == s.ndim
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=column))
  alpha = exp(m - m_new)
  m_col, alpha_col = (m_new, alpha) if column else (m_new[:, None], alpha[:, None])
  p = exp(s - m_col)
  if valid is not None:
    p = jnp.where(valid, p, 0.0)
  l_new = alpha * l + jnp.sum(p, axis=1, keepdims=column)
  acc_new = alpha_col * acc + dot(p.astype(v.dtype), v, NN)
  return m_new, l_new, acc_new


def finish(
    m: jax.Array,  # [..., R] or [..., R, 1]
    l: jax.Array,  # like m
    acc: jax.Array,  # [..., R, H]
    *,
    base2: bool = False,
    empty_lse: float = MASK_VALUE,
) -> tuple[jax.Array, jax.Array]:
  """Normalise: ``(o = acc / l, lse = m + log l)``, float32; a row with ``l = 0`` gets
  ``o = 0`` and ``lse = empty_lse``. With ``base2``, ``m`` is in base-2 units and ``lse`` is
  converted back to natural log."""
  seen = l > 0.0
  safe = jnp.where(seen, l, 1.0)
  o = acc / (safe if m.ndim == acc.ndim else safe[..., None])
  lse = (m + jnp.log2(safe)) * LN2 if base2 else m + jnp.log(safe)
  return o, jnp.where(seen, lse, empty_lse)
