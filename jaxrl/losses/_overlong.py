"""Overlong handling: mask truncated responses (GRPO+ / DAPO) or penalise length softly (DAPO)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dapo_overlong_penalty", "overlong_filter_mask"]


def overlong_filter_mask(
    response_mask: jax.Array,  # [B, T]
    truncated: jax.Array,  # [B] bool (or [B, T] per token for packed rows)
) -> jax.Array:  # [B, T] float32
  r"""Overlong filtering: drop every token of truncated responses from the loss.

  ``m'_{b,t} = m_{b,t} · (1 - truncated_b)``. Apply it before :func:`jaxrl.losses.loss_weights`, so
  filtered responses also leave the normaliser; the model is then not penalised for thinking past
  the current context limit (iterative context lengthening).

  Args:
    response_mask: ``[B, T]``.
    truncated: ``[B]`` true where the response hit the length limit (finish reason ``"length"``),
      or ``[B, T]`` per token (e.g. broadcast per packed segment).

  Returns:
    ``[B, T]`` float32 mask.

  References: seeds 000 "DeepCoder" (GRPO+ overlong filtering); Yu et al. 2025, "DAPO" §3.4.
  """
  mask = jnp.asarray(response_mask).astype(jnp.float32)
  truncated = jnp.asarray(truncated).astype(bool)
  if truncated.ndim == 1:
    truncated = truncated[:, None]
  return jnp.where(truncated, 0.0, mask)


def dapo_overlong_penalty(
    lengths: jax.Array,  # [B] int
    *,
    max_len: int,
    cache_len: int,
) -> jax.Array:  # [B] float32
  r"""DAPO soft overlong punishment, added to the task reward.

  ``R(l) = 0`` if ``l ≤ L_max - L_cache``; ``((L_max - L_cache) - l) / L_cache`` if
  ``L_max - L_cache < l ≤ L_max``; ``-1`` if ``l > L_max``.

  Args:
    lengths: ``[B]`` response lengths ``|y|``.
    max_len: ``L_max``.
    cache_len: ``L_cache`` (the soft-punishment interval), ``0 < L_cache ≤ L_max``.

  Returns:
    ``[B]`` penalties in ``[-1, 0]``.

  References: Yu et al. 2025, "DAPO" §3.4 eq. 13.
  """
  if not 0 < cache_len <= max_len:
    raise ValueError(f"dapo_overlong_penalty: need 0 < cache_len <= max_len, got {cache_len!r}, {max_len!r}")
  l = jax.lax.stop_gradient(jnp.asarray(lengths).astype(jnp.float32))
  start = float(max_len - cache_len)
  soft = (start - l) / float(cache_len)
  return jnp.where(l <= start, 0.0, jnp.where(l <= max_len, soft, -1.0))
