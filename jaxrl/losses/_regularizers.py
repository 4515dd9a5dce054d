"""Entropy and self-reward regularisers: token entropy, EM-FT / EM-RL, self-certainty, implicit PRM,
entropy-regularised PRM aggregation and Borda voting weights.

Functions over full-vocabulary logits ``[B, T, V]`` work in chunks of ``chunk_size`` positions
(``lax.map`` over chunks, each under ``jax.checkpoint``), so a float32 ``[T, V]`` block is never
materialised at once for long ``T``, in the forward or the backward pass; the float32 upcast happens
per chunk, whatever the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "borda_vote",
    "borda_weights",
    "em_ft_loss",
    "entropy_from_logits",
    "entropy_from_logprobs",
    "entropy_regularized_aggregate",
    "implicit_prm_rewards",
    "implicit_prm_step_rewards",
    "negative_entropy_reward",
    "negative_trajectory_entropy_reward",
    "prime_process_advantages",
    "self_certainty",
    "self_certainty_reward",
]


def _chunked_over_t(fn: Callable[[jax.Array], jax.Array], x: jax.Array, chunk_size: int) -> jax.Array:
  """Applies ``fn: [B, c, V] -> [B, c]`` over chunks of ``c`` positions of ``x [B, T, V]``."""
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
  b, t, _ = x.shape
  if t <= chunk_size:
    return jax.checkpoint(fn)(x)
  n = t // chunk_size
  body = jax.checkpoint(fn)

  def one(i):
    return body(jax.lax.dynamic_slice_in_dim(x, i * chunk_size, chunk_size, axis=1))  # [B, c]

  main = jax.lax.map(one, jnp.arange(n))  # [n, B, c]
  main = jnp.moveaxis(main, 0, 1).reshape(b, n * chunk_size)
  if n * chunk_size == t:
    return main
  rest = body(x[:, n * chunk_size:])
  return jnp.concatenate([main, rest], axis=1)


def _entropy_chunk(logits: jax.Array, temperature: float) -> jax.Array:
  z = logits.astype(jnp.float32) / temperature  # [B, c, V]
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))  # shift: no cancellation in lse - E[z]
  lse = jax.nn.logsumexp(z, axis=-1)
  p = jnp.exp(z - lse[..., None])
  return lse - jnp.sum(p * z, axis=-1)


def entropy_from_logits(
    logits: jax.Array,  # [B, T, V]
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> jax.Array:  # [B, T] float32
  r"""Token entropy of the sampling distribution, chunked over ``T``.

  ``H_t = -Σ_j p_{t,j} log p_{t,j}``, ``p_t = softmax(z_t / τ)``; computed as
  ``logsumexp(z/τ) - Σ_j p_j z_j/τ``.

  Args:
    logits: ``[B, T, V]`` (any float dtype; upcast per chunk).
    temperature: decoding temperature τ.
    chunk_size: positions per chunk.

  Returns:
    ``[B, T]`` float32 entropies (differentiable w.r.t. ``logits``).

  References: seeds 000 "ARPO" eq. 3 (token entropy); Cui et al. 2025 (seeds 003).
  """
  return _chunked_over_t(lambda z: _entropy_chunk(z, temperature), logits, chunk_size)


def entropy_from_logprobs(
    logprobs: jax.Array,  # [B, T, V]
    *,
    chunk_size: int = 1024,
) -> jax.Array:  # [B, T] float32
  r"""Token entropy from full-vocabulary log-probs: ``H_t = -Σ_j exp(l_{t,j}) l_{t,j}``.

  Entries with ``l = -inf`` (zero probability) contribute 0.

  Args:
    logprobs: ``[B, T, V]`` normalised log-probabilities.
    chunk_size: positions per chunk.

  Returns:
    ``[B, T]`` float32.
  """

  def chunk(l):
    l = l.astype(jnp.float32)
    finite = jnp.isfinite(l)
    l = jnp.where(finite, l, 0.0)
    return -jnp.sum(jnp.where(finite, jnp.exp(l) * l, 0.0), axis=-1)

  return _chunked_over_t(chunk, logprobs, chunk_size)


def em_ft_loss(
    *,
    entropy: jax.Array,  # [B, T]
    loss_weights: jax.Array,  # [B, T]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""EM-FT: minimise the token entropy of the model's own samples, ``L = Σ_{b,t} w·H_t``.

  With ``token_mean`` weights this is ``Ĥ_tok``, the mean token entropy over self-generated,
  unlabeled responses (same form as instruction tuning, no labels).

  Args:
    entropy: ``[B, T]`` token entropies (e.g. :func:`entropy_from_logits`, differentiable).
    loss_weights: ``[B, T]`` aggregation weights.

  Returns:
    ``(loss, {"entropy": loss})``.

  References: Agarwal et al. 2025, "The Unreasonable Effectiveness of Entropy Minimization in LLM
  Reasoning" (EM-FT; seeds 003).
  """
  w = jax.lax.stop_gradient(jnp.asarray(loss_weights).astype(jnp.float32))
  h = jnp.where(w != 0, jnp.asarray(entropy).astype(jnp.float32), 0.0)
  loss = jnp.sum(w * h)
  return loss, {"entropy": jax.lax.stop_gradient(loss)}


def _masked_row_sum(values, response_mask, length_normalize):
  mask = jnp.asarray(response_mask).astype(jnp.float32)
  v = jnp.where(mask > 0, jax.lax.stop_gradient(jnp.asarray(values).astype(jnp.float32)), 0.0)
  total = jnp.sum(v * mask, axis=-1)
  if length_normalize:
    n = jnp.sum(mask, axis=-1)
    total = jnp.where(n > 0, total / jnp.maximum(n, 1.0), 0.0)
  return total


def negative_entropy_reward(
    entropy: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    length_normalize: bool = False,
) -> jax.Array:  # [B]
  r"""EM-RL (token level): the reward is the negative summed token entropy, ``r(y) = -Σ_t H_t``.

  Args:
    entropy: ``[B, T]`` token entropies.
    response_mask: ``[B, T]``.
    length_normalize: divide by ``|y|`` (mean token entropy) instead of summing.

  Returns:
    ``[B]`` rewards (stop-gradient).

  References: Agarwal et al. 2025 (EM-RL, ``r = -Ĥ_tok``; seeds 003).
  """
  return -_masked_row_sum(entropy, response_mask, length_normalize)


def negative_trajectory_entropy_reward(
    logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    length_normalize: bool = False,
) -> jax.Array:  # [B]
  r"""EM-RL (trajectory level): ``r(y) = -Ĥ_traj = log π(y) = Σ_t log π(y_t | y_{<t})``.

  ``-log π(y)`` is the one-sample Monte-Carlo estimate of the sequence entropy.

  Args:
    logprobs: ``[B, T]`` sampled-token log-probs.
    response_mask: ``[B, T]``.
    length_normalize: divide by ``|y|``.

  Returns:
    ``[B]`` rewards (stop-gradient).

  References: Agarwal et al. 2025 (EM-RL, ``r = -Ĥ_traj``; seeds 003).
  """
  return _masked_row_sum(logprobs, response_mask, length_normalize)


def self_certainty(
    logits: jax.Array,  # [B, T, V]
    *,
    chunk_size: int = 1024,
) -> jax.Array:  # [B, T] float32
  r"""Per-token self-certainty ``KL(U ‖ p_t) = -1/|V| Σ_j log(|V| p_{t,j})``.

  Computed as ``logsumexp(z) - mean_j z_j - log |V|`` (≥ 0; 0 for a uniform distribution).

  Args:
    logits: ``[B, T, V]``.
    chunk_size: positions per chunk.

  Returns:
    ``[B, T]`` float32.

  References: Kang et al. 2025, "Scalable Best-of-N Selection via Self-Certainty"; Zhao et al. 2025,
  "Learning to Reason without External Rewards" (Intuitor); seeds 003.
  """
  v = logits.shape[-1]

  def chunk(z):
    z = z.astype(jnp.float32)
    return jax.nn.logsumexp(z, axis=-1) - jnp.mean(z, axis=-1) - jnp.log(float(v))

  return _chunked_over_t(chunk, logits, chunk_size)


def self_certainty_reward(
    logits: jax.Array,  # [B, T, V]
    response_mask: jax.Array,  # [B, T]
    *,
    chunk_size: int = 1024,
) -> jax.Array:  # [B]
  r"""Intuitor's reward: ``Self-certainty(o|q) = 1/|o| Σ_i KL(U ‖ p_π(·|q, o_{<i}))``.

  Args:
    logits: ``[B, T, V]`` logits at the response positions.
    response_mask: ``[B, T]``.
    chunk_size: positions per chunk.

  Returns:
    ``[B]`` rewards (stop-gradient; 0 for empty responses).

  References: Zhao et al. 2025, "Learning to Reason without External Rewards" (seeds 003).
  """
  return _masked_row_sum(self_certainty(logits, chunk_size=chunk_size), response_mask, True)


def implicit_prm_rewards(
    logprobs: jax.Array,  # [B, T]
    ref_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    beta: float,
) -> jax.Array:  # [B, T]
  r"""Implicit process reward of each token: ``q_t = β log π_θ(y_t|y_{<t}) / π_ref(y_t|y_{<t})``.

  ``π_θ`` is a DPO/outcome-trained model; no process labels are needed.

  Args:
    logprobs: ``[B, T]`` log π_θ.
    ref_logprobs: ``[B, T]`` log π_ref.
    response_mask: ``[B, T]``.
    beta: β of the implicit reward model.

  Returns:
    ``[B, T]`` token rewards (stop-gradient, 0 off the mask).

  References: Yuan et al. 2024, "Free Process Rewards without Process Labels" (seeds 003).
  """
  mask = jnp.asarray(response_mask).astype(jnp.float32)
  sg = jax.lax.stop_gradient
  lp = jnp.where(mask > 0, sg(jnp.asarray(logprobs).astype(jnp.float32)), 0.0)
  ref = jnp.where(mask > 0, sg(jnp.asarray(ref_logprobs).astype(jnp.float32)), 0.0)
  return beta * (lp - ref) * mask


def implicit_prm_step_rewards(
    token_rewards: jax.Array,  # [B, T]
    step_ids: jax.Array,  # [B, T] int: 0 = no step, 1..num_steps
    *,
    num_steps: int,
) -> jax.Array:  # [B, num_steps]
  r"""Sums token rewards into step rewards: ``r_k = Σ_{t ∈ step k} q_t``.

  This is the difference of the cumulative implicit Q value across step boundaries. Best-of-N
  selection uses the minimum step reward (``jnp.min`` over present steps).

  Args:
    token_rewards: ``[B, T]`` from :func:`implicit_prm_rewards`.
    step_ids: ``[B, T]`` step index per token, 0 for tokens outside any step.
    num_steps: static maximum number of steps.

  Returns:
    ``[B, num_steps]`` (steps absent from a row get 0).
  """
  ids = jnp.asarray(step_ids, jnp.int32)
  r = jnp.asarray(token_rewards).astype(jnp.float32)
  per_row = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=num_steps + 1))(r, ids)
  return per_row[:, 1:]


def prime_process_advantages(
    process_rewards: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    group_ids: jax.Array,  # [B] int
    *,
    num_groups: int,
) -> jax.Array:  # [B, T]
  r"""PRIME's process advantage: the return-to-go of leave-one-out-baselined dense process rewards.

  For a group of ``K`` responses to one prompt, with dense rewards ``r_{i,t}`` on response ``i``'s tokens
  (``|y_i|`` of them) and its mean ``\bar r_i = Σ_t r_{i,t} / |y_i|``:

  .. math::

      \tilde r_{i,t} = \frac{K}{K-1} r_{i,t} - \frac{1}{K-1} \sum_{j=1}^{K} \bar r_j, \qquad
      A^{proc}_{i,t} = \sum_{s \ge t} \tilde r_{i,s} \quad (\gamma = 1)

  This is the PRIME team's ``masked_rloo`` on ``rm_scores`` followed by the reversed cumulative sum
  (verl ``recipe/prime/prime_core_algos.py``, ``compute_rloo_advantage_return``); the paper writes the
  baseline as ``r_{i,t} − 1/(K−1) Σ_{j≠i} \bar r_j``, which differs from ``\tilde r_{i,t}`` by
  ``(r_{i,t} − \bar r_i)/(K−1)``, a term that sums to 0 over the response (so ``A^{proc}_{i,0}`` is the same).
  PRIME adds it to the outcome's leave-one-out advantage (the same formula with the outcome reward on the
  last token), i.e. ``A = A^{proc} + A^{outcome}``; the caller adds it to any outcome estimator's advantage.
  Groups of one response get 0 (no leave-one-out baseline); a response with no tokens counts in ``K``
  with ``\bar r = 0``.

  Args:
    process_rewards: ``[B, T]`` dense rewards (e.g. step rewards of :func:`implicit_prm_step_rewards` at each
      step's last token, or the token rewards of :func:`implicit_prm_rewards`).
    response_mask: ``[B, T]`` response tokens.
    group_ids: ``[B]`` prompt group of each response, in ``[0, num_groups)``.
    num_groups: static number of groups.

  Returns:
    ``[B, T]`` float32 process advantages (0 off the mask).

  References: Cui et al. 2025, "Process Reinforcement through Implicit Rewards" (arXiv 2502.01456), §3.3.
  """
  mask = jnp.asarray(response_mask) > 0
  r = jnp.where(mask, jnp.asarray(process_rewards, jnp.float32), 0.0)  # [B, T]
  g = jnp.asarray(group_ids, jnp.int32)
  mean = r.sum(-1) / jnp.maximum(mask.sum(-1), 1)  # [B]
  k = jax.ops.segment_sum(jnp.ones_like(mean), g, num_segments=num_groups)[g]  # [B] group size
  total = jax.ops.segment_sum(mean, g, num_segments=num_groups)[g]  # [B] Σ_j mean_j
  km1 = jnp.maximum(k - 1.0, 1.0)
  tilde = jnp.where(mask & (k > 1)[:, None], r * (k / km1)[:, None] - (total / km1)[:, None], 0.0)
  return jnp.where(mask, jnp.flip(jnp.cumsum(jnp.flip(tilde, -1), -1), -1), 0.0)


def entropy_regularized_aggregate(
    rewards: jax.Array,  # [..., N]
    *,
    eta: float,
    probs: jax.Array | None = None,  # [..., N]
    mask: jax.Array | None = None,  # [..., N]
) -> jax.Array:  # [...]
  r"""Entropy-regularised aggregation of rollout rewards: ``f(η) = ln(Σ_i p_i exp(η r_i)) / η``.

  Monotone in η, from the soft label ``Σ_i p_i r_i`` (η → 0) to the hard label ``max_i r_i``
  (η → ∞). Computed with ``logsumexp``; ``η = 0`` returns the ``p``-weighted mean exactly.

  Args:
    rewards: ``[..., N]`` rewards of ``N`` rollouts from one step.
    eta: η.
    probs: ``[..., N]`` probabilities ``p_i`` (normalised over valid entries); default uniform.
    mask: ``[..., N]`` valid rollouts (default all).

  Returns:
    ``[...]`` aggregated reward (0 where no rollout is valid).

  References: Zhang et al. 2024, "Entropy-Regularized Process Reward Model" (seeds 003).
  """
  r = jnp.asarray(rewards).astype(jnp.float32)
  valid = jnp.ones(r.shape, bool) if mask is None else jnp.asarray(mask) > 0
  p = jnp.ones_like(r) if probs is None else jnp.asarray(probs).astype(jnp.float32)
  p = jnp.where(valid, p, 0.0)
  total = jnp.sum(p, axis=-1, keepdims=True)
  p = jnp.where(total > 0, p / jnp.where(total > 0, total, 1.0), 0.0)
  any_valid = jnp.any(valid & (p > 0), axis=-1)
  r = jnp.where(valid, r, 0.0)
  if eta == 0:
    return jnp.sum(p * r, axis=-1)
  logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
  lse = jax.nn.logsumexp(jnp.where(p > 0, logp + eta * r, -jnp.inf), axis=-1)
  return jnp.where(any_valid, lse / eta, 0.0)


def borda_weights(
    ranks: jax.Array,  # [N] int, 1 = best
    *,
    num_candidates: int | None = None,
    p: float = 1.0,
) -> jax.Array:  # [N] float32
  r"""Borda voting weights ``v(r) = (N - r + 1)^p`` for 1-based ranks (``p = 1``, ``N = 6``: 6…1).

  Args:
    ranks: ``[..., N]`` 1-based ranks.
    num_candidates: ``N`` (default: the last axis of ``ranks``).
    p: exponent.

  Returns:
    Weights with the shape of ``ranks``.

  References: seeds 003 ("Borda Voting"), as used with self-certainty ranking (Kang et al. 2025).
  """
  ranks = jnp.asarray(ranks).astype(jnp.float32)
  n = ranks.shape[-1] if num_candidates is None else num_candidates
  return jnp.power(jnp.maximum(n - ranks + 1.0, 0.0), p)


def borda_vote(
    answer_ids: jax.Array,  # [N] int in [0, num_answers)
    ranks: jax.Array,  # [N] int, 1 = best
    *,
    num_answers: int,
    p: float = 1.0,
) -> jax.Array:  # [num_answers]
  r"""Borda vote: each distinct answer scores ``Σ_{i: a_i = a} v(rank_i)``; pick the argmax.

  Args:
    answer_ids: ``[N]`` index of each sample's (clustered) final answer.
    ranks: ``[N]`` 1-based rank of each sample (e.g. by self-certainty).
    num_answers: static number of answer slots.
    p: Borda exponent.

  Returns:
    ``[num_answers]`` scores.
  """
  w = borda_weights(ranks, p=p)
  return jax.ops.segment_sum(w, jnp.asarray(answer_ids, jnp.int32), num_segments=num_answers)
