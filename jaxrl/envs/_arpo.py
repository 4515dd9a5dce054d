"""ARPO's entropy-based adaptive rollout: the branching rule and the shared-prefix encoding.

Notes 000 §ARPO ("Entropy-based Adaptive Rollout"), Dong et al. 2025 (arXiv 2507.19849):

1. *Initialisation*: of the global budget ``M`` trajectories per question, ``N`` are sampled at the
   trajectory level; the entropies of the first ``k`` tokens of each form ``H_initial``.
2. *Entropy monitoring*: after each tool call the policy generates ``k`` more tokens; their entropies
   ``H_t`` give ``ΔH_t = Normalize(H_t − H_initial)``. The notes define the normalisation as the sum
   of the ``k`` differences divided by the vocabulary size ``V`` (``normalize="vocab"``);
   ``normalize="mean"`` divides by the number of tokens instead.
3. *Adaptive branching*: ``P_t = α + β·ΔH_t``; if ``P_t > τ`` the path branches into ``Z`` partial
   paths (the rollout driver forks the sampler state after the ``k`` probe tokens, so the branches
   share the prefix, probe tokens included), while the branch budget ``M − N`` lasts.
4. *Termination*: when the ``M − N`` branches are spent no path branches again; if every path ends
   first, ``M − N − Ẑ`` trajectory-level samples top the group up to exactly ``M``.

With ``α = β = 0`` (and ``τ >= 0``) no path ever branches and the ``M − N`` top-ups make the group
``M`` independent trajectories: plain trajectory-level GRPO sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArpoConfig:
  """ARPO rollout settings (``arpo:`` section). ``M`` is ``rollout.n``."""

  initial_samples: int = 8
  "``N``: trajectory-level samples per question; ``M − N`` is the branch budget."
  entropy_tokens: int = 8
  "``k``: tokens whose entropies are compared (first tokens of the episode, first tokens after a tool call)."
  alpha: float = 0.5
  "``α``: base branching probability (notes: 0.5)."
  beta: float = 0.2
  "``β``: entropy weight (notes: 0.2)."
  threshold: float = 0.5
  "``τ``: branch when ``P_t > τ`` (notes: 0.5)."
  branches: int = 2
  "``Z``: partial paths opened per branching step (fewer when the budget is nearly spent)."
  normalize: Literal["vocab", "mean"] = "vocab"
  "``ΔH`` normalisation: sum of differences / vocabulary size (notes) or their mean."

  def __post_init__(self):
    for name in ("initial_samples", "entropy_tokens", "branches"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"arpo.{name} must be a positive int, got {v!r}")
    for name in ("alpha", "beta", "threshold"):
      if not np.isfinite(getattr(self, name)):
        raise ValueError(f"arpo.{name} must be finite, got {getattr(self, name)!r}")
    if self.normalize not in ("vocab", "mean"):
      raise ValueError(f"arpo.normalize must be 'vocab' or 'mean', got {self.normalize!r}")


def entropy_delta(h_t: np.ndarray, h_init: np.ndarray, *, vocab_size: int, normalize: str = "vocab") -> float:
  """``ΔH_t = Normalize(H_t − H_initial)`` over the first ``min(len(h_t), len(h_init))`` tokens.

  Args:
    h_t: ``[k_t]`` entropies of the tokens after a tool call.
    h_init: ``[k_0]`` entropies of the episode's first tokens.
    vocab_size: ``V``.
    normalize: ``"vocab"``: ``Σ (H_t − H_init) / V`` (notes); ``"mean"``: the mean difference.

  Example:
    >>> entropy_delta(np.array([2.0, 3.0]), np.array([1.0, 1.0]), vocab_size=100)
    0.03
  """
  k = min(len(h_t), len(h_init))
  if k == 0:
    return 0.0
  d = np.asarray(h_t[:k], np.float64) - np.asarray(h_init[:k], np.float64)
  return float(d.sum() / (vocab_size if normalize == "vocab" else k))


def branch_probability(delta: float, *, alpha: float, beta: float) -> float:
  """``P_t = α + β · ΔH_t``."""
  return alpha + beta * delta


def shared_prefix_ids(parents: Sequence[int | None], branch_pos: Sequence[int], lengths: Sequence[int], *,
                      width: int, first_id: int = 0) -> tuple[np.ndarray, int]:
  """``prefix_ids [B, width]`` of one group's tree for :func:`jaxrl.losses.arpo_hard` / ``arpo_soft``.

  Trajectory ``i`` branched from ``parents[i]`` (``None``: a root) and shares its first
  ``branch_pos[i]`` response tokens with it. Two trajectories share token ``t`` iff their common
  prefix, the smallest branch position on the tree path between them, exceeds ``t``. A shared token
  gets the id of its tree node (the set of trajectories through it); an unshared one ``-1``.

  Returns:
    ``(prefix_ids, next_id)``: int32 ids in ``[first_id, next_id)``.
  """
  b = len(parents)
  anc: list[dict[int, int]] = []  # i -> {ancestor a: common prefix of i and a}
  for i in range(b):
    chain, x, lcp = {i: int(lengths[i])}, i, int(lengths[i])
    while parents[x] is not None:
      lcp = min(lcp, int(branch_pos[x]))
      x = int(parents[x])
      chain[x] = lcp
    anc.append(chain)

  def common(i: int, j: int) -> int:
    best = 0
    for a, li in anc[i].items():
      if a in anc[j]:
        best = max(best, min(li, anc[j][a]))
    return best

  lcp = np.zeros((b, b), np.int64)
  for i in range(b):
    for j in range(b):
      lcp[i, j] = int(lengths[i]) if i == j else common(i, j)
  ids = np.full((b, width), -1, np.int32)
  nodes: dict[tuple[int, ...], int] = {}
  for i in range(b):
    for t in range(int(lengths[i])):
      members = tuple(j for j in range(b) if lcp[i, j] > t)
      if len(members) > 1:
        ids[i, t] = nodes.setdefault(members, first_id + len(nodes))
  return ids, first_id + len(nodes)
