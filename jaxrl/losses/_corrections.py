"""Off-policy corrections as per-token weights and masks that compose with any objective.

Each function compares a training-side policy ``π_train`` (``logprobs``: the recomputed π_old in
decoupled mode, or π_θ itself in bypass mode) with the policy that actually sampled the tokens,
``π_rollout`` (``rollout_logprobs``, e.g. the inference engine's), through ``ρ_t = π_train/π_rollout``,
and returns a ``[B, T]`` float32 stop-gradient array that is 0 off ``response_mask``. Pass weights to
an objective as ``is_weights=`` (they multiply the per-token surrogate) and 0/1 masks either the
same way or multiplied into the response mask before :func:`jaxrl.losses.loss_weights` (then masked
tokens also leave the normaliser). Products of several corrections compose.

Log-ratios (token and sequence sums) are clamped to ``[-20, 20]`` before ``exp``, as verl does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._aggregate import sequence_max, sequence_mean, sequence_sum

__all__ = [
    "DIVERGENCE_LEVELS",
    "divergence_rejection_mask",
    "icepop_weights",
    "off_policy_sequence_mask",
    "sequence_mask_weights",
    "tis_weights",
    "token_mask_weights",
]

_BOUND = 20.0

DIVERGENCE_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def _prep(logprobs, rollout_logprobs, response_mask):
  mask = jax.lax.stop_gradient(jnp.asarray(response_mask).astype(jnp.float32))
  valid = mask > 0
  lp = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(logprobs).astype(jnp.float32)), 0.0)
  ro = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(rollout_logprobs).astype(jnp.float32)), 0.0)
  return jnp.clip(lp - ro, -_BOUND, _BOUND), mask, valid  # log ρ [B, T]


def _sequence_log_ratio(log_ratio, mask, segment_ids, level):
  if level == "token":
    return log_ratio
  if level == "sequence":
    return jnp.clip(sequence_sum(log_ratio * mask, segment_ids), -_BOUND, _BOUND)
  if level == "geometric":
    return sequence_mean(log_ratio, mask, segment_ids)
  raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")


def tis_weights(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    cap: float = 2.0,
    level: str = "token",
    segment_ids: jax.Array | None = None,  # [B, T]
) -> jax.Array:  # [B, T]
  r"""Truncated importance sampling weights ``min(ρ, C)``.

  ``token``: ``w_t = min(ρ_t, C)``; ``sequence``: ``w = min(Π_t ρ_t, C) = min(exp Σ_t log ρ_t, C)``
  broadcast to the sequence's tokens; ``geometric``: ``w = min(exp(1/|T| Σ_t log ρ_t), C)``.

  Args:
    logprobs: ``[B, T]`` log π_train.
    rollout_logprobs: ``[B, T]`` log π_rollout.
    response_mask: ``[B, T]``.
    cap: truncation ``C``.
    level: ``"token"``, ``"sequence"`` or ``"geometric"``.
    segment_ids: ``[B, T]`` packed rows (sequence levels).

  Returns:
    ``[B, T]`` weights, 0 off the mask.

  References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (TIS); verl rollout correction (docs/algo/rollout_corr_math.md §3.3).
  """
  log_ratio, mask, _ = _prep(logprobs, rollout_logprobs, response_mask)
  lr = _sequence_log_ratio(log_ratio, mask, segment_ids, level)
  return jnp.minimum(jnp.exp(lr), cap) * mask


def token_mask_weights(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    upper: float = 2.0,
    lower: float = 0.0,
) -> jax.Array:  # [B, T]
  r"""Masked IS at token level: ``w_t = ρ_t · 1[lower ≤ ρ_t ≤ upper]``.

  Tokens whose ratio leaves the band lose their gradient entirely (instead of being truncated).

  Args:
    logprobs, rollout_logprobs, response_mask: see :func:`tis_weights`.
    upper: upper ratio bound.
    lower: lower ratio bound (0: one-sided, TRL ``token_mask``).

  Returns:
    ``[B, T]`` weights.

  References: TRL ``vllm_importance_sampling_mode="token_mask"``; Liu, Li et al. 2025, "When Speed
  Kills Stability" (masked IS).
  """
  log_ratio, mask, _ = _prep(logprobs, rollout_logprobs, response_mask)
  ratio = jnp.exp(log_ratio)
  return jnp.where((ratio >= lower) & (ratio <= upper), ratio, 0.0) * mask


def icepop_weights(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    lower: float = 0.5,
    upper: float = 5.0,
) -> jax.Array:  # [B, T]
  r"""IcePop: ``M(ρ_t) = ρ_t`` if ``α ≤ ρ_t ≤ β`` else 0 (two-sided masked token IS).

  ``J = E[Σ_t M(π_train/π_infer; α, β) · min(r_t A_t, clip(r_t) A_t)]``, defaults ``α = 0.5``,
  ``β = 5``.

  Args:
    logprobs, rollout_logprobs, response_mask: see :func:`tis_weights`.
    lower, upper: α and β.

  Returns:
    ``[B, T]`` weights.

  References: Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model"
  (IcePop).
  """
  return token_mask_weights(logprobs, rollout_logprobs, response_mask, upper=upper, lower=lower)


def sequence_mask_weights(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    upper: float = 2.0,
    lower: float = 0.0,
    level: str = "sequence",
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # [B, T]
  r"""Masked IS at sequence level: ``w = ρ_seq · 1[lower ≤ ρ_seq ≤ upper]`` on every token.

  ``ρ_seq = Π_t ρ_t`` (``level="sequence"``) or ``(Π_t ρ_t)^{1/|T|}`` (``level="geometric"``).

  Args:
    logprobs, rollout_logprobs, response_mask, segment_ids: see :func:`tis_weights`.
    upper, lower: bounds on ``ρ_seq``.
    level: ``"sequence"`` or ``"geometric"``.

  Returns:
    ``[B, T]`` weights.

  References: TRL ``vllm_importance_sampling_mode="sequence_mask"``; verl Seq-MIS.
  """
  if level not in ("sequence", "geometric"):
    raise ValueError(f"sequence_mask_weights: level must be 'sequence' or 'geometric', got {level!r}")
  log_ratio, mask, _ = _prep(logprobs, rollout_logprobs, response_mask)
  ratio = jnp.exp(_sequence_log_ratio(log_ratio, mask, segment_ids, level))
  return jnp.where((ratio >= lower) & (ratio <= upper), ratio, 0.0) * mask


def divergence_rejection_mask(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    estimator: str = "k3",
    level: str = "seq_mean",
    upper: float,
    lower: float | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # [B, T] 0/1
  r"""Rejection sampling by a divergence estimate between π_rollout and π_train.

  Per token, with ``x = log ρ_t``: ``k1 = -x``, ``k2 = x²/2``, ``k3 = e^x - 1 - x`` (``E_rollout[k3] =
  KL(π_rollout‖π_train)``). The statistic is the token value (``token``) or its sum, mean or max over
  the sequence (``seq_sum``, ``seq_mean``, ``seq_max``); a token (or whole sequence) is kept iff
  ``lower ≤ stat ≤ upper`` (``lower`` defaults to no bound; k1 is signed, so it usually needs both).

  Args:
    logprobs, rollout_logprobs, response_mask, segment_ids: see :func:`tis_weights`.
    estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
    level: one of :data:`DIVERGENCE_LEVELS`.
    upper: upper bound on the statistic.
    lower: optional lower bound.

  Returns:
    ``[B, T]`` 0/1 keep mask (0 off the response mask).

  References: verl ``rollout_rs`` options ``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``,
  ``seq_max_k*`` (rollout_corr_helper.compute_rollout_rejection_mask); Schulman 2020, "Approximating
  KL Divergence" (k1/k2/k3).
  """
  if level not in DIVERGENCE_LEVELS:
    raise ValueError(f"divergence_rejection_mask: level must be one of {DIVERGENCE_LEVELS}, got {level!r}")
  x, mask, valid = _prep(logprobs, rollout_logprobs, response_mask)
  if estimator == "k1":
    stat = -x
  elif estimator == "k2":
    stat = 0.5 * x * x
  elif estimator == "k3":
    stat = jnp.expm1(x) - x
  else:
    raise ValueError(f"divergence_rejection_mask: estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
  if level == "seq_sum":
    stat = sequence_sum(stat * mask, segment_ids)
  elif level == "seq_mean":
    stat = sequence_mean(stat, mask, segment_ids)
  elif level == "seq_max":
    stat = sequence_max(stat, mask, segment_ids)
  keep = stat <= upper
  if lower is not None:
    keep &= stat >= lower
  return jnp.where(valid & keep, 1.0, 0.0)


def off_policy_sequence_mask(
    logprobs: jax.Array,  # [B, T]
    rollout_logprobs: jax.Array,  # [B, T]
    advantages: jax.Array,  # [B, T] or [B]
    response_mask: jax.Array,  # [B, T]
    *,
    threshold: float = 0.5,
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # [B, T] 0/1
  r"""Off-policy sequence masking: drop negative-advantage sequences that drifted too far.

  ``M_{i,t} = 0`` if ``Â_{i,t} < 0`` and ``1/|o_i| Σ_t log(π_rollout(o_{i,t}) / π_train(o_{i,t})) > δ``,
  else 1.

  Args:
    logprobs: ``[B, T]`` log π_train (usually the current policy, detached).
    rollout_logprobs: ``[B, T]`` log π of the sampler.
    advantages: ``[B, T]`` or ``[B]``.
    response_mask, segment_ids: see :func:`tis_weights`.
    threshold: δ (TRL suggests 0.5 as a starting point).

  Returns:
    ``[B, T]`` 0/1 keep mask.

  References: DeepSeek-AI 2025, "DeepSeek-V3.2" (off-policy sequence masking); TRL
  ``GRPOConfig.off_policy_mask_threshold`` / ``get_off_policy_mask``.
  """
  x, mask, valid = _prep(logprobs, rollout_logprobs, response_mask)
  seq_kl = sequence_mean(-x, mask, segment_ids)
  adv = jnp.asarray(advantages).astype(jnp.float32)
  if adv.ndim == 1:
    adv = adv[:, None]
  adv = jnp.broadcast_to(jax.lax.stop_gradient(adv), x.shape)
  keep = (adv >= 0) | (seq_kl <= threshold)
  return jnp.where(valid & keep, 1.0, 0.0)
