"""Group-baselined advantage estimators (GRPO family): GRPO, Dr.GRPO, RLOO, OPO, GPG, Pass@k
training, MaxRL, and ReMax's greedy baseline. Conventions: :mod:`jaxrl.losses._advantages`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._adv_base import (
    Metrics,
    _F32,
    _degenerate_fraction,
    _finish,
    _group_stats,
    _grpo_sequence,
    _make_groups,
    _psum,
    _rewards,
    _safe_div,
    register_advantage,
)


# ----------------------------------------------------------------------------------------------------
# GRPO family (sequence-level, group baselines).


@register_advantage("grpo")
def grpo(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    std_normalize: bool = True,
    mean_level: str = "group",
    std_level: str = "group",
    eps: float = 1e-6,
    unbiased_std: bool = False,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""GRPO group-normalised advantage, broadcast over each response's tokens.

  .. math::

      A_i = \frac{R_i - \operatorname{mean}(\{R_j\}_{j=1}^G)}{\operatorname{std}(\{R_j\}_{j=1}^G) + \epsilon}

  as written in the notes for AlignXplore (eq. 12) and ARPO; DeepCoder's GRPO+ keeps this
  advantage (its changes — no entropy/KL loss, overlong filtering, clip-high — live in the loss and
  the mask; overlong filtering = zero the truncated rows of ``response_mask`` and pass a
  ``sample_mask`` that keeps them in the baseline). ``std_normalize=False`` is Dr.GRPO
  (``A_i = R_i - mean``). ``mean_level``/``std_level`` choose where each statistic is taken, like
  AReaL's ``NormConfig``: ``"group"`` (responses of the same prompt), ``"batch"`` (every valid
  response of the global batch), ``"none"`` (mean 0 / std 1). The std at a level is always taken
  around that level's own mean.

  Args:
    rewards: ``[B]`` scalar reward per response.
    group_ids: ``[B]`` int prompt/group id in ``[0, num_groups)``.
    response_mask: ``[B, T]`` 1 on loss tokens.
    std_normalize: divide by the std (False: Dr.GRPO, ``std_level`` ignored).
    mean_level: ``"group" | "batch" | "none"``.
    std_level: ``"group" | "batch" | "none"``.
    eps: added to the std.
    unbiased_std: use the ddof-1 std (verl/TRL use ``torch.std``) instead of the population std.
    num_groups: static number of group segments (default ``B``).
    sample_mask: ``[B]`` responses that count in the statistics (default: non-empty mask).
    axis_name: data-parallel mesh axis inside ``shard_map``.

  Returns:
    ``(advantages [B, T] float32, metrics)``; degenerate groups (one member, or equal rewards) get 0.

  Example::

      adv, _ = grpo(rewards=jnp.array([1., 0., 0., 1.]), group_ids=jnp.zeros(4, int),
                    response_mask=jnp.ones((4, 3)), eps=0.0)   # rows: +1, -1, -1, +1

  References:
    Shao et al. 2024 (DeepSeekMath); notes 000 §AlignXplore (~2418), §ARPO (~1752), §DeepCoder
    (~742); Liu et al. 2025 (Dr.GRPO); AReaL NormConfig (notes 000 §AReaL, ~986).
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  adv, gs = _grpo_sequence(
      r, groups, std_normalize=std_normalize, mean_level=mean_level, std_level=std_level, eps=eps,
      unbiased_std=unbiased_std)
  extra = {} if gs is None else {"degenerate_group_fraction": _degenerate_fraction(gs)}
  return _finish(adv, response_mask, axis_name, **extra)


@register_advantage("dr_grpo")
def dr_grpo(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""Dr.GRPO advantage :math:`A_i = R_i - \operatorname{mean}_{j \in g(i)} R_j` (no std division).

  Same as ``grpo(std_normalize=False)``; registered separately so configs can name it.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective".
  """
  return grpo(rewards=rewards, group_ids=group_ids, response_mask=response_mask, std_normalize=False,
              num_groups=num_groups, sample_mask=sample_mask, axis_name=axis_name)


@register_advantage("rloo")
def rloo(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""REINFORCE leave-one-out: each response's baseline is the mean of the *other* group members.

  .. math::

      A_i = R_i - \frac{1}{n-1}\sum_{j \ne i} R_j = \frac{n}{n-1}\,(R_i - \bar R)

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``; groups of size 1 or with equal rewards get 0.

  References:
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs"; Kool et al. 2019.
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  gs = _group_stats(r, groups)
  n = groups.gather(gs.count)
  total = groups.gather(groups.sum(r))
  adv = r - _safe_div(total - r, n - 1.0)
  adv = jnp.where(groups.gather(gs.degenerate) | ~groups.valid, 0.0, adv)
  return _finish(adv, response_mask, axis_name, degenerate_group_fraction=_degenerate_fraction(gs))


@register_advantage("opo")
def opo(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    lengths: jax.Array | None = None,  # [B]
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""OPO: group baseline weighted by response length (the variance-optimal baseline for token sums).

  .. math::

      b_g = \frac{\sum_{i \in g} l_i R_i}{\sum_{i \in g} l_i}, \qquad A_i = R_i - b_{g(i)}

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    lengths: ``[B]`` response lengths ``l_i`` (default: number of valid tokens in ``response_mask``).
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``; degenerate groups get 0.

  References:
    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (OPO).
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  if lengths is None:
    lengths = (response_mask > 0).sum(axis=-1)
  gs = _group_stats(r, groups, weights=jnp.asarray(lengths).astype(_F32))
  adv = r - groups.gather(gs.mean)
  adv = jnp.where(groups.gather(gs.degenerate) | ~groups.valid, 0.0, adv)
  return _finish(adv, response_mask, axis_name, degenerate_group_fraction=_degenerate_fraction(gs))


@register_advantage("gpg")
def gpg(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    std_normalize: bool = False,
    min_valid_ratio: float = 0.05,
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""GPG: group-mean baseline without std, rescaled by the inverse fraction of informative samples.

  .. math::

      A_i = \alpha\,(R_i - \bar R_{g(i)}), \qquad
      \alpha = \frac{B}{B - M} = \frac{1}{\max(1 - M/B,\ \rho_{\min})}

  ``B`` is the number of valid responses in the global batch and ``M`` the number of them in
  degenerate groups (all rewards equal: zero advantage, no gradient), so the loss averaged over the
  batch is not shrunk by uninformative groups ("accurate gradient estimation"). ``ρ_min`` caps α as
  the authors' code does (``1 / max(1 - ratio, 0.05)``). ``std_normalize=True`` divides by the group
  std as the code's ``scale_rewards`` option.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    std_normalize: also divide by the group std (off in the paper's main setting).
    min_valid_ratio: lower bound ``ρ_min`` on ``1 - M/B``.
    eps: added to the std when ``std_normalize``.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)`` with ``metrics["gpg_alpha"]``.

  References:
    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (arXiv 2504.02546) and its code (``open-r1/src/open_r1/gpg_trainer.py``, ``adjust_gd``).
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  adv, gs = _grpo_sequence(r, groups, std_normalize=std_normalize, mean_level="group",
                           std_level="group", eps=eps, unbiased_std=False)
  valid = groups.valid.astype(_F32)
  n = _psum(valid.sum(), axis_name)
  m = _psum((valid * groups.gather(gs.degenerate)).sum(), axis_name)
  alpha = 1.0 / jnp.maximum(1.0 - _safe_div(m, n), min_valid_ratio)
  return _finish(alpha * adv, response_mask, axis_name, gpg_alpha=alpha,
                 degenerate_group_fraction=_degenerate_fraction(gs))


def _falling_ratio(a, b, m: int):
  """Π_{i<m} max(a - i, 0) / (b - i): C(a, m) / C(b, m) for integers a <= b (0 where b - i <= 0)."""
  out = jnp.ones_like(a)
  for i in range(m):  # m is the static k, not a loop over groups
    out = out * _safe_div(jnp.maximum(a - i, 0.0), b - i)
  return out


@register_advantage("grpo_passk")
def grpo_passk(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    k: int,
    threshold: float = 0.0,
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""Pass@k training: analytic group advantages of the pass@k reward over all k-subsets of a group.

  With ``N`` responses in the group of which ``N_neg`` are wrong (``R_i <= threshold``):

  .. math::

      \bar R = 1 - \frac{\binom{N_{neg}}{k}}{\binom{N}{k}},\quad
      \sigma = \sqrt{\bar R (1 - \bar R)},\quad
      \hat A_{pos} = \frac{1 - \bar R}{\sigma + \epsilon},\quad
      \hat A_{neg} = \frac{1 - \bar R - \binom{N_{neg}-1}{k-1} / \binom{N-1}{k-1}}{\sigma + \epsilon}

  ``k = 1`` recovers GRPO with population std on binary rewards. Groups with ``N < k`` or
  ``σ = 0`` get 0.

  Args:
    rewards: ``[B]`` (binarised by ``R_i > threshold``). group_ids: ``[B]`` int.
    response_mask: ``[B, T]``.
    k: static pass@k size, ``k >= 1``.
    threshold: a response is correct iff its reward is above this.
    eps: added to ``σ``.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)`` with ``metrics["passk_mean"]`` (mean group ``R̄``).

  References:
    Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large
    Reasoning Models" (arXiv 2508.10751), analytical derivation (eqs. 14–15).
  """
  k = int(k)
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  correct = r > threshold
  n = groups.sum(jnp.ones_like(r))  # [G]
  n_neg = n - groups.sum(correct.astype(_F32))  # [G]
  mean = 1.0 - _falling_ratio(n_neg, n, k)  # [G]
  sigma = jnp.sqrt(jnp.maximum(mean * (1.0 - mean), 0.0))
  p_cond = _falling_ratio(n_neg - 1.0, n - 1.0, k - 1)
  a_pos = (1.0 - mean) / (sigma + eps)
  a_neg = (1.0 - mean - p_cond) / (sigma + eps)
  ok = (n >= k) & (mean > 0.0) & (mean < 1.0)  # [G]
  adv = jnp.where(correct, groups.gather(a_pos), groups.gather(a_neg))
  adv = jnp.where(groups.gather(ok) & groups.valid, adv, 0.0)
  nonempty = n > 0
  passk_mean = _safe_div(jnp.where(nonempty, mean, 0.0).sum(), nonempty.sum(dtype=_F32))
  return _finish(adv, response_mask, axis_name, passk_mean=passk_mean)


@register_advantage("maxrl")
def maxrl(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""MaxRL: group-mean baseline divided by the group mean reward (inverse success-rate weighting).

  .. math::

      A_i = \frac{R_i - \bar R_g}{\bar R_g + \epsilon}\quad (\bar R_g > 0), \qquad A_i = 0 \text{ otherwise}

  For binary rewards with ``K`` successes in ``N``: correct responses get ``(N-K)/K``, wrong ones
  ``-1``; its gradient is that of the log pass rate, a maximum-likelihood objective. Meant for
  non-negative (binary) rewards.

  Args:
    rewards: ``[B]`` non-negative. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    eps: added to the mean in the denominator.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``; degenerate groups and groups with mean ``<= 0`` get 0.

  References:
    Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", eq. 10, as implemented in
    public MaxRL code (e.g. tunix ``compute_maxrl_advantages``). Not in the project notes; this is
    the one definition found, not checked against the paper text itself.
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  gs = _group_stats(r, groups)
  mean = groups.gather(gs.mean)
  adv = (r - mean) / (mean + eps)
  zero = groups.gather(gs.degenerate) | (mean <= 0.0) | ~groups.valid
  return _finish(jnp.where(zero, 0.0, adv), response_mask, axis_name,
                 degenerate_group_fraction=_degenerate_fraction(gs))


@register_advantage("remax")
def remax(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    baseline_rewards: jax.Array,  # [B]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""ReMax: reward minus the reward of the greedy response to the same prompt.

  .. math::

      A_i = R(x, y_i) - R(x, \bar y), \qquad \bar y = \text{greedy decode of } x

  Args:
    rewards: ``[B]`` rewards of the sampled responses.
    response_mask: ``[B, T]``.
    baseline_rewards: ``[B]`` reward of the greedy response for each row's prompt.
    group_ids, num_groups, sample_mask: unused; accepted so that the options common to the registry
      can be passed to every estimator.
    axis_name: data-parallel mesh axis, only for the metrics.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models" (arXiv 2310.10505).
  """
  del group_ids, num_groups, sample_mask
  adv = _rewards(rewards) - _rewards(baseline_rewards)
  return _finish(adv, response_mask, axis_name)
