"""The PPO family of policy objectives: a clipped ratio surrogate around π_old (or π_prox).

Holds ``ppo_clip`` (PPO / GRPO, ``-min(r A, clip(r, 1-ε, 1+ε) A)``; notes 000 §AlignXplore eq. 10–12,
§ARPO GRPO objective), ``clip_higher`` (DAPO §3.1 decoupled ``ε_low / ε_high``; notes 000 §DeepCoder
Clip High), ``dual_clip`` (``min(ℓ^clip, -c A)`` for ``A < 0``), ``decoupled_ppo`` (AReaL eq. 4–5,
``-(π_prox/π_behav) · min(u A, clip(u) A)``, ``u = π_θ/π_prox``; notes 000 §AReaL decoupled PPO) and
its helper ``prox_logprobs_loglinear`` (``log π_prox ≈ log π_behav + α_t (log π_θ - log π_behav)``).
The shared signature and context keywords are in :mod:`jaxrl.losses._policy`; see docs/losses.md,
"Policy objectives".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._pg_base import (
    MAX_LOG_RATIO,
    _check_context,
    _check_eps,
    _clipped_surrogate,
    _Inputs,
    _ppo,
    register_objective,
)

__all__ = ["clip_higher", "decoupled_ppo", "dual_clip", "ppo_clip", "prox_logprobs_loglinear"]


@register_objective("ppo_clip")
def ppo_clip(*, logprobs, old_logprobs, advantages, loss_weights, epsilon: float = 0.2, **context):
  r"""PPO / GRPO clipped surrogate with a symmetric range.

  ``ℓ_t = -min(r_t A_t, clip(r_t, 1-ε, 1+ε) A_t)``, ``r_t = π_θ(y_t) / π_old(y_t)``. Tokens with
  ``A > 0, r > 1+ε`` or ``A < 0, r < 1-ε`` take the clipped branch and have zero gradient.

  Args:
    logprobs: ``[B, T]`` log π_θ.
    old_logprobs: ``[B, T]`` log π_old.
    advantages: ``[B, T]`` or ``[B]``.
    loss_weights: ``[B, T]`` aggregation weights.
    epsilon: clip range ε.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``.

  References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GRPO (Shao et al.
  2024); seeds 000 "AlignXplore" eq. 10–12 (GRPO without KL).
  """
  _check_context("ppo_clip", context)
  _check_eps("ppo_clip", epsilon=epsilon)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  per_token, ratio, log_ratio, low, high = _ppo(inp, epsilon, epsilon)
  return inp.loss(per_token), inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high)


@register_objective("clip_higher")
def clip_higher(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 0.2,
                epsilon_high: float = 0.28, **context):
  r"""DAPO clip-higher: PPO with a decoupled, larger upper clip bound.

  ``ℓ_t = -min(r_t A_t, clip(r_t, 1-ε_low, 1+ε_high) A_t)``; raising ``ε_high`` lets low-probability
  tokens grow and keeps entropy from collapsing. GRPO+ (DeepCoder) uses it with overlong filtering
  and neither entropy nor KL loss.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    epsilon_low: lower clip ε_low.
    epsilon_high: upper clip ε_high (DAPO: 0.28).
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``.

  References: Yu et al. 2025, "DAPO" §3.1; seeds 000 "DeepCoder" (GRPO+ Clip High).
  """
  _check_context("clip_higher", context)
  _check_eps("clip_higher", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  per_token, ratio, log_ratio, low, high = _ppo(inp, epsilon_low, epsilon_high)
  return inp.loss(per_token), inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high)


@register_objective("dual_clip")
def dual_clip(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, clip_ratio_c: float = 3.0, **context):
  r"""Dual-clip PPO: additionally bounds the loss of negative-advantage tokens by ``c·|A|``.

  ``ℓ^{clip}_t = -min(r A, clip(r, 1-ε_low, 1+ε_high) A)``;
  ``ℓ_t = min(ℓ^{clip}_t, -c·A_t)`` if ``A_t < 0`` else ``ℓ^{clip}_t`` (``c > 1``). When ``A < 0`` and
  ``r > c`` the loss is the constant ``c|A|`` and the token has zero gradient.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    epsilon_low, epsilon_high: clip range.
    clip_ratio_c: the dual-clip constant ``c`` (> 1).
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; ``metrics["dual_clip_frac"]`` is the weighted share of tokens at the bound.

  References: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning" (dual-clip PPO), as in verl's ``clip_ratio_c``.
  """
  _check_context("dual_clip", context)
  _check_eps("dual_clip", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  if clip_ratio_c <= 1.0:
    raise ValueError(f"dual_clip: clip_ratio_c must be > 1, got {clip_ratio_c!r}")
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  per_token, ratio, log_ratio, low, high = _ppo(inp, epsilon_low, epsilon_high)
  bound = -clip_ratio_c * inp.adv
  dual = (inp.adv < 0) & (per_token > bound)
  per_token = jnp.where(inp.adv < 0, jnp.minimum(per_token, bound), per_token)
  metrics = inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high, dual_clip_frac=dual)
  return inp.loss(per_token), metrics


def prox_logprobs_loglinear(
    logprobs: jax.Array,  # [B, T]
    old_logprobs: jax.Array,  # [B, T]
    versions: jax.Array,  # [B, T] int
    *,
    current_version: int | jax.Array,
) -> jax.Array:  # [B, T]
  r"""Log-linear approximation of the proximal policy's log-probs from per-token versions.

  ``α_t = clip((v_prox - v_t) / (v_θ - v_t), 0, 1)`` with ``v_θ = current_version``,
  ``v_prox = current_version - 1`` and ``v_t`` the policy version that generated token ``t``;
  ``log π_prox ≈ log π_behav + α_t (log π_θ - log π_behav)`` (geometric interpolation). Tokens with
  ``v_t < 0`` (no generation version) or ``v_t >= v_θ`` get ``α = 0``. The result is stop-gradient:
  π_prox is a fixed anchor.

  Args:
    logprobs: ``[B, T]`` log π_θ.
    old_logprobs: ``[B, T]`` log π_behav.
    versions: ``[B, T]`` int policy version per token.
    current_version: the version being trained (v_θ).

  Returns:
    ``[B, T]`` approximate log π_prox.

  References: AReaL ``prox_logp_method="loglinear"`` (docs/algorithms/prox_approx.md); seeds 000
  "AReaL" decoupled PPO.
  """
  v = jnp.asarray(versions).astype(jnp.float32)
  v_theta = jnp.asarray(current_version, jnp.float32)
  diff = v_theta - v
  gap = v_theta - 1.0 - v
  alpha = jnp.where((diff > 0) & (v >= 0), gap / jnp.where(diff > 0, diff, 1.0), 0.0)
  alpha = jnp.clip(alpha, 0.0, 1.0)
  lp = jnp.asarray(logprobs).astype(jnp.float32)
  old = jnp.asarray(old_logprobs).astype(jnp.float32)
  return jax.lax.stop_gradient(old + alpha * (lp - old))


@register_objective("decoupled_ppo")
def decoupled_ppo(*, logprobs, old_logprobs, advantages, loss_weights, prox_logprobs=None, versions=None,
                  current_version=None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                  behav_weight_cap: float | None = None, **context):
  r"""AReaL decoupled PPO: behaviour importance weight times a PPO clip around the proximal policy.

  Eq. (5): ``J = E_{π_behav}[ (π_prox/π_behav) · min(u_t A_t, clip(u_t, 1-ε, 1+ε) A_t) ]`` with
  ``u_t = π_θ/π_prox``; so ``ℓ_t = -(π_prox/π_behav)·min(u A, clip(u) A)``. The behaviour weight is
  data (stop-gradient). When ``prox_logprobs`` is omitted it is approximated from ``versions`` with
  :func:`prox_logprobs_loglinear`. With ``π_prox = π_behav`` this is exactly :func:`clip_higher`.

  Args:
    logprobs: ``[B, T]`` log π_θ.
    old_logprobs: ``[B, T]`` log π_behav (the per-token behaviour policy that sampled each token).
    advantages, loss_weights: see :func:`ppo_clip`.
    prox_logprobs: ``[B, T]`` log π_prox (recomputed with the parameters before this update).
    versions: ``[B, T]`` int per-token versions (used when ``prox_logprobs`` is None).
    current_version: version of π_θ (used with ``versions``).
    epsilon_low, epsilon_high: clip range around π_prox.
    behav_weight_cap: if set, tokens with ``π_prox/π_behav > cap`` get weight 0 (AReaL
      ``behave_imp_weight_cap``, token-mask mode).
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; extra metrics ``behav_weight_mean`` and ``behav_weight_capped_frac``;
    ratio metrics refer to ``u = π_θ/π_prox``.

  References: Fu et al. 2025, "AReaL" eq. 4–5 (seeds 000 "AReaL", Decoupled PPO Objective); Hilton
  et al. 2022, "Batch size-invariance for policy optimization".
  """
  _check_context("decoupled_ppo", context)
  _check_eps("decoupled_ppo", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  if prox_logprobs is None:
    if versions is None or current_version is None:
      raise ValueError("decoupled_ppo: pass prox_logprobs, or versions and current_version to approximate it")
    prox_logprobs = prox_logprobs_loglinear(inp.lp, inp.old, versions, current_version=current_version)
  prox = inp._data(prox_logprobs)
  behav_weight = jnp.exp(jnp.clip(prox - inp.old, -MAX_LOG_RATIO, MAX_LOG_RATIO))
  capped = jnp.zeros_like(inp.valid)
  if behav_weight_cap is not None:
    capped = behav_weight > behav_weight_cap
    behav_weight = jnp.where(capped, 0.0, behav_weight)
  log_u = inp.log_ratio(prox)
  u = jnp.exp(log_u)
  per_token, low, high = _clipped_surrogate(u, inp.adv, 1.0 - epsilon_low, 1.0 + epsilon_high)
  metrics = inp.metrics(u, log_u, clipped_low=low, clipped_high=high, behav_weight_mean=behav_weight,
                        behav_weight_capped_frac=capped)
  return inp.loss(behav_weight * per_token), metrics
