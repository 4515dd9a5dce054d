"""Shared pieces of the policy objectives: the :data:`OBJECTIVES` registry, the context keywords,
the log-ratio clamp, the float32 masked input views (:class:`_Inputs`) with the weighted-sum loss and
metrics, and the clipped surrogate.

Formulas (docs/losses.md, "Policy objectives"): ``loss = Σ_{b,t} w · is_weights · ℓ_t``; metrics are
weighted sums ``Σ w·m_t`` (``approx_kl = Σ w (r - 1 - log r)``); log-ratios clamped to ``[-20, 20]``;
the clipped surrogate ``max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))`` that :mod:`jaxrl.losses._pg_ppo`
and :mod:`jaxrl.losses._pg_coupled` build on. The signature every objective shares is in
:mod:`jaxrl.losses._policy`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Objective = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]

OBJECTIVES: dict[str, Objective] = {}
"""Policy objectives by name; all share the keyword-only signature of :mod:`jaxrl.losses._policy`."""

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp``."""

CONTEXT_KEYS = frozenset({
    "is_weights", "response_mask", "segment_ids", "entropy", "prox_logprobs", "versions",
    "current_version", "ref_logprobs", "rng",
})


def register_objective(name: str, fn: Objective | None = None, *, overwrite: bool = False):
  """Registers ``fn`` in :data:`OBJECTIVES` under ``name``; usable as a decorator.

  Args:
    name: registry key.
    fn: the objective (keyword-only, returns ``(loss, metrics)``); omit to use as ``@register_objective(name)``.
    overwrite: allow replacing an existing entry (otherwise a duplicate name raises ``ValueError``).

  Returns:
    ``fn`` (or a decorator that registers and returns it).
  """

  def register(f: Objective) -> Objective:
    if name in OBJECTIVES and not overwrite:
      raise ValueError(f"objective {name!r} is already registered; pass overwrite=True to replace it")
    OBJECTIVES[name] = f
    return f

  return register if fn is None else register(fn)


# --------------------------------------------------------------------------------------------------
# Shared pieces.


def _check_context(name: str, context: dict[str, Any]) -> None:
  unknown = set(context) - CONTEXT_KEYS
  if unknown:
    raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")


class _Inputs:
  """float32, masked, stop-gradient views of an objective's inputs."""

  def __init__(self, logprobs, old_logprobs, advantages, loss_weights, context):
    w = jax.lax.stop_gradient(jnp.asarray(loss_weights).astype(jnp.float32))  # [B, T]
    self.valid = w != 0
    self.w = jnp.where(self.valid, w, 0.0)
    self.lp = jnp.where(self.valid, jnp.asarray(logprobs).astype(jnp.float32), 0.0)
    self.old = self._data(old_logprobs)
    adv = jnp.asarray(advantages).astype(jnp.float32)
    if adv.ndim == 1:
      adv = adv[:, None]
    self.adv = self._data(jnp.broadcast_to(adv, self.w.shape))
    isw = context.get("is_weights")
    self.is_weights = None if isw is None else self._data(isw)
    mask = context.get("response_mask")
    self.mask = self.valid.astype(jnp.float32) if mask is None else self._data(mask)
    self.segment_ids = context.get("segment_ids")
    self.entropy = context.get("entropy")

  def _data(self, x):
    x = jax.lax.stop_gradient(jnp.asarray(x).astype(jnp.float32))
    return jnp.where(self.valid, x, 0.0)

  def log_ratio(self, anchor=None):
    anchor = self.old if anchor is None else anchor
    return jnp.clip(self.lp - anchor, -MAX_LOG_RATIO, MAX_LOG_RATIO)

  def wsum(self, x):
    return jnp.sum(jnp.where(self.valid, self.w * x, 0.0))

  def loss(self, per_token):
    if self.is_weights is not None:
      per_token = per_token * self.is_weights
    return self.wsum(per_token)

  def metrics(self, ratio, log_ratio, *, clipped_low=None, clipped_high=None, **extra):
    """Weighted-sum metrics (stop-gradient)."""
    sg = jax.lax.stop_gradient
    ratio, log_ratio = sg(ratio), sg(log_ratio)
    zeros = jnp.zeros_like(ratio, dtype=bool)
    low = zeros if clipped_low is None else clipped_low
    high = zeros if clipped_high is None else clipped_high
    any_valid = jnp.any(self.valid)
    big = jnp.finfo(jnp.float32).max
    m = {
        "clip_frac_low": self.wsum(low.astype(jnp.float32)),
        "clip_frac_high": self.wsum(high.astype(jnp.float32)),
        "ratio_mean": self.wsum(ratio),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(self.valid, ratio, big)), 0.0),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(self.valid, ratio, -big)), 0.0),
        "approx_kl": self.wsum(jnp.expm1(log_ratio) - log_ratio),
        "weight_sum": jnp.sum(self.w),
    }
    m["clip_frac"] = m["clip_frac_low"] + m["clip_frac_high"]
    if self.entropy is not None:
      m["entropy"] = self.wsum(self._data(self.entropy))
    for k, v in extra.items():
      m[k] = sg(self.wsum(jnp.asarray(v, jnp.float32)))
    return m


def _clipped_surrogate(ratio, adv, low, high):
  """``max(-A·r, -A·clip(r, low, high))`` and which side's clip is active."""
  loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, low, high))
  clipped_low = (adv < 0) & (ratio < low)
  clipped_high = (adv > 0) & (ratio > high)
  return loss, clipped_low, clipped_high


def _ppo(inp: _Inputs, epsilon_low: float, epsilon_high: float):
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  per_token, low, high = _clipped_surrogate(ratio, inp.adv, 1.0 - epsilon_low, 1.0 + epsilon_high)
  return per_token, ratio, log_ratio, low, high


def _check_eps(name, **eps):
  for k, v in eps.items():
    if v < 0:
      raise ValueError(f"{name}: {k} must be >= 0, got {v!r}")
