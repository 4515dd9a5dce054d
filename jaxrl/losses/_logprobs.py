"""Per-token log-probabilities (and entropy) without materialising ``[tokens, vocab]`` logits.

``token_logprobs`` maps over chunks of ``chunk_size`` tokens; each chunk computes its logits
``h @ W``, the tempered log-softmax and the target's log-prob, under ``jax.checkpoint`` so that
the backward pass recomputes a chunk's logits instead of storing them. Peak memory is then
``chunk_size × vocab`` rather than ``tokens × vocab``, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_temperature(temperature: float) -> None:
  if not isinstance(temperature, (int, float)) or temperature <= 0:
    raise ValueError(f"temperature must be a positive number, got {temperature!r}")


def _logprobs_entropy(logits, targets, temperature):
  """log p(target) and entropy of ``softmax(logits / temperature)`` along the last axis."""
  scaled = logits.astype(jnp.float32) / temperature  # [..., V]
  logp = jax.nn.log_softmax(scaled, axis=-1)  # [..., V]
  target_logp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return target_logp, entropy


def logprobs_from_logits(
    logits: jax.Array,  # [..., V]
    targets: jax.Array,  # [...]
    temperature: float = 1.0,
) -> jax.Array:
  """Log-probability of ``targets`` under ``log_softmax(logits / temperature)``, in float32.

  ``logp[...] = log_softmax(logits / T)[..., targets]``; the RL trainer uses the same
  temperature as the sampler so that recomputed log-probs match the behaviour policy's.

  Args:
    logits: [..., V] logits (any float dtype; upcast to float32).
    targets: [...] int target ids.
    temperature: T > 0.

  Returns:
    [...] float32 log-probabilities.
  """
  _check_temperature(temperature)
  return _logprobs_entropy(logits, targets, temperature)[0]


def token_logprobs(
    hidden: jax.Array,  # [B, T, D]
    unembed: jax.Array,  # [D, V]
    targets: jax.Array,  # [B, T]
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Chunked ``log_softmax((hidden @ unembed) / T)[targets]`` (and entropy), float32.

  ``logp[b, t] = (h W / T)[y] - logsumexp(h W / T)`` and
  ``H[b, t] = -Σ_v p_v log p_v`` with ``p = softmax(h W / T)``, for ``h = hidden[b, t]`` and
  ``y = targets[b, t]``. Tokens are flattened, padded to a multiple of ``chunk_size`` and mapped
  over with ``lax.map``; each chunk is rematerialised in the backward pass (``jax.checkpoint``),
  so no more than ``chunk_size × V`` logits exist at once. The matmul accumulates in float32.

  Args:
    hidden: [B, T, D] final hidden states (after the final norm).
    unembed: [D, V] output projection (``embedding.T`` for tied embeddings).
    targets: [B, T] int target token ids.
    chunk_size: tokens per chunk (static).
    temperature: T > 0, the sampling temperature.
    return_entropy: also return the entropy.

  Returns:
    ``logp`` [B, T] float32, or ``(logp, entropy)`` with ``return_entropy``.
  """
  _check_temperature(temperature)
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
  b, t, d = hidden.shape
  n = b * t
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n
  h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(num_chunks, chunk, d)  # [C, t, D]
  y = jnp.pad(targets.reshape(n), (0, pad)).reshape(num_chunks, chunk)  # [C, t]

  @jax.checkpoint
  def one_chunk(args):
    hc, yc = args  # [t, D], [t]
    logits = jnp.einsum("td,dv->tv", hc, unembed, preferred_element_type=jnp.float32)  # [t, V]
    return _logprobs_entropy(logits, yc, temperature)

  with jax.named_scope("token_logprobs"):
    logp, entropy = jax.lax.map(one_chunk, (h, y))  # [C, t] each
  logp = logp.reshape(-1)[:n].reshape(b, t)
  if not return_entropy:
    return logp
  return logp, entropy.reshape(-1)[:n].reshape(b, t)


__all__ = ["logprobs_from_logits", "token_logprobs"]
