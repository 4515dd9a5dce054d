"""Semantic and tree advantages: SEED-GRPO (semantic-entropy scaling) and ARPO (shared-prefix
attribution). Conventions: :mod:`jaxrl.losses._advantages`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.losses._adv_base import (
    Metrics,
    _F32,
    _Groups,
    _broadcast,
    _degenerate_fraction,
    _finish,
    _grpo_sequence,
    _make_groups,
    _psum,
    _rewards,
    _safe_div,
    register_advantage,
)


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
