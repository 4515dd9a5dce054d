"""Policy-gradient objectives with one signature, registered by name in :data:`OBJECTIVES`.

The implementation is split by family: ``_pg_base`` (registry, context keywords, shared input views
and surrogate), ``_pg_ppo`` (PPO family), ``_pg_soft`` (plain policy gradient, soft and masked trust
regions) and ``_pg_coupled`` (sequence-level ratios, covariance-selected tokens); this module gathers
their public names.

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

from jaxrl.losses._pg_base import CONTEXT_KEYS, OBJECTIVES, register_objective
from jaxrl.losses._pg_coupled import clip_cov, gmpo, gspo, kl_cov
from jaxrl.losses._pg_ppo import clip_higher, decoupled_ppo, dual_clip, ppo_clip, prox_logprobs_loglinear
from jaxrl.losses._pg_soft import cispo, dppo_mask, gpg, reinforce_is, sapo, vanilla_pg

__all__ = [
    "CONTEXT_KEYS",
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
