"""Policy objectives whose per-token loss depends on other tokens of the call: sequence-level ratios
and covariance-selected tokens.

Holds ``gspo`` (GSPO eq. 5–7, 10–11: clip ``s_i = exp(mean_t log r_{i,t})``, token form
``sg(s_i) · π_θ/sg(π_θ)``), ``gmpo`` (GMPO eq. 3: ``-A · exp(mean_t sgn(A)·min(sgn(A) log r,
sgn(A) clip(log r, -ε_low, ε_high)))``), ``clip_cov`` and ``kl_cov`` (notes 003 §Entropy Mechanism;
Cui et al. 2025 §4: ``Cov_t = (log π - mean log π)(A - mean A)``, PPO loss zeroed on, or
``β |log r|`` added to, ``k = max(1, ⌊ρN⌋)`` selected tokens). Sequence means follow
``response_mask`` / ``segment_ids``; the covariance statistics are per call, so ``clip_cov`` and
``kl_cov`` are not split-invariant. The shared signature is in :mod:`jaxrl.losses._policy`; see
docs/losses.md, "Policy objectives".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._aggregate import sequence_mean
from jaxrl.losses._pg_base import (
    MAX_LOG_RATIO,
    _check_context,
    _check_eps,
    _clipped_surrogate,
    _Inputs,
    _ppo,
    register_objective,
)

__all__ = ["clip_cov", "gmpo", "gspo", "kl_cov"]


# --------------------------------------------------------------------------------------------------
# Sequence-level ratios.


@register_objective("gspo")
def gspo(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 3e-4,
         epsilon_high: float = 4e-4, **context):
  r"""GSPO (token form): clip the length-normalised sequence ratio instead of token ratios.

  ``s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|} = exp(1/|y_i| Σ_t log r_{i,t})``; token form
  ``s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]`` (value ``s_i``, gradient ``s_i ∇log π_θ``);
  ``ℓ_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1-ε_low, 1+ε_high) A_t)``. With ``seq_mean_token_mean``
  weights and a per-sequence advantage this equals sequence-level GSPO
  ``-1/G Σ_i min(s_i A_i, clip(s_i) A_i)``.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    epsilon_low, epsilon_high: clip range of ``s`` (paper: 3e-4 / 4e-4).
    **context: ``response_mask`` / ``segment_ids`` define the sequences (default ``loss_weights != 0``, rows).

  Returns:
    ``(loss, metrics)``; ratio metrics refer to ``s``.

  References: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071) eq. 5–7, 10–11.
  """
  _check_context("gspo", context)
  _check_eps("gspo", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  seq_log_ratio = sequence_mean(jax.lax.stop_gradient(inp.lp - inp.old), inp.mask, inp.segment_ids)
  log_s = jnp.clip(seq_log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO) + inp.lp - jax.lax.stop_gradient(inp.lp)
  s = jnp.exp(log_s)
  per_token, low, high = _clipped_surrogate(s, inp.adv, 1.0 - epsilon_low, 1.0 + epsilon_high)
  return inp.loss(per_token), inp.metrics(s, log_s, clipped_low=low, clipped_high=high)


@register_objective("gmpo")
def gmpo(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 0.4,
         epsilon_high: float = 0.4, **context):
  r"""GMPO: maximise the geometric mean of token-level clipped ratios of each sequence.

  ``J = 1/G Σ_i (Π_t min(r_{i,t} A_i, clip(r_{i,t}, e^{-ε_low}, e^{ε_high}) A_i)^{1/|o_i|})`` computed
  in log space: ``ρ̃_t = sgn(A)·min(sgn(A) log r_t, sgn(A) clip(log r_t, -ε_low, ε_high))``,
  ``R_i = exp(1/|o_i| Σ_t ρ̃_t)``, ``ℓ_t = -A_t R_i``. With ``seq_mean_token_mean`` weights and a
  per-sequence advantage the loss is ``-1/G Σ_i A_i R_i``. Clipped tokens have zero gradient.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    epsilon_low, epsilon_high: clip range in log space (paper: 0.4, i.e. ``(e^{-0.4}, e^{0.4})``).
    **context: ``response_mask`` / ``segment_ids`` define the sequences.

  Returns:
    ``(loss, metrics)``; ratio metrics refer to token ratios ``r_t``.

  References: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673) eq. 3 and
  its reference implementation (verl ``geo_mean``).
  """
  _check_context("gmpo", context)
  _check_eps("gmpo", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  sgn = jnp.sign(inp.adv)
  clipped = jnp.clip(log_ratio, -epsilon_low, epsilon_high)
  log_ratio_min = sgn * jnp.minimum(sgn * log_ratio, sgn * clipped)
  seq_ratio = jnp.exp(sequence_mean(log_ratio_min, inp.mask, inp.segment_ids))
  low = (inp.adv < 0) & (log_ratio < -epsilon_low)
  high = (inp.adv > 0) & (log_ratio > epsilon_high)
  metrics = inp.metrics(jnp.exp(log_ratio), log_ratio, clipped_low=low, clipped_high=high)
  return inp.loss(-inp.adv * seq_ratio), metrics


# --------------------------------------------------------------------------------------------------
# Entropy-mechanism objectives (covariance of log-prob and advantage).


def _token_covariance(inp: _Inputs) -> jax.Array:  # [B, T]
  """``(log π - mean log π)·(A - mean A)`` with means over the call's response tokens."""
  mask = inp.mask > 0
  n = jnp.maximum(jnp.sum(mask), 1)
  lp = jax.lax.stop_gradient(inp.lp)
  mean_lp = jnp.sum(jnp.where(mask, lp, 0.0)) / n
  mean_adv = jnp.sum(jnp.where(mask, inp.adv, 0.0)) / n
  return jnp.where(mask, (lp - mean_lp) * (inp.adv - mean_adv), 0.0)


def _top_k(scores: jax.Array, eligible: jax.Array, k: jax.Array) -> jax.Array:
  """``eligible`` tokens whose descending rank of ``scores`` among eligible tokens is ``< k``."""
  flat = jnp.where(eligible, scores, -jnp.inf).reshape(-1)
  order = jnp.argsort(-flat, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  return (rank.reshape(scores.shape) < k) & eligible


def _count_k(ratio: float, n_valid: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.floor(ratio * n_valid.astype(jnp.float32)).astype(jnp.int32), 1)


@register_objective("clip_cov")
def clip_cov(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 0.2,
             epsilon_high: float = 0.2, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0,
             clip_cov_ub: float = 5.0, rng: jax.Array | None = None, **context):
  r"""Clip-Cov: detach the gradient of a few tokens with high log-prob/advantage covariance.

  ``Cov_t = (log π_θ(y_t) - mean log π)·(A_t - mean A)`` (means over the response tokens of this
  call). Among tokens the PPO clip leaves unclipped with ``lb < Cov_t < ub``, ``k = max(1,
  ⌊ratio·N⌋)`` tokens are chosen (uniformly at random with ``rng``; the largest ``Cov`` without) and
  their loss is zeroed; every other token uses the PPO clipped surrogate. High-covariance tokens
  are what drives entropy collapse; freezing them keeps entropy up.

  The covariance means and the count ``k`` are per call (per micro-batch), as in the reference
  implementation, so this objective is not split-invariant.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    epsilon_low, epsilon_high: PPO clip range.
    clip_cov_ratio: fraction of response tokens to detach (paper: 2e-4).
    clip_cov_lb, clip_cov_ub: covariance band (paper: 1, 5).
    rng: PRNG key for the random choice, or None for the deterministic top-covariance choice.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; ``metrics["cov_selected_frac"]`` is the weighted share of detached tokens.

  References: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
  Language Models" §4 (seeds 003, first entry); verl ``clip_cov``.
  """
  _check_context("clip_cov", context)
  _check_eps("clip_cov", epsilon_low=epsilon_low, epsilon_high=epsilon_high)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  per_token, ratio, log_ratio, low, high = _ppo(inp, epsilon_low, epsilon_high)
  cov = _token_covariance(inp)
  eligible = (inp.mask > 0) & ~low & ~high & (cov > clip_cov_lb) & (cov < clip_cov_ub)
  k = _count_k(clip_cov_ratio, jnp.sum(inp.mask > 0))
  priority = cov if rng is None else jax.random.uniform(rng, cov.shape)
  selected = _top_k(priority, eligible, k)
  per_token = jnp.where(selected, 0.0, per_token)
  metrics = inp.metrics(ratio, log_ratio, clipped_low=low, clipped_high=high, cov_selected_frac=selected)
  return inp.loss(per_token), metrics


@register_objective("kl_cov")
def kl_cov(*, logprobs, old_logprobs, advantages, loss_weights, kl_cov_ratio: float = 2e-4,
           ppo_kl_coef: float = 1.0, **context):
  r"""KL-Cov: add a KL penalty on the top-``k`` covariance tokens of an unclipped policy gradient.

  ``ℓ_t = -A_t r_t`` for all tokens, plus ``β·|log π_θ(y_t) - log π_old(y_t)|`` on the
  ``k = max(1, ⌊ratio·N⌋)`` tokens with the largest ``Cov_t`` (see :func:`clip_cov`). Per-call
  statistics, so not split-invariant.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`jaxrl.losses.ppo_clip`.
    kl_cov_ratio: fraction of tokens penalised (paper: 2e-3 to 2e-4).
    ppo_kl_coef: penalty coefficient β.
    **context: see :mod:`jaxrl.losses._policy`.

  Returns:
    ``(loss, metrics)``; ``metrics["cov_selected_frac"]``.

  References: Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs" §4 (seeds 003); verl
  ``kl_cov``.
  """
  _check_context("kl_cov", context)
  inp = _Inputs(logprobs, old_logprobs, advantages, loss_weights, context)
  log_ratio = inp.log_ratio()
  ratio = jnp.exp(log_ratio)
  cov = _token_covariance(inp)
  k = _count_k(kl_cov_ratio, jnp.sum(inp.mask > 0))
  selected = _top_k(cov, inp.mask > 0, k)
  per_token = -inp.adv * ratio + jnp.where(selected, ppo_kl_coef * jnp.abs(log_ratio), 0.0)
  metrics = inp.metrics(ratio, log_ratio, cov_selected_frac=selected)
  return inp.loss(per_token), metrics
