"""Token-level whitening over the global batch: AReaL's global normalisation, REINFORCE++ and
REINFORCE++-baseline. Conventions: :mod:`jaxrl.losses._advantages`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._adv_base import (
    Metrics,
    Moments,
    _F32,
    _Groups,
    _broadcast,
    _check_level,
    _degenerate_fraction,
    _finish,
    _grpo_sequence,
    _make_groups,
    _outcome_tokens,
    _pmax,
    _pmin,
    _psum,
    _rewards,
    _safe_div,
    _unbias,
    register_advantage,
)


# ----------------------------------------------------------------------------------------------------
# Token-level whitening (REINFORCE++, AReaL global normalisation).


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
                      groups: _Groups | None, unbiased_std: bool = False):
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
      b_mean = jnp.asarray(global_moments.mean, _F32)
      b_var = _safe_div(jnp.asarray(global_moments.m2, _F32), count)
      b_degenerate = b_var <= 0.0
    if unbiased_std:
      b_var = _unbias(b_var, count)
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
    if unbiased_std:
      g_var = _unbias(g_var, g_count)
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
    response_mask: jax.Array,  # [B, T]
    rewards: jax.Array | None = None,  # [B]
    group_ids: jax.Array | None = None,  # [B] int; needed only for group levels
    advantages: jax.Array | None = None,  # [B, T]
    mean_level: str = "batch",
    std_level: str = "batch",
    eps: float = 1e-6,
    unbiased_std: bool = False,
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
    response_mask: ``[B, T]``.
    rewards: ``[B]``; used as token advantages when ``advantages`` is None (one of the two is needed).
    group_ids: ``[B]`` int, required for ``"group"`` levels.
    advantages: ``[B, T]`` advantages to normalise (e.g. from :func:`gae`); ``rewards`` is then unused.
    mean_level, std_level: ``"batch" | "group" | "none"``.
    eps: added to the std.
    unbiased_std: divide ``M2`` by the token count minus one (verl's ``masked_whiten``) instead of
      the count.
    global_moments: precomputed batch moments of the token advantages.
    num_groups, sample_mask, axis_name: as in :func:`grpo`.

  Returns:
    ``(advantages [B, T] float32, metrics)``; all-equal inputs (at the levels used) give 0.

  References:
    Fu et al. 2025, AReaL, appendix A.1 (notes 000 §AReaL, ~986 and ~1305).
  """
  if advantages is None and rewards is None:
    raise ValueError("global_normalize needs rewards or advantages")
  x = _broadcast(_rewards(rewards), response_mask) if advantages is None else (
      jnp.asarray(advantages).astype(_F32))
  groups = None
  if "group" in (mean_level, std_level):
    groups = _make_groups(group_ids, response_mask, sample_mask, num_groups, axis_name)
  elif sample_mask is not None:  # batch levels only: group ids play no part
    groups = _make_groups(jnp.zeros(response_mask.shape[0], jnp.int32), response_mask, sample_mask, 1,
                          axis_name)
  out = _normalize_tokens(x, response_mask, mean_level=mean_level, std_level=std_level, eps=eps,
                          axis_name=axis_name, global_moments=global_moments, groups=groups,
                          unbiased_std=unbiased_std)
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
    unbiased_std: bool = False,
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
    unbiased_std: ddof-1 token std, as verl's ``masked_whiten`` (default: population std).
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
                          axis_name=axis_name, global_moments=global_moments, groups=groups,
                          unbiased_std=unbiased_std)
  return _finish(out, response_mask, axis_name)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(
    *,
    rewards: jax.Array,  # [B]
    group_ids: jax.Array,  # [B] int
    response_mask: jax.Array,  # [B, T]
    eps: float = 1e-6,
    unbiased_std: bool = False,
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
    unbiased_std: ddof-1 token std, as verl's ``masked_whiten`` (default: population std).
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
                          axis_name=axis_name, global_moments=global_moments, groups=groups,
                          unbiased_std=unbiased_std)
  return _finish(out, response_mask, axis_name, degenerate_group_fraction=_degenerate_fraction(gs))
