"""Attention kernels behind one entry point.

``attention(q, k, v, *, segment_ids, positions, causal=True, impl="auto")`` dispatches to an
implementation by name. The model and the sampler call only this function.

Implementations:
  ``reference`` — pure JAX/XLA (``_reference.py``), the numerical reference; used on CPU.

This package imports nothing but JAX (it lives inside ``jaxrl`` only so that it does not shadow the
unrelated ``kernels`` package on PyPI, which ``transformers`` probes for at import time).
"""

from __future__ import annotations

import jax

from jaxrl.kernels._reference import MASK_VALUE, attention_reference, make_mask

IMPLS = ("auto", "reference")


def attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids,
    positions=None,
    causal: bool = True,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_sizes=None,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:  # [B, T, N, H]
  """Packed-sequence attention; see :func:`attention_reference` for the exact semantics.

  Args:
    q: queries ``[B, T, N, H]``; ``N`` a multiple of the kv heads ``K`` (GQA/MQA).
    k, v: keys and values ``[B, S, K, H]``.
    segment_ids: ``[B, T]`` int (0 = padding), or a ``(q_ids [B, T], kv_ids [B, S])`` pair.
    positions: ``[B, T]`` int or a ``(q_pos, kv_pos)`` pair; causality and windows use these.
    causal: mask keys at later positions.
    sm_scale: logit scale, default ``H ** -0.5``.
    softcap: if set, logits become ``softcap * tanh(logits / softcap)``.
    window: if set, a key is visible only when ``pos_q - pos_k < window``.
    block_sizes: kernel tiling (ignored by ``reference``).
    impl: ``"auto"`` or one of :data:`IMPLS`.
    interpret: run Pallas kernels in interpret mode (ignored by ``reference``).
  """
  del block_sizes, interpret
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
  return attention_reference(
      q, k, v, segment_ids=segment_ids, positions=positions, causal=causal,
      sm_scale=sm_scale, softcap=softcap, window=window)


__all__ = ["IMPLS", "MASK_VALUE", "attention", "attention_reference", "make_mask"]
