"""Shared pieces of the advantage estimators: the registry, global reductions, :class:`Moments`,
group segments and their statistics, output helpers. The conventions are in
:mod:`jaxrl.losses._advantages`."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]
AdvantageFn = Callable[..., tuple[jax.Array, Metrics]]

ADVANTAGES: dict[str, AdvantageFn] = {}
"""Advantage estimators by name; all share the keyword-only signature of :mod:`jaxrl.losses._advantages`."""

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
  """Count, mean and sum of squared deviations ``M2 = Σ (x - mean)²`` of the valid entries of an array.

  Moments of disjoint parts of a batch (devices, hosts, micro-batches) combine with :meth:`merge`
  (Chan et al.'s pairwise update) into the moments of the whole batch, so they can be precomputed
  and passed as ``global_moments``. Keeping ``M2`` rather than ``Σx²`` avoids the cancellation of
  ``E[x²] - mean²`` when the mean is large compared with the spread.
  """

  count: jax.Array  # [] number of valid entries
  mean: jax.Array  # [] mean of the valid entries (0 when count is 0)
  m2: jax.Array  # [] Σ (x - mean)²

  def merge(self, other: Moments) -> Moments:
    """The moments of the union of two disjoint parts.

    ``n = n_a + n_b``, ``δ = μ_b - μ_a``, ``μ = μ_a + δ n_b / n``, ``M2 = M2_a + M2_b + δ² n_a n_b / n``
    (Chan, Golub and LeVeque 1979).
    """
    n = self.count + other.count
    delta = other.mean - self.mean
    mean = self.mean + _safe_div(delta * other.count, n)
    m2 = self.m2 + other.m2 + _safe_div(delta * delta * self.count * other.count, n)
    return Moments(count=n, mean=mean, m2=m2)

  def variance(self, *, unbiased: bool = False) -> jax.Array:
    """``M2 / n`` (population), or ``M2 / (n - 1)`` with ``unbiased`` (0 when undefined)."""
    return _safe_div(self.m2, self.count - 1.0 if unbiased else self.count)


def masked_moments(x: jax.Array, mask: jax.Array, *, axis_name: str | None = None) -> Moments:
  """Count, mean and ``M2`` of ``x`` where ``mask > 0``, in float32, global over ``axis_name`` if given.

  Two passes: the mean from the (``psum``-ed) sum and count, then ``M2`` around that mean.

  Args:
    x: values, any shape (e.g. token advantages ``[B, T]``).
    mask: same shape as ``x``; entries with ``mask > 0`` count.
    axis_name: mesh axis to sum over inside ``shard_map``.

  Returns:
    :class:`Moments` of scalars.
  """
  m = mask > 0
  x = jnp.where(m, x.astype(_F32), 0.0)
  count = _psum(m.sum(dtype=_F32), axis_name)
  mean = _safe_div(_psum(x.sum(), axis_name), count)
  dev = jnp.where(m, x - mean, 0.0)
  return Moments(count=count, mean=mean, m2=_psum((dev * dev).sum(), axis_name))


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
# The GRPO sequence advantage, shared by several families.


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


def _outcome_tokens(rewards, response_mask):
  """Places each row's scalar reward on its last valid token: ``[B] -> [B, T]``."""
  m = response_mask > 0
  t = m.shape[-1]
  last = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
  onehot = jnp.arange(t)[None, :] == last[:, None]
  return jnp.where(onehot & m.any(-1, keepdims=True), rewards[:, None], 0.0).astype(_F32)
