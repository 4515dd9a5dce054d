"""Policy objectives without a hard clip of the ratio surrogate: plain policy gradient and soft or
masked trust regions.

Holds ``vanilla_pg`` (REINFORCE, ``-A log π_θ``), ``reinforce_is`` (``-A r``, truncated IS
``-A min(r, C)``), ``gpg`` (GPG eq. 5–6, ``-A log π_θ``; α is the ``gpg`` advantage's), ``cispo``
(MiniMax-M1 eq. 4–5, ``-sg(clip(r, 1-ε_low, 1+ε_high)) A log π_θ``), ``sapo`` (``-A (4/τ) σ(τ(r-1))``)
and ``dppo_mask`` (``-A sg(min(r, C)) log π_θ · M`` with a binary-TV / binary-KL keep mask). The
shared signature and context keywords are in :mod:`jaxrl.losses._policy`; see docs/losses.md,
"Policy objectives".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._pg_base import _check_context, _check_eps, _Inputs, register_objective

__all__ = ["cispo", "dppo_mask", "gpg", "reinforce_is", "sapo", "vanilla_pg"]


# --------------------------------------------------------------------------------------------------
# Policy gradient without a trust region.


@register_objective("vanilla_pg")
def vanilla_pg(*, logprobs, old_logprobs, advantages, loss_weights, **context):
  r"""On-policy REINFORCE: ``ℓ_t = -A_t · log π_θ(y_t)``.

  The gradient is ``-A ∇log π_θ``; ``old_logprobs`` only feeds the ratio metrics.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``.

  References: Williams 1992, "Simple statistical gradient-following algorithms".
  """
  _check_context("vanilla_pg", context)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  return inp.loss(-inp.adv * inp.lp), inp.metrics(jnp.exp(log_ratio), log_ratio)


@register_objective("reinforce_is")
def reinforce_is(*, logprobs, old_logprobs, advantages, loss_weights, ratio_cap: float | None = None,
                 **context):
  r"""Off-policy REINFORCE with a (optionally truncated) importance ratio.

  ``ℓ_t = -A_t · r_t`` with ``r_t = π_θ/π_old`` (gradient ``-A r ∇log π_θ``). With ``ratio_cap = C``
  the weight is truncated: ``ℓ_t = -A_t · sg(min(r_t, C)/r_t) · r_t``, value ``-A min(r, C)`` and
  gradient ``-A min(r, C) ∇log π_θ`` (truncated IS, every token keeps a gradient).

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    ratio_cap: truncation ``C`` of the IS weight, or None.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; ``clip_frac_high`` counts truncated tokens.

  References: Precup et al. 2000 (off-policy IS); verl rollout correction ``pg_is``
  (docs/algo/rollout_corr_math.md §1.1, §3.2.2).
  """
  _check_context("reinforce_is", context)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  high = jnp.zeros_like(inp.valid)
  weight = ratio
  if ratio_cap is not None:
    high = ratio > ratio_cap
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, ratio_cap) / ratio) * ratio
  return inp.loss(-inp.adv * weight), inp.metrics(ratio, log_ratio, clipped_high=high)


@register_objective("gpg")
def gpg(*, logprobs, old_logprobs, advantages, loss_weights, **context):
  r"""Group Policy Gradient objective: the plain policy gradient ``ℓ_t = -A_t log π_θ(y_t)``.

  GPG's ``J = 1/Σ|o_i| Σ_i Σ_t Â_{i,t} log π_θ(o_{i,t})`` with ``Â = α (R - R̄)``. The rescaling
  ``α = B / (B - M)`` (``M``: samples of zero-variance groups) needs the group structure of the
  global batch, so it is applied once, by the ``gpg`` advantage estimator
  (:func:`jaxrl.losses.gpg_advantage`, metric ``gpg_alpha``); this objective takes the advantages as
  they are and applies no α of its own. The ``1/Σ|o_i|`` normaliser is ``token_mean`` aggregation.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip` (``old_logprobs`` only
      feeds the ratio metrics).
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``.

  References: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
  Reasoning" (arXiv:2504.02546), eq. 5–6.
  """
  _check_context("gpg", context)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  return inp.loss(-inp.adv * inp.lp), inp.metrics(jnp.exp(log_ratio), log_ratio)


# --------------------------------------------------------------------------------------------------
# Soft / masked trust regions.


@register_objective("cispo")
def cispo(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 1.0,
          epsilon_high: float = 4.0, **context):
  r"""CISPO: clip the importance-sampling weight (stop-gradient), never drop a token's gradient.

  ``J = E[Σ_t sg(r̂_t) Â_t log π_θ(y_t)]`` with ``r̂_t = clip(r_t, 1-ε_low, 1+ε_high)``;
  ``ℓ_t = -sg(r̂_t) A_t log π_θ(y_t)``. The defaults impose no lower bound (``ε_low = 1``, as
  MiniMax-M1) and cap the weight at 5.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    epsilon_low, epsilon_high: IS-weight clip range.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; clip fractions count tokens whose weight was clipped.

  References: MiniMax 2025, "MiniMax-M1" §3.1 eq. 4–5.
  """
  _check_context("cispo", context)
  _check_eps("cispo", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
  low = ratio < 1.0 - epsilon_low
  high = ratio > 1.0 + epsilon_high
  metrics = inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high)
  return inp.loss(-weight * inp.adv * inp.lp), metrics


@register_objective("sapo")
def sapo(*, logprobs, old_logprobs, advantages, loss_weights, tau_pos: float = 1.0, tau_neg: float = 1.05,
         **context):
  r"""SAPO: replace the hard clip by a temperature-controlled sigmoid gate.

  ``f(r) = σ(τ (r - 1)) · 4/τ`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``;
  ``ℓ_t = -f(r_t) A_t``. ``∂f/∂log π_θ = 4 σ(1-σ) r``, equal to 1 at ``r = 1`` and decaying smoothly
  as the ratio leaves the trust region.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    tau_pos, tau_neg: gate temperatures (``τ_neg > τ_pos`` damps negative updates faster).
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; ``metrics["gate_grad_mean"]`` is Σ w·4σ(1-σ) r.

  References: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347); TRL defaults
  ``sapo_temperature_pos=1.0``, ``sapo_temperature_neg=1.05``.
  """
  _check_context("sapo", context)
  if tau_pos <= 0 or tau_neg <= 0:
    raise ValueError(f"sapo: temperatures must be > 0, got tau_pos={tau_pos!r}, tau_neg={tau_neg!r}")
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  tau = jnp.where(inp.adv > 0, tau_pos, tau_neg)
  sig = jax.nn.sigmoid(tau * (ratio - 1.0))
  gate = sig * 4.0 / tau
  metrics = inp.metrics(ratio, log_ratio, gate_grad_mean=4.0 * sig * (1.0 - sig) * ratio)
  return inp.loss(-gate * inp.adv), metrics


@register_objective("dppo_mask")
def dppo_mask(*, logprobs, old_logprobs, advantages, loss_weights, divergence: str = "binary_tv",
              delta_low: float | None = None, delta_high: float | None = None, ratio_cap: float = 20.0,
              **context):
  r"""DPPO: keep a token unless its probability moved too far in the advantage's direction.

  Binary-TV keep mask: ``A > 0``: ``π_θ - π_old ≤ δ_high``; ``A ≤ 0``: ``π_θ - π_old ≥ -δ_low``.
  Binary-KL: ``D = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p))``; ``A > 0`` keeps
  ``D ≤ δ_high or p ≤ p_old``; ``A ≤ 0`` keeps ``D ≤ δ_low or p ≥ p_old``. Loss
  ``ℓ_t = -A_t · sg(min(r_t, C)) · log π_θ(y_t) · M_t`` (masked tokens have zero gradient).

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    divergence: ``"binary_tv"`` or ``"binary_kl"``.
    delta_low, delta_high: thresholds (default 0.15 for TV, 0.05 for KL, as the paper recommends).
    ratio_cap: truncation ``C`` of the stop-gradient IS ratio.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; clip fractions count masked tokens by advantage sign.

  References: "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv:2602.04879); verl
  ``dppo_tv`` / ``dppo_kl``; TRL ``DPPOConfig`` defaults.
  """
  _check_context("dppo_mask", context)
  if divergence not in ("binary_tv", "binary_kl"):
    raise ValueError(f"dppo_mask: divergence must be 'binary_tv' or 'binary_kl', got {divergence!r}")
  default = 0.15 if divergence == "binary_tv" else 0.05
  delta_low = default if delta_low is None else delta_low
  delta_high = default if delta_high is None else delta_high
  _check_eps("dppo_mask", delta_low=delta_low, delta_high=delta_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  p = jax.lax.stop_gradient(jnp.exp(inp.lp))
  p_old = jnp.exp(inp.old)
  if divergence == "binary_tv":
    keep_pos = (p - p_old) <= delta_high
    keep_neg = (p - p_old) >= -delta_low
  else:
    eps = 1e-8
    d = p_old * (inp.old - jax.lax.stop_gradient(inp.lp)) + (1.0 - p_old) * jnp.log(
        (1.0 - p_old + eps) / (1.0 - p + eps))
    keep_pos = (d <= delta_high) | (p <= p_old)
    keep_neg = (d <= delta_low) | (p >= p_old)
  keep = jnp.where(inp.adv > 0, keep_pos, keep_neg)
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, ratio_cap))
  per_token = jnp.where(keep, -inp.adv * weight * inp.lp, 0.0)
  low = (inp.adv < 0) & ~keep
  high = (inp.adv > 0) & ~keep
  return inp.loss(per_token), inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high)
