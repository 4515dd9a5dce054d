"""Advantage estimators: group baselines (GRPO family), critic-based GAE/EGAE, global normalisation.

Every estimator in :data:`ADVANTAGES` has one keyword-only signature::

    advantages, metrics = fn(*, rewards, group_ids, response_mask, **options)

``rewards`` is ``[B]`` (one scalar per response), ``group_ids`` ``[B]`` int (responses to the same
prompt share an id in ``[0, num_groups)``), ``response_mask`` ``[B, T]`` (1 on response tokens that
enter the loss). ``advantages`` is ``[B, T]`` float32, zero outside the mask; ``metrics`` maps names
to float32 scalars.

Conventions shared by all estimators:

- **Who counts.** A response takes part in group and batch statistics iff ``sample_mask`` is true
  (default: it has at least one valid response token) and ``0 <= group_id < num_groups``. Passing
  ``sample_mask`` explicitly lets a masked-out response (e.g. an overlong, filtered one: DAPO /
  DeepCoder GRPO+) still count in its group's baseline while receiving no gradient.
- **Static shapes.** Group statistics use ``jax.ops.segment_sum`` with the static ``num_groups``
  (default ``B``); nothing loops over groups, so every function is ``jit``/``vmap``-safe. String and
  integer switches (``mean_level``, ``num_groups``, ``k``) are static: bind them with
  ``functools.partial`` before ``jax.jit``.
- **Degenerate groups.** A group with fewer than two members or with all rewards equal gives every
  member advantage exactly 0 in group-baselined estimators (never NaN, never ``0 / eps`` noise).
- **Global statistics.** Batch-level means and stds are sums over the whole global batch divided
  by global counts. Inside ``jax.shard_map`` pass ``axis_name`` (the data-parallel mesh axis): every
  segment sum, count, max and min is ``psum``/``pmax``/``pmin``-reduced over it, so groups may even
  span shards (then ``num_groups`` must cover the global group ids). Token-level whitening also
  accepts precomputed additive :class:`Moments` (e.g. summed over gradient-accumulation
  micro-batches) through ``global_moments``.
- Population statistics (ddof 0) unless ``unbiased_std=True``; normalisation is
  ``(x - mean) / (std + eps)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "ADVANTAGES",
    "Moments",
    "arpo_hard",
    "arpo_soft",
    "dr_grpo",
    "egae",
    "gae",
    "gae_returns",
    "global_normalize",
    "gpg",
    "grpo",
    "grpo_passk",
    "masked_moments",
    "maxrl",
    "opo",
    "register_advantage",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "seed_grpo",
]

Metrics = dict[str, jax.Array]
AdvantageFn = Callable[..., tuple[jax.Array, Metrics]]

ADVANTAGES: dict[str, AdvantageFn] = {}
"""Advantage estimators by name; all share the keyword-only signature described in the module doc."""

_LEVELS = ("group", "batch", "none")
_F32 = jnp.float32


def register_advantage(name: str, *, overwrite: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
  """Decorator that adds an estimator to :data:`ADVANTAGES` under ``name``.

  The function must follow the registry signature
  ``fn(*, rewards, group_ids, response_mask, **options) -> (advantages [B, T], metrics)``.

  Args:
    name: registry key.
    overwrite: replace an existing entry instead of raising.

  Returns:
    A decorator returning the function unchanged.

  Example::

      @register_advantage("my_baseline")
      def my_baseline(*, rewards, group_ids, response_mask):
        ...
  """

  def decorator(fn: AdvantageFn) -> AdvantageFn:
    if name in ADVANTAGES and not overwrite and ADVANTAGES[name] is not fn:
      raise ValueError(f"advantage estimator {name!r} is already registered; pass overwrite=True")
    ADVANTAGES[name] = fn
    return fn

  return decorator


# ----------------------------------------------------------------------------------------------------
# Reductions that are global under shard_map.


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmax(x, axis_name):
  return x if axis_name is None else jax.lax.pmax(x, axis_name)


def _pmin(x, axis_name):
  return x if axis_name is None else jax.lax.pmin(x, axis_name)


def _safe_div(num, den):
  """num / den where den > 0, else 0 (no NaN in either branch)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


class Moments(NamedTuple):
  """Additive first and second moments of the valid entries of an array.

  Moments of disjoint parts of a batch (devices, hosts, micro-batches) add up elementwise to the
  moments of the whole batch, so they can be precomputed and passed as ``global_moments``.
  """

  count: jax.Array  # [] number of valid entries
  total: jax.Array  # [] Σ x
  total_sq: jax.Array  # [] Σ x²


def masked_moments(x: jax.Array, mask: jax.Array, *, axis_name: str | None = None) -> Moments:
  """Count, Σx and Σx² of ``x`` where ``mask > 0``, in float32, optionally ``psum``-ed over ``axis_name``.

  Args:
    x: values, any shape (e.g. token advantages ``[B, T]``).
    mask: same shape as ``x``; entries with ``mask > 0`` count.
    axis_name: mesh axis to sum over inside ``shard_map``.

  Returns:
    :class:`Moments` of scalars.
  """
  m = mask > 0
  x = jnp.where(m, x.astype(_F32), 0.0)
  return Moments(
      count=_psum(m.sum(dtype=_F32), axis_name),
      total=_psum(x.sum(), axis_name),
      total_sq=_psum((x * x).sum(), axis_name),
  )


# ----------------------------------------------------------------------------------------------------
# Groups and their statistics.


class _Groups(NamedTuple):
  ids: jax.Array  # [B] int32 segment ids; num_groups for responses that take no part
  index: jax.Array  # [B] int32 ids clipped into range, for gathering per-group values
  valid: jax.Array  # [B] bool, takes part in statistics
  num_groups: int
  axis_name: str | None

  def sum(self, x):  # [B] -> [G]
    x = jnp.where(self.valid, x, 0.0)
    return _psum(jax.ops.segment_sum(x, self.ids, num_segments=self.num_groups), self.axis_name)

  def max(self, x):  # [B] -> [G], -inf for empty groups
    x = jnp.where(self.valid, x, -jnp.inf)
    return _pmax(jax.ops.segment_max(x, self.ids, num_segments=self.num_groups), self.axis_name)

  def min(self, x):  # [B] -> [G], +inf for empty groups
    x = jnp.where(self.valid, x, jnp.inf)
    return _pmin(jax.ops.segment_min(x, self.ids, num_segments=self.num_groups), self.axis_name)

  def gather(self, g):  # [G] -> [B]
    return g[self.index]


def _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name) -> _Groups:
  b = response_mask.shape[0]
  num_groups = b if num_groups is None else int(num_groups)
  if num_groups < 1:
    raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
  if group_ids is None:
    raise ValueError("group_ids is required for a group-baselined estimator")
  gid = jnp.asarray(group_ids).astype(jnp.int32)
  if sample_mask is None:
    valid = (response_mask > 0).any(axis=-1)
  else:
    valid = jnp.asarray(sample_mask).astype(bool)
  valid = valid & (gid >= 0) & (gid < num_groups)
  return _Groups(
      ids=jnp.where(valid, gid, num_groups),
      index=jnp.clip(gid, 0, num_groups - 1),
      valid=valid,
      num_groups=num_groups,
      axis_name=axis_name,
  )


class _GroupStats(NamedTuple):
  count: jax.Array  # [G] members
  mean: jax.Array  # [G] (weighted) mean
  var: jax.Array  # [G] population variance
  degenerate: jax.Array  # [G] bool: < 2 members or all values equal


def _group_stats(x, groups: _Groups, weights=None) -> _GroupStats:
  """Per-group mean and variance of ``x`` [B] (two passes), optionally weighted."""
  ones = jnp.ones_like(x)
  w = ones if weights is None else weights
  count = groups.sum(ones)
  wsum = groups.sum(w)
  mean = _safe_div(groups.sum(w * x), wsum)
  dev = x - groups.gather(mean)
  var = _safe_div(groups.sum(w * dev * dev), wsum)
  degenerate = (count < 2) | (groups.max(x) <= groups.min(x))
  return _GroupStats(count=count, mean=mean, var=var, degenerate=degenerate)


class _BatchStats(NamedTuple):
  count: jax.Array  # []
  mean: jax.Array  # []
  var: jax.Array  # []
  degenerate: jax.Array  # [] bool


def _batch_stats(x, valid, axis_name) -> _BatchStats:
  """Mean and variance of ``x`` over the valid entries of the global batch (two passes)."""
  count = _psum(valid.sum(dtype=_F32), axis_name)
  mean = _safe_div(_psum(jnp.where(valid, x, 0.0).sum(), axis_name), count)
  dev = jnp.where(valid, x - mean, 0.0)
  var = _safe_div(_psum((dev * dev).sum(), axis_name), count)
  xmax = _pmax(jnp.where(valid, x, -jnp.inf).max(), axis_name)
  xmin = _pmin(jnp.where(valid, x, jnp.inf).min(), axis_name)
  return _BatchStats(count=count, mean=mean, var=var, degenerate=(count < 2) | (xmax <= xmin))


def _unbias(var, count):
  return jnp.where(count > 1, var * _safe_div(count, count - 1.0), var)


def _check_level(name, level):
  if level not in _LEVELS:
    raise ValueError(f"{name} must be one of {_LEVELS}, got {level!r}")


def _degenerate_fraction(stats: _GroupStats):
  nonempty = stats.count > 0
  return _safe_div((stats.degenerate & nonempty).sum(dtype=_F32), nonempty.sum(dtype=_F32))


# ----------------------------------------------------------------------------------------------------
# Output helpers.


def _broadcast(seq_adv, response_mask):  # [B] -> [B, T], zero outside the mask
  return jnp.where(response_mask > 0, seq_adv[:, None], 0.0).astype(_F32)


def _token_metrics(adv, response_mask, axis_name) -> Metrics:
  m = response_mask > 0
  count = _psum(m.sum(dtype=_F32), axis_name)
  mean = _safe_div(_psum(jnp.where(m, adv, 0.0).sum(), axis_name), count)
  dev = jnp.where(m, adv - mean, 0.0)
  std = jnp.sqrt(_safe_div(_psum((dev * dev).sum(), axis_name), count))
  has = count > 0
  amax = _pmax(jnp.where(m, adv, -jnp.inf).max(), axis_name)
  amin = _pmin(jnp.where(m, adv, jnp.inf).min(), axis_name)
  return {
      "advantage_mean": mean,
      "advantage_std": std,
      "advantage_max": jnp.where(has, amax, 0.0),
      "advantage_min": jnp.where(has, amin, 0.0),
  }


def _finish(seq_or_tok_adv, response_mask, axis_name, **extra) -> tuple[jax.Array, Metrics]:
  adv = seq_or_tok_adv
  if adv.ndim == 1:
    adv = _broadcast(adv, response_mask)
  adv = jnp.where(response_mask > 0, adv, 0.0).astype(_F32)
  metrics = _token_metrics(adv, response_mask, axis_name)
  metrics.update({k: jnp.asarray(v, _F32) for k, v in extra.items()})
  return adv, metrics


def _rewards(rewards):
  return jnp.asarray(rewards).astype(_F32)


# ----------------------------------------------------------------------------------------------------
# GRPO family (sequence-level, group baselines).


def _grpo_sequence(r, groups: _Groups, *, std_normalize, mean_level, std_level, eps, unbiased_std):
  """Per-response GRPO advantage [B] and the group statistics it used (or None)."""
  _check_level("mean_level", mean_level)
  _check_level("std_level", std_level)
  if not std_normalize:
    std_level = "none"
  gs = _group_stats(r, groups) if "group" in (mean_level, std_level) else None
  bs = _batch_stats(r, groups.valid, groups.axis_name) if "batch" in (mean_level, std_level) else None
  zero = ~groups.valid
  if mean_level == "group":
    centered = r - groups.gather(gs.mean)
    zero |= groups.gather(gs.degenerate)
  elif mean_level == "batch":
    centered = r - bs.mean
    if std_level == "none":
      zero |= bs.degenerate
  else:
    centered = r
  if std_level == "none":
    adv = centered
  else:
    if std_level == "group":
      var, count = groups.gather(gs.var), groups.gather(gs.count)
      zero |= groups.gather(gs.degenerate)
    else:
      var, count = bs.var, bs.count
      zero |= bs.degenerate
    if unbiased_std:
      var = _unbias(var, count)
    adv = centered / (jnp.sqrt(var) + eps)
  return jnp.where(zero, 0.0, adv), gs


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


# ----------------------------------------------------------------------------------------------------
# Token-level whitening (REINFORCE++, AReaL global normalisation).


def _outcome_tokens(rewards, response_mask):
  """Places each row's scalar reward on its last valid token: ``[B] -> [B, T]``."""
  m = response_mask > 0
  t = m.shape[-1]
  last = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
  onehot = jnp.arange(t)[None, :] == last[:, None]
  return jnp.where(onehot & m.any(-1, keepdims=True), rewards[:, None], 0.0).astype(_F32)


@jax.jit
def _reverse_returns(token_rewards, response_mask, gamma):
  """G_t = r_t + γ G_{t'} over valid tokens (t' the next valid token); masked positions are skipped."""
  m = response_mask > 0

  def step(carry, x):
    r, mt = x
    g = jnp.where(mt, r + gamma * carry, carry)
    return g, g

  init = jnp.zeros(token_rewards.shape[0], _F32)
  _, g = jax.lax.scan(step, init, (token_rewards.T, m.T), reverse=True)
  return jnp.where(m, g.T, 0.0)


def _normalize_tokens(x, response_mask, *, mean_level, std_level, eps, axis_name, global_moments,
                      groups: _Groups | None):
  """(x - mean) / (std + eps) over valid tokens at the requested levels; [B, T] -> ([B, T], zero)."""
  _check_level("mean_level", mean_level)
  _check_level("std_level", std_level)
  m = response_mask > 0
  if groups is not None:
    m = m & groups.valid[:, None]
  levels = (mean_level, std_level)
  zero = ~m
  if "batch" in levels:
    if global_moments is None:
      count = _psum(m.sum(dtype=_F32), axis_name)
      b_mean = _safe_div(_psum(jnp.where(m, x, 0.0).sum(), axis_name), count)
      dev = jnp.where(m, x - b_mean, 0.0)
      b_var = _safe_div(_psum((dev * dev).sum(), axis_name), count)
      xmax = _pmax(jnp.where(m, x, -jnp.inf).max(), axis_name)
      xmin = _pmin(jnp.where(m, x, jnp.inf).min(), axis_name)
      b_degenerate = xmax <= xmin
    else:
      count = jnp.asarray(global_moments.count, _F32)
      b_mean = _safe_div(jnp.asarray(global_moments.total, _F32), count)
      b_var = jnp.maximum(_safe_div(jnp.asarray(global_moments.total_sq, _F32), count) - b_mean**2, 0.0)
      b_degenerate = b_var <= 0.0
  if "group" in levels:
    if groups is None:
      raise ValueError("group-level token normalisation needs group_ids")
    row_count = m.sum(axis=-1, dtype=_F32)
    g_count = groups.sum(row_count)
    g_mean = _safe_div(groups.sum(jnp.where(m, x, 0.0).sum(-1)), g_count)
    dev = jnp.where(m, x - groups.gather(g_mean)[:, None], 0.0)
    g_var = _safe_div(groups.sum((dev * dev).sum(-1)), g_count)
    row_max = jnp.where(m, x, -jnp.inf).max(-1)
    row_min = jnp.where(m, x, jnp.inf).min(-1)
    g_degenerate = groups.max(row_max) <= groups.min(row_min)
    g_mean, g_var = groups.gather(g_mean)[:, None], groups.gather(g_var)[:, None]
    g_degenerate = groups.gather(g_degenerate)[:, None]
  if mean_level == "batch":
    centered = x - b_mean
    if std_level == "none":
      zero = zero | b_degenerate
  elif mean_level == "group":
    centered = x - g_mean
    zero = zero | g_degenerate
  else:
    centered = x
  if std_level == "batch":
    out = centered / (jnp.sqrt(b_var) + eps)
    zero = zero | b_degenerate
  elif std_level == "group":
    out = centered / (jnp.sqrt(g_var) + eps)
    zero = zero | g_degenerate
  else:
    out = centered
  return jnp.where(zero, 0.0, out)


@register_advantage("global_normalize")
def global_normalize(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    group_ids: jax.Array | None = None,  # [B] int; needed only for group levels
    advantages: jax.Array | None = None,  # [B, T]
    mean_level: str = "batch",
    std_level: str = "batch",
    eps: float = 1e-6,
    global_moments: Moments | None = None,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""AReaL global advantage normalisation over the valid tokens of the whole global batch.

  .. math::

      \hat A_{i,t} = \frac{A_{i,t} - \mu}{\sigma + \epsilon},\qquad
      \mu = \frac{\sum_{i,t} m_{i,t} A_{i,t}}{\sum_{i,t} m_{i,t}},\quad
      \sigma^2 = \frac{\sum_{i,t} m_{i,t} (A_{i,t} - \mu)^2}{\sum_{i,t} m_{i,t}}

  AReaL (notes: "论文在全局批次中采用优势归一化", no critic, ``γ = λ = 1``, reward ±5 on the last
  token) feeds this with ``A_{i,t} = R_i`` on every token, the default when ``advantages`` is None.
  ``mean_level``/``std_level`` (``"batch" | "group" | "none"``) mirror AReaL's ``NormConfig``; at
  token level every valid token weighs once. With ``global_moments`` (batch level only) the batch
  statistics come from precomputed :class:`Moments` of ``advantages`` instead of this call's data.

  Args:
    rewards: ``[B]``; used as token advantages when ``advantages`` is None.
    response_mask: ``[B, T]``.
    group_ids: ``[B]`` int, required for ``"group"`` levels.
    advantages: ``[B, T]`` advantages to normalise (e.g. from :func:`gae`).
    mean_level, std_level: ``"batch" | "group" | "none"``.
    eps: added to the std.
    global_moments: precomputed batch moments of the token advantages.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``; all-equal inputs (at the levels used) give 0.

  References:
    Fu et al. 2025, AReaL, appendix A.1 (notes 000 §AReaL, ~986 and ~1305).
  """
  x = _broadcast(_rewards(rewards), response_mask) if advantages is None else (
      jnp.asarray(advantages).astype(_F32))
  groups = None
  if "group" in (mean_level, std_level):
    groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  elif sample_mask is not None:  # batch levels only: group ids play no part
    groups = _make_groups(jnp.zeros(response_mask.shape[0], jnp.int32), response_mask, sample_mask, 1,
                          axis_name)
  out = _normalize_tokens(x, response_mask, mean_level=mean_level, std_level=std_level, eps=eps,
                          axis_name=axis_name, global_moments=global_moments, groups=groups)
  return _finish(out, response_mask, axis_name)


@register_advantage("reinforce_pp")
def reinforce_pp(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    token_rewards: jax.Array | None = None,  # [B, T]
    gamma: float = 1.0,
    eps: float = 1e-6,
    global_moments: Moments | None = None,
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""REINFORCE++: discounted token returns whitened over the valid tokens of the global batch.

  .. math::

      G_{i,t} = \sum_{s \ge t} \gamma^{s-t} r_{i,s},\quad
      r_{i,s} = \mathbb{1}[s = \text{last}_i]\, R_i + \text{token\_rewards}_{i,s},\qquad
      A_{i,t} = \frac{G_{i,t} - \mu_{\text{batch}}}{\sigma_{\text{batch}} + \epsilon}

  ``token_rewards`` carries e.g. the per-token KL penalty ``-β·KL_t`` of the paper's reward. With
  ``γ = 1`` and no token rewards every token of response ``i`` gets ``R_i`` before whitening. No
  group baseline; equal returns everywhere give 0.

  Args:
    rewards: ``[B]`` outcome reward, placed on the last valid token.
    response_mask: ``[B, T]``.
    group_ids, num_groups: unused; accepted so that the options common to the registry can be
      passed to every estimator.
    sample_mask: ``[B]`` responses whose tokens enter the whitening statistics (others get 0).
    token_rewards: ``[B, T]`` optional dense rewards.
    gamma: discount.
    eps: added to the std.
    global_moments: precomputed :class:`Moments` of the returns over the global batch.
    axis_name: data-parallel mesh axis inside ``shard_map``.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (arXiv 2501.03262), global-batch advantage normalisation.
  """
  del group_ids, num_groups
  groups = None
  if sample_mask is not None:
    groups = _make_groups(jnp.zeros(response_mask.shape[0], jnp.int32), response_mask, sample_mask, 1,
                          axis_name)
  tok = _outcome_tokens(_rewards(rewards), response_mask)
  if token_rewards is not None:
    tok = tok + jnp.asarray(token_rewards).astype(_F32)
  returns = _reverse_returns(tok, response_mask, gamma)
  out = _normalize_tokens(returns, response_mask, mean_level="batch", std_level="batch", eps=eps,
                          axis_name=axis_name, global_moments=global_moments, groups=groups)
  return _finish(out, response_mask, axis_name)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    eps: float = 1e-6,
    global_moments: Moments | None = None,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""REINFORCE++-baseline: subtract the group mean reward, then whiten over the global batch's tokens.

  .. math::

      A'_{i} = R_i - \operatorname{mean}_{j \in g(i)} R_j,\qquad
      A_{i,t} = \frac{A'_i - \mu_{\text{batch}}}{\sigma_{\text{batch}} + \epsilon}

  ``μ, σ`` are over every valid token (token-weighted), as in the paper and OpenRLHF/verl. Note
  that, unlike GRPO, a degenerate group's ``A'_i = 0`` is shifted by ``-μ/σ`` like every other
  token: that is the published estimator.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    eps: added to the std.
    global_moments: precomputed :class:`Moments` of the token values ``A'`` over the global batch.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Hu 2025, REINFORCE++ (arXiv 2501.03262), "REINFORCE++-baseline".
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  seq, gs = _grpo_sequence(r, groups, std_normalize=False, mean_level="group", std_level="none",
                           eps=eps, unbiased_std=False)
  tok = _broadcast(seq, response_mask)
  out = _normalize_tokens(tok, response_mask, mean_level="batch", std_level="batch", eps=eps,
                          axis_name=axis_name, global_moments=global_moments, groups=groups)
  return _finish(out, response_mask, axis_name, degenerate_group_fraction=_degenerate_fraction(gs))


# ----------------------------------------------------------------------------------------------------
# Critic-based: GAE and T-PPO's extended GAE.


@jax.jit
def _gae_core(*, rewards, response_mask, values, gamma, lam, token_rewards, finished, bootstrap_values):
  """Reverse ``lax.scan`` GAE over valid tokens; returns (advantages [B, T], returns [B, T])."""
  m = response_mask > 0
  b = m.shape[0]
  v = jnp.asarray(values).astype(_F32)
  done = jnp.ones(b, bool) if finished is None else jnp.asarray(finished).astype(bool)
  outcome = jnp.where(done, _rewards(rewards), 0.0)
  tok = _outcome_tokens(outcome, response_mask)
  if token_rewards is not None:
    tok = tok + jnp.asarray(token_rewards).astype(_F32)
  boot = jnp.zeros(b, _F32) if bootstrap_values is None else _rewards(bootstrap_values)
  terminal = jnp.where(done, 0.0, boot)  # V after the last valid token: 0 if finished

  def step(carry, x):
    next_v, next_a = carry
    r_t, v_t, m_t = x
    delta = r_t + gamma * next_v - v_t
    a = delta + gamma * lam * next_a
    a = jnp.where(m_t, a, next_a)  # masked positions (padding, tool output) are skipped
    nv = jnp.where(m_t, v_t, next_v)
    return (nv, a), a

  init = (terminal, jnp.zeros(b, _F32))
  _, adv = jax.lax.scan(step, init, (tok.T, v.T, m.T), reverse=True)
  adv = jnp.where(m, adv.T, 0.0)
  returns = jnp.where(m, adv + v, 0.0)
  return adv, returns


def gae_returns(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    finished: jax.Array | None = None,  # [B] bool
    bootstrap_values: jax.Array | None = None,  # [B]
) -> jax.Array:  # [B, T]
  r"""Value targets :math:`\hat R_t = \hat A_t + V(s_t)` of :func:`gae` / :func:`egae` (λ-returns).

  Args:
    rewards, response_mask, values, gamma, lam, token_rewards: as in :func:`gae`.
    finished, bootstrap_values: as in :func:`egae` (default: every response finished).

  Returns:
    ``[B, T]`` float32 returns, zero outside the mask.

  References:
    Schulman et al. 2016 (GAE).
  """
  _, returns = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma,
                         lam=lam, token_rewards=token_rewards, finished=finished,
                         bootstrap_values=bootstrap_values)
  return returns


@register_advantage("gae")
def gae(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""Generalised advantage estimation over response tokens, a reverse ``lax.scan`` over time.

  .. math::

      \delta_t = r_t + \gamma V(s_{t+1}) - V(s_t),\qquad \hat A_t = \delta_t + \gamma\lambda \hat A_{t+1}

  ``values[:, t]`` is ``V(s_t)``, the value before token ``t``. The outcome reward ``R_i`` is added to
  the last valid token's ``r_t`` (plus optional dense ``token_rewards``, e.g. ``-β·KL``). The state
  after the last valid token is terminal (``V = 0``), so masks that end early are handled; masked
  positions inside a response (e.g. tool output in multi-turn rollouts) are skipped, i.e. the next
  valid token's value and advantage carry over them.

  Args:
    rewards: ``[B]`` outcome rewards.
    response_mask: ``[B, T]``.
    values: ``[B, T]`` critic values.
    gamma: discount ``γ``.
    lam: GAE ``λ``.
    token_rewards: ``[B, T]`` optional dense rewards.
    group_ids, num_groups, sample_mask: unused; accepted so that the options common to the registry
      can be passed to every estimator.
    axis_name: data-parallel mesh axis, only for the metrics.

  Returns:
    ``(advantages [B, T] float32, metrics)``; :func:`gae_returns` gives the matching value targets.

  References:
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".
  """
  del group_ids, num_groups, sample_mask
  adv, returns = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma,
                           lam=lam, token_rewards=token_rewards, finished=None, bootstrap_values=None)
  ret_mean = _safe_div(_psum(returns.sum(), axis_name),
                       _psum((response_mask > 0).sum(dtype=_F32), axis_name))
  return _finish(adv, response_mask, axis_name, returns_mean=ret_mean)


@register_advantage("egae")
def egae(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    finished: jax.Array,  # [B] bool
    bootstrap_values: jax.Array,  # [B]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""T-PPO extended GAE: advantages inside a truncated generation window, bootstrapped at its end.

  .. math::

      \hat A_t = \delta_t + (\gamma\lambda)\delta_{t+1} + \cdots + (\gamma\lambda)^{\ell-t-1}\delta_{\ell-1},
      \qquad \delta_{\ell-1} = r_{\ell-1} + \gamma V(s_\ell) - V(s_{\ell-1})

  with ``ℓ`` the window end (notes 003, T-PPO table). ``response_mask`` covers the window's tokens.
  For an unfinished response (``finished=False``) the window end is not terminal: ``V(s_ℓ)`` is
  ``bootstrap_values`` (the critic's value after the window's last token) and no outcome reward is
  added, since the response has none yet. Finished responses are plain :func:`gae`. For every token
  ``t`` in the window, ``A^{full}_t = Â_t + (γλ)^{ℓ-t} A^{full}_ℓ`` when the bootstrap value is the
  full sequence's ``V(s_ℓ)``.

  Args:
    rewards: ``[B]`` outcome rewards (used for finished rows only).
    response_mask: ``[B, T]`` the window's valid tokens.
    values: ``[B, T]`` ``V(s_t)`` for the window's tokens.
    finished: ``[B]`` bool, the response ended inside this window.
    bootstrap_values: ``[B]`` ``V(s_ℓ)`` for unfinished rows (ignored for finished rows).
    gamma, lam, token_rewards: as in :func:`gae`.
    group_ids, num_groups, sample_mask: unused; accepted so that the options common to the registry
      can be passed to every estimator.
    axis_name: data-parallel mesh axis, only for the metrics.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Fan et al. 2025, "Truncated Proximal Policy Optimization" (T-PPO), EGAE; notes 003 §T-PPO.
  """
  del group_ids, num_groups, sample_mask
  adv, _ = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma, lam=lam,
                     token_rewards=token_rewards, finished=finished, bootstrap_values=bootstrap_values)
  unfinished = _psum((~jnp.asarray(finished).astype(bool)).sum(dtype=_F32), axis_name)
  total = _psum(jnp.asarray(response_mask.shape[0], _F32), axis_name)
  return _finish(adv, response_mask, axis_name, unfinished_fraction=_safe_div(unfinished, total))


# ----------------------------------------------------------------------------------------------------
# SEED-GRPO and ARPO.


def _semantic_entropy(cluster_ids, groups: _Groups, num_clusters, estimator):
  """Per-response SE of its group from semantic cluster ids; returns (se [B], group size [B])."""
  cid = jnp.asarray(cluster_ids).astype(jnp.int32)
  ok = groups.valid & (cid >= 0) & (cid < num_clusters)
  key = jnp.where(ok, groups.index * num_clusters + cid, groups.num_groups * num_clusters)
  ones = jnp.where(ok, 1.0, 0.0)
  n_cluster = _psum(jax.ops.segment_sum(ones, key, num_segments=groups.num_groups * num_clusters),
                    groups.axis_name)
  n_k = jnp.where(ok, n_cluster[jnp.clip(key, 0, groups.num_groups * num_clusters - 1)], 1.0)  # [B]
  n = groups.gather(groups.sum(ones))  # [B] group size
  log_p = jnp.log(_safe_div(n_k, n) + (n <= 0))  # log(n_k / n), 0 for empty groups
  if estimator == "mc":  # -(1/K) Σ_k log p(C_k): each cluster counted once via weights 1/n_k
    inv = jnp.where(ok, 1.0 / n_k, 0.0)
    num_k = groups.gather(groups.sum(inv))
    se = -_safe_div(groups.gather(groups.sum(inv * log_p)), num_k)
  elif estimator == "shannon":  # -Σ_k p_k log p_k = -Σ_i (1/n) log p(C(i))
    se = -groups.gather(groups.sum(jnp.where(ok, _safe_div(log_p, n), 0.0)))
  else:
    raise ValueError(f"estimator must be 'mc' or 'shannon', got {estimator!r}")
  return se, n


@register_advantage("seed_grpo")
def seed_grpo(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    semantic_entropy: jax.Array | None = None,  # [B]
    cluster_ids: jax.Array | None = None,  # [B] int
    alpha: float = 1.0,
    max_entropy: jax.Array | None = None,  # [B]
    estimator: str = "mc",
    scale_fn: Callable[[jax.Array], jax.Array] | None = None,
    num_clusters: int | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""SEED-GRPO: GRPO advantages scaled down for prompts with high semantic entropy.

  .. math::

      \hat A_i = A_i \cdot f\!\left(\alpha \cdot \operatorname{SE}(q) / \operatorname{SE}_{\max}(q)\right),
      \qquad \operatorname{SE}(q) \approx -\frac{1}{K}\sum_{k=1}^K \log \mathbb{P}(C_k \mid q),
      \qquad \operatorname{SE}_{\max}(q) = \log N

  (notes 003 §SEED-GRPO; the notes drop the ``log`` in ``SE``, restored here as in Kuhn et al.'s
  Monte Carlo estimator the paper uses). ``A_i`` is :func:`grpo`'s advantage, ``N`` the group size,
  ``C_1..C_K`` the semantic clusters of the group's answers with ``P(C_k|q) = |C_k| / N``. ``f`` is
  linear so that higher entropy gives a more conservative update: ``f(x) = 1 - x`` (pass
  ``scale_fn`` for another). ``estimator="shannon"`` uses the plug-in entropy
  ``-Σ_k P(C_k) log P(C_k)`` instead.

  Either ``semantic_entropy`` (``SE(q)`` per response, equal within a group) or ``cluster_ids``
  (per-response cluster index within its group, in ``[0, num_clusters)``) must be given.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    semantic_entropy: ``[B]`` precomputed ``SE(q)`` of each response's prompt.
    cluster_ids: ``[B]`` int semantic cluster of each response.
    alpha: sensitivity ``α``.
    max_entropy: ``[B]`` ``SE_max(q)`` (default ``log N``).
    estimator: ``"mc"`` (notes/paper) or ``"shannon"``, for ``cluster_ids``.
    scale_fn: ``f``; default ``lambda x: 1 - x``.
    num_clusters: static bound on cluster ids (default ``B``).
    std_normalize, eps: as in :func:`grpo`.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)`` with the mean ``SE`` and mean scale.

  References:
    Chen et al. 2025, "SEED-GRPO: Semantic Entropy Enhanced GRPO for Uncertainty-Aware Policy
    Optimization" (arXiv 2505.12346); Kuhn et al. 2023 (semantic entropy); notes 003 §SEED-GRPO.
  """
  if (semantic_entropy is None) == (cluster_ids is None):
    raise ValueError("seed_grpo needs exactly one of semantic_entropy or cluster_ids")
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  adv, gs = _grpo_sequence(r, groups, std_normalize=std_normalize, mean_level="group",
                           std_level="group", eps=eps, unbiased_std=False)
  n = groups.gather(gs.count)
  if cluster_ids is not None:
    num_clusters = response_mask.shape[0] if num_clusters is None else int(num_clusters)
    se, _ = _semantic_entropy(cluster_ids, groups, num_clusters, estimator)
  else:
    se = _rewards(semantic_entropy)
  se_max = jnp.log(jnp.maximum(n, 1.0)) if max_entropy is None else _rewards(max_entropy)
  x = alpha * _safe_div(se, se_max)
  scale = 1.0 - x if scale_fn is None else scale_fn(x)
  adv = jnp.where(groups.valid, adv * scale, 0.0)
  count = _psum(groups.valid.sum(dtype=_F32), axis_name)
  se_mean = _safe_div(_psum(jnp.where(groups.valid, se, 0.0).sum(), axis_name), count)
  scale_mean = _safe_div(_psum(jnp.where(groups.valid, scale, 0.0).sum(), axis_name), count)
  return _finish(adv, response_mask, axis_name, semantic_entropy_mean=se_mean, seed_scale_mean=scale_mean,
                 degenerate_group_fraction=_degenerate_fraction(gs))


def _shared_tokens(prefix_ids, response_mask, groups: _Groups, num_prefixes):
  pid = jnp.asarray(prefix_ids).astype(jnp.int32)
  shared = (response_mask > 0) & groups.valid[:, None] & (pid >= 0) & (pid < num_prefixes)
  return pid, shared


@register_advantage("arpo_hard")
def arpo_hard(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    prefix_ids: jax.Array,  # [B, T] int, -1 = not shared
    num_prefixes: int | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""ARPO hard advantage attribution on tree rollouts: shared tokens get their branches' mean advantage.

  .. math::

      \hat A_{i,t} = \frac{r_t - \operatorname{mean}(\{R_i\}_{i=1}^G)}{\operatorname{std}(\{R_i\}_{i=1}^G)}
      \ \text{(individual tokens)},\qquad
      \hat A^{\text{shared}}_{i,t} = \frac{1}{d}\sum_{i=1}^{d} \hat A_{i,t}\ \text{(shared tokens)}

  where the ``d`` trajectories are those containing the shared segment (notes 000 §ARPO, "硬优势估计").

  Tree encoding (static shapes): each trajectory is a full row, shared prefix tokens duplicated in
  every row that contains them. ``prefix_ids[i, t] >= 0`` marks a shared token; the same id on
  several rows means the same tree node (so id ``p`` appears once per branch through it). ``-1``
  (or any negative) marks a token owned by one trajectory. Ids are in ``[0, num_prefixes)``.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    prefix_ids: ``[B, T]`` int node ids of shared tokens, ``-1`` elsewhere.
    num_prefixes: static bound on prefix ids (default ``B * T``).
    std_normalize, eps: as in :func:`grpo`.
    num_groups, sample_mask, axis_name: as in :func:`grpo` (prefix means are ``psum``-ed too).

  Returns:
    ``(advantages [B, T] float32, metrics)`` with ``shared_token_fraction``.

  References:
    Dong et al. 2025, "Agentic Reinforced Policy Optimization" (arXiv 2507.19849), §Advantage
    Attribution Estimation; notes 000 §ARPO (~1918).
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  seq, gs = _grpo_sequence(r, groups, std_normalize=std_normalize, mean_level="group",
                           std_level="group", eps=eps, unbiased_std=False)
  tok = _broadcast(seq, response_mask)  # [B, T]
  b, t = response_mask.shape
  num_prefixes = b * t if num_prefixes is None else int(num_prefixes)
  pid, shared = _shared_tokens(prefix_ids, response_mask, groups, num_prefixes)
  ids = jnp.where(shared, pid, num_prefixes).reshape(-1)
  total = _psum(jax.ops.segment_sum(jnp.where(shared, tok, 0.0).reshape(-1), ids,
                                    num_segments=num_prefixes), axis_name)
  count = _psum(jax.ops.segment_sum(shared.astype(_F32).reshape(-1), ids, num_segments=num_prefixes),
                axis_name)
  node_mean = _safe_div(total, count)  # [P]
  tok = jnp.where(shared, node_mean[jnp.clip(pid, 0, num_prefixes - 1)], tok)
  frac = _safe_div(_psum(shared.sum(dtype=_F32), axis_name),
                   _psum((response_mask > 0).sum(dtype=_F32), axis_name))
  return _finish(tok, response_mask, axis_name, shared_token_fraction=frac,
                 degenerate_group_fraction=_degenerate_fraction(gs))


@register_advantage("arpo_soft")
def arpo_soft(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    prefix_ids: jax.Array | None = None,  # [B, T] int, -1 = not shared; only for metrics
    num_prefixes: int | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""ARPO soft advantage attribution: per-trajectory GRPO advantages, also on shared tokens.

  .. math::

      \hat A_{i,t} = \frac{R_i - \operatorname{mean}(\{R_j\}_{j=1}^G)}{\operatorname{std}(\{R_j\}_{j=1}^G)},
      \qquad r_{i,t}(\theta) = r_{j,t}(\theta) \text{ if } y_{i,<t} = y_{j,<t}

  The notes (000 §ARPO, "软优势估计", appendix D.1) define soft attribution as leaving the advantages
  alone: each shared-prefix token is duplicated in the ``d`` rows through it with one importance
  ratio, so the unclipped GRPO gradient on it is ``d · mean(Â)`` — the branches' mean advantage
  enters implicitly through the objective, not through the advantage array. This function therefore
  equals :func:`grpo` with the same options on any tree; :func:`arpo_hard` is the explicit mean.
  ARPO uses soft attribution by default. Same tree encoding as :func:`arpo_hard`.

  Args:
    rewards: ``[B]``. group_ids: ``[B]`` int. response_mask: ``[B, T]``.
    prefix_ids: ``[B, T]`` optional, used only for ``metrics["shared_token_fraction"]``.
    num_prefixes: static bound on prefix ids (default ``B * T``).
    std_normalize, eps: as in :func:`grpo`.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Dong et al. 2025, ARPO (arXiv 2507.19849), §Advantage Attribution Estimation and appendix D.1;
    notes 000 §ARPO (~1932, ~2280).
  """
  r = _rewards(rewards)
  groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  seq, gs = _grpo_sequence(r, groups, std_normalize=std_normalize, mean_level="group",
                           std_level="group", eps=eps, unbiased_std=False)
  extra: dict[str, Any] = {"degenerate_group_fraction": _degenerate_fraction(gs)}
  if prefix_ids is not None:
    b, t = response_mask.shape
    num_prefixes = b * t if num_prefixes is None else int(num_prefixes)
    _, shared = _shared_tokens(prefix_ids, response_mask, groups, num_prefixes)
    extra["shared_token_fraction"] = _safe_div(_psum(shared.sum(dtype=_F32), axis_name),
                                               _psum((response_mask > 0).sum(dtype=_F32), axis_name))
  return _finish(seq, response_mask, axis_name, **extra)

