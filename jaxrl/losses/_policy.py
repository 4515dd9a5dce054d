"""Policy-gradient objectives with one signature, registered by name in :data:`OBJECTIVES`.

Every objective is called as::

  loss, metrics = OBJECTIVES[name](
      logprobs=lp,            # [B, T] log π_θ(y_t), differentiable
      old_logprobs=old,       # [B, T] log π_old(y_t) (behaviour / rollout policy), data
      advantages=adv,         # [B, T] (or [B]) advantages, data
      loss_weights=w,         # [B, T] from :func:`jaxrl.losses.loss_weights` (mask · 1/normaliser)
      **options)

and returns ``loss = Σ_{b,t} w·is_weights·ℓ_t`` (float32 scalar) and a metrics dict. The per-token
surrogate ``ℓ_t`` is the *negated* objective (losses are minimised). Tokens with ``w == 0`` never
contribute, even when their inputs are NaN/inf. Metrics are weighted sums ``Σ w·m_t`` too, so they
add up across micro-batches and devices exactly like the loss (they are means when ``Σ w = 1``, e.g.
``token_mean``); ``weight_sum = Σ w`` is reported so a caller can renormalise; ``ratio_min`` and
``ratio_max`` are plain masked min/max (0 for an empty mask).

Context keyword arguments accepted by every objective (ignored where the objective has no use for
them): ``is_weights`` ([B, T] multiplicative per-token weights from :mod:`jaxrl.losses._corrections`,
stop-gradient: TIS, IcePop, masks), ``response_mask`` ([B, T]; default ``loss_weights != 0``; used for
sequence-level ratios and covariance statistics), ``segment_ids`` ([B, T] packed rows), ``entropy``
([B, T], reported as a metric), ``prox_logprobs``, ``versions``, ``current_version``, ``ref_logprobs``
and ``rng``. Unknown keywords raise ``TypeError``.

Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (as verl does), so ratios stay finite for
logprob differences of any size; beyond that clamp the ratio has zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.losses._aggregate import sequence_mean

__all__ = [
    "OBJECTIVES",
    "clip_cov",
    "clip_higher",
    "cispo",
    "decoupled_ppo",
    "dppo_mask",
    "dual_clip",
    "gmpo",
    "gpg",
    "gspo",
    "kl_cov",
    "ppo_clip",
    "prox_logprobs_loglinear",
    "register_objective",
    "reinforce_is",
    "sapo",
    "vanilla_pg",
]

Objective = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]

OBJECTIVES: dict[str, Objective] = {}
"""Policy objectives by name; all share the keyword-only signature in this module's docstring."""

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


# --------------------------------------------------------------------------------------------------
# PPO family.


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
    **context: see the module docstring.

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
    **context: see the module docstring.

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
    **context: see the module docstring.

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
    **context: see the module docstring.

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


# --------------------------------------------------------------------------------------------------
# Policy gradient without a trust region.


@register_objective("vanilla_pg")
def vanilla_pg(*, logprobs, old_logprobs, advantages, loss_weights, **context):
  r"""On-policy REINFORCE: ``ℓ_t = -A_t · log π_θ(y_t)``.

  The gradient is ``-A ∇log π_θ``; ``old_logprobs`` only feeds the ratio metrics.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    ratio_cap: truncation ``C`` of the IS weight, or None.
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip` (``old_logprobs`` only
      feeds the ratio metrics).
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
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
# Soft / masked trust regions.


@register_objective("cispo")
def cispo(*, logprobs, old_logprobs, advantages, loss_weights, epsilon_low: float = 1.0,
          epsilon_high: float = 4.0, **context):
  r"""CISPO: clip the importance-sampling weight (stop-gradient), never drop a token's gradient.

  ``J = E[Σ_t sg(r̂_t) Â_t log π_θ(y_t)]`` with ``r̂_t = clip(r_t, 1-ε_low, 1+ε_high)``;
  ``ℓ_t = -sg(r̂_t) A_t log π_θ(y_t)``. The defaults impose no lower bound (``ε_low = 1``, as
  MiniMax-M1) and cap the weight at 5.

  Args:
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    epsilon_low, epsilon_high: IS-weight clip range.
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    tau_pos, tau_neg: gate temperatures (``τ_neg > τ_pos`` damps negative updates faster).
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    divergence: ``"binary_tv"`` or ``"binary_kl"``.
    delta_low, delta_high: thresholds (default 0.15 for TV, 0.05 for KL, as the paper recommends).
    ratio_cap: truncation ``C`` of the stop-gradient IS ratio.
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    epsilon_low, epsilon_high: PPO clip range.
    clip_cov_ratio: fraction of response tokens to detach (paper: 2e-4).
    clip_cov_lb, clip_cov_ub: covariance band (paper: 1, 5).
    rng: PRNG key for the random choice, or None for the deterministic top-covariance choice.
    **context: see the module docstring.

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
    logprobs, old_logprobs, advantages, loss_weights: see :func:`ppo_clip`.
    kl_cov_ratio: fraction of tokens penalised (paper: 2e-3 to 2e-4).
    ppo_kl_coef: penalty coefficient β.
    **context: see the module docstring.

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
