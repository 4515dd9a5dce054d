"""The critic's loss: PPO's clipped value loss as a weighted sum over tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def value_loss(
    *,
    values: jax.Array,  # [B, T]
    returns: jax.Array,  # [B, T]
    old_values: jax.Array,  # [B, T]
    loss_weights: jax.Array,  # [B, T]
    clip_range: float | None = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""Clipped value loss ``Σ_{b,t} w · max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)``.

  .. math::

      \ell_t = \max\big((V_t - \hat R_t)^2,\ (V_{old,t} + \mathrm{clip}(V_t - V_{old,t}, -\epsilon, \epsilon)
      - \hat R_t)^2\big),\qquad L = \sum_{b,t} w_{b,t}\,\ell_{b,t}

  ``V`` are the critic's current values, ``V_old`` its values at rollout time and ``R`` the value
  targets (GAE λ-returns, :func:`jaxrl.losses.gae_returns`). The weights ``w`` come from
  :func:`jaxrl.losses.loss_weights` with any aggregation mode, so the loss of a micro-batch adds up
  to the global mean whatever the split. ``clip_range=None`` gives the plain squared error. verl
  multiplies by ½; with the critic's own optimizer (Adam) that only rescales the gradient before
  clipping, so the formula is kept as published.

  Args:
    values: ``[B, T]`` current critic values (differentiable).
    returns: ``[B, T]`` value targets (data).
    old_values: ``[B, T]`` critic values at rollout time (data).
    loss_weights: ``[B, T]`` aggregation weights; tokens with ``w == 0`` never contribute, even NaN ones.
    clip_range: ``ε_v``; ``None`` disables clipping.

  Returns:
    ``(loss, metrics)``; metrics are weighted sums (divide by ``weight_sum`` for means):
    ``value_loss``, ``value_clip_frac`` (share where the clipped branch is the larger),
    ``value_mean``, ``return_mean``, ``weight_sum``.

  Example::

    w = loss_weights(mask, mode="token_mean")
    loss, m = value_loss(values=v, returns=ret, old_values=v_old, loss_weights=w, clip_range=0.2)

  References:
    Schulman et al. 2017 (PPO) and OpenAI baselines ``ppo2`` (value clipping); verl
    ``core_algos.compute_value_loss``.
  """
  if clip_range is not None and clip_range <= 0:
    raise ValueError(f"value_loss: clip_range must be > 0 or None, got {clip_range!r}")
  sg = jax.lax.stop_gradient
  w = sg(jnp.asarray(loss_weights).astype(jnp.float32))
  valid = w != 0
  w = jnp.where(valid, w, 0.0)
  data = lambda x: jnp.where(valid, sg(jnp.asarray(x).astype(jnp.float32)), 0.0)
  v = jnp.where(valid, jnp.asarray(values).astype(jnp.float32), 0.0)
  ret, old = data(returns), data(old_values)
  unclipped = jnp.square(v - ret)
  if clip_range is None:
    per_token, clipped = unclipped, jnp.zeros_like(valid)
  else:
    v_clip = old + jnp.clip(v - old, -clip_range, clip_range)
    clipped_loss = jnp.square(v_clip - ret)
    per_token = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
  wsum = lambda x: jnp.sum(jnp.where(valid, w * x, 0.0))
  loss = wsum(per_token)
  metrics = {"value_loss": sg(loss), "value_clip_frac": wsum(clipped.astype(jnp.float32)),
             "value_mean": sg(wsum(v)), "return_mean": wsum(ret), "weight_sum": jnp.sum(w)}
  return loss, metrics
