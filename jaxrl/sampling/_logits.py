"""Per-row sampling from logits: temperature, top-k, top-p, min-p, with both log-prob conventions.

Every parameter is a ``[R]`` array, so changing temperatures or truncation settings never recompiles.
Top-k and top-p thresholds are found by bisection over the float32 bit patterns (32 passes over the
vocabulary, no sort): the kept set is ``{v : logit_v >= threshold}``, exact up to ties at the
threshold, which are all kept.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_BISECT_STEPS = 32  # uint32 search space: 2^32 values, one bit per step


class Sampled(NamedTuple):
  """One sampled token per row and its log-probabilities."""

  tokens: jax.Array  # [R] int32
  logprobs: jax.Array  # [R] float32: log_softmax(logits / T)[token], no truncation (T = 1 when greedy)
  sampling_logprobs: jax.Array  # [R] float32: log-prob under the truncated, renormalised distribution


def _sortable(x: jax.Array) -> jax.Array:  # float32 [...] -> uint32 [...], same order
  """Maps float32 to uint32 preserving order (``-inf`` lowest), so bisection works on integers."""
  i = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _bisect(keys: jax.Array, ok) -> jax.Array:  # [R, V] uint32 -> [R] uint32
  """Largest ``t`` per row with ``ok(keys >= t)`` true, given ``ok`` is monotone and true at the row min."""
  lo = jnp.min(keys, axis=-1)
  hi = jnp.max(keys, axis=-1)

  def body(_, carry):
    lo, hi = carry
    gap = hi - lo
    mid = lo + gap // 2 + gap % 2  # upper midpoint, no uint32 overflow
    good = ok(keys >= mid[:, None]) & (gap > 0)
    return jnp.where(good, mid, lo), jnp.where(good, hi, jnp.where(gap > 0, mid - 1, hi))

  lo, _ = lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
  return lo


def truncation_mask(
    scaled: jax.Array,  # [R, V] float32: logits / T
    *,
    top_k: jax.Array,  # [R] int32, 0 = off
    top_p: jax.Array,  # [R] float32, 1 = off
    min_p: jax.Array,  # [R] float32, 0 = off
) -> jax.Array:  # [R, V] bool
  """Tokens kept by top-k, then top-p on the top-k-renormalised distribution, then min-p.

  With ``p = softmax(scaled)``: top-k keeps ``p_v >= p_(k)`` (the k-th largest); top-p keeps the
  smallest high-probability set whose mass reaches ``top_p`` of the top-k mass (the token that crosses
  the threshold included); min-p keeps ``p_v >= min_p · max_v p_v`` (Nguyen et al. 2024). A row whose
  parameters are all off keeps every token. Each filter is skipped (``lax.cond``) when no row uses it.

  Args:
    scaled: temperature-scaled logits ``[R, V]``.
    top_k: ``[R]``; ``0`` or ``>= V`` keeps all.
    top_p: ``[R]`` in ``(0, 1]``.
    min_p: ``[R]`` in ``[0, 1]``.

  Returns:
    ``[R, V]`` bool mask; every row keeps at least its most likely token.
  """
  scaled = scaled.astype(jnp.float32)
  r, v = scaled.shape
  keys = _sortable(scaled)
  top_k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k).astype(jnp.int32)

  def kth_threshold(keys):
    return _bisect(keys, lambda kept: jnp.sum(kept, axis=-1, dtype=jnp.int32) >= top_k)

  no_k = jnp.zeros((r,), jnp.uint32)
  t_k = lax.cond(jnp.any(top_k < v), kth_threshold, lambda keys: no_k, keys)
  k_mask = keys >= t_k[:, None]

  probs = jax.nn.softmax(scaled, axis=-1)
  k_probs = jnp.where(k_mask, probs, 0.0)
  k_mass = jnp.sum(k_probs, axis=-1)
  target = top_p.astype(jnp.float32) * k_mass

  def nucleus_threshold(keys):
    return _bisect(keys, lambda kept: jnp.sum(jnp.where(kept, k_probs, 0.0), axis=-1) >= target)

  t_p = lax.cond(jnp.any(top_p < 1.0), nucleus_threshold, lambda keys: no_k, keys)
  t_p = jnp.where(top_p < 1.0, t_p, jnp.uint32(0))
  mask = k_mask & (keys >= t_p[:, None])
  p_max = jnp.max(probs, axis=-1, keepdims=True)
  mask &= probs >= min_p.astype(jnp.float32)[:, None] * p_max
  return mask | (keys == jnp.max(keys, axis=-1, keepdims=True))


def _first_argmax(x: jax.Array) -> jax.Array:  # [R, V] float32 -> [R] int32
  """``argmax`` (first maximal index) as two plain reductions: XLA:CPU runs its variadic
  (value, index) reduction several times slower than a max and a min."""
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.minimum(jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1), x.shape[-1] - 1)  # NaN rows: V - 1


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:  # [R, V] >= 0, [R] in [0, 1) -> [R] int32
  """Inverse-CDF draw: the last token ``v`` with ``p_v > 0`` and ``Σ_{w<v} p_w <= u · Σ_w p_w``.

  Exact categorical sampling from ``probs / Σ probs`` with one uniform per row, in two levels of
  about ``sqrt(V)`` (block sums, then the chosen block) so no long sequential scan is needed; the
  prefix sums are matmuls with a triangular matrix at full float32 precision. A token with
  ``p_v = 0`` is never chosen, whatever the rounding, as long as the row has positive mass.
  """
  r, v = probs.shape
  b = max(1, math.isqrt(v - 1) + 1)  # block size: ceil(sqrt(V))
  nb = -(-v // b)
  p = jnp.pad(probs, ((0, 0), (0, nb * b - v))).reshape(r, nb, b)
  hi = lax.Precision.HIGHEST

  def last_fit(mass, target):  # [R, N] >= 0, [R] -> [R] int32: last j with mass_j > 0, prefix_j <= target
    n = mass.shape[-1]
    strict_upper = jnp.triu(jnp.ones((n, n), jnp.float32), k=1)
    before = jnp.einsum("rj,jk->rk", mass, strict_upper, precision=hi)  # Σ_{i<k} mass_i
    iota = lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    ok = (mass > 0) & (before <= target[:, None])
    return jnp.max(jnp.where(ok, iota, 0), axis=-1), before

  block_mass = jnp.sum(p, axis=-1)  # [R, NB]
  target = u * jnp.sum(block_mass, axis=-1)
  blk, before = last_fit(block_mass, target)
  rest = target - jnp.take_along_axis(before, blk[:, None], axis=1)[:, 0]
  inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [R, B]
  j, _ = last_fit(inner, jnp.maximum(rest, 0.0))
  return blk * b + j


def _uses_filters(top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, vocab: int) -> jax.Array:  # -> [] bool
  return jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0.0))


def sample_logits(
    logits: jax.Array,  # [R, V] float32
    keys: jax.Array,  # [R] PRNG keys
    *,
    temperature: jax.Array,  # [R] float32, 0 = greedy
    top_k: jax.Array,  # [R] int32
    top_p: jax.Array,  # [R] float32
    min_p: jax.Array,  # [R] float32
) -> Sampled:
  """Samples one token per row from ``softmax(logits / T)`` restricted by :func:`truncation_mask`.

  Sampling is by inverse CDF with one uniform ``u ~ U[0, 1)`` drawn from the row's own key, so a
  row's draw depends only on its logits, parameters and key (same seed, request and step → same
  token), not on the other rows. ``T = 0`` rows take the argmax. The truncation work is skipped
  (``lax.cond``) when no row sets top-k, top-p or min-p, and all sampling when every row is greedy,
  so an unfiltered temperature-1 step costs a softmax and a few reductions over the logits.

  Log-prob conventions:
    * ``logprobs = log_softmax(logits / T)[token]`` — the full, untruncated distribution at the
      sampling temperature (``T = 1`` for greedy rows): what a trainer recomputes from a forward pass.
    * ``sampling_logprobs = log_softmax(masked(logits / T))[token]`` — under the truncated,
      renormalised distribution actually sampled from (0 for greedy rows, a point mass).

  Args:
    logits: ``[R, V]`` raw logits.
    keys: ``[R]`` typed PRNG keys, one per row.
    temperature, top_k, top_p, min_p: ``[R]`` per-row parameters (see :func:`truncation_mask`).

  Returns:
    :class:`Sampled` with ``[R]`` tokens, logprobs and sampling_logprobs.
  """
  logits = logits.astype(jnp.float32)
  v = logits.shape[-1]
  greedy = temperature <= 0.0
  t_eff = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
  scaled = logits / t_eff[:, None]  # [R, V]
  lse = jax.nn.logsumexp(scaled, axis=-1)  # [R]
  argmax = _first_argmax(scaled)

  def draw(_):
    def truncate(scaled):
      mask = truncation_mask(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
      masked = jnp.where(mask, scaled, -jnp.inf)
      return masked, jax.nn.logsumexp(masked, axis=-1)

    masked, masked_lse = lax.cond(_uses_filters(top_k, top_p, min_p, v), truncate, lambda s: (s, lse), scaled)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # [R]
    token = _inverse_cdf(jnp.exp(masked - masked_lse[:, None]), u)
    token = jnp.where(greedy, argmax, token)
    picked = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return token, jnp.where(greedy, 0.0, picked - masked_lse)

  def all_greedy(_):
    return argmax, jnp.zeros(argmax.shape, jnp.float32)

  token, sampling_lp = lax.cond(jnp.all(greedy), all_greedy, draw, None)
  lp = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0] - lse
  return Sampled(tokens=token, logprobs=lp, sampling_logprobs=sampling_lp)


def entropy(logits: jax.Array, temperature: jax.Array) -> jax.Array:  # [R, V], [R] -> [R] float32
  """``-Σ_v p_v log p_v`` of ``softmax(logits / T)`` (``T = 1`` where ``T = 0``), untruncated."""
  t_eff = jnp.where(temperature <= 0.0, 1.0, temperature).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32) / t_eff[:, None], axis=-1)
  return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def top_logprobs(logits: jax.Array, temperature: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The ``k`` most likely tokens of ``log_softmax(logits / T)``: ids ``[R, k]`` int32, values ``[R, k]``."""
  t_eff = jnp.where(temperature <= 0.0, 1.0, temperature).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32) / t_eff[:, None], axis=-1)
  values, ids = lax.top_k(log_probs, k)
  return ids.astype(jnp.int32), values
