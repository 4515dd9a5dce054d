"""Per-token log-probabilities (and entropy) without materialising ``[tokens, vocab]`` logits.

``token_logprobs`` maps over chunks of ``chunk_size`` tokens; each chunk computes its logits
``h @ W``, the tempered log-sum-exp and the target's log-prob, under ``jax.checkpoint`` so that
the backward pass recomputes a chunk's logits instead of storing them. Peak memory is then
``chunk_size × vocab`` rather than ``tokens × vocab``, forward and backward. When every token fits
in one chunk there is nothing to trade: the chunk's logits are kept for the backward pass (no
second ``h @ W``, no loop).

Only reductions over the vocabulary are taken (max, ``Σ e^z``, ``Σ e^z·z``, the target's logit by an
iota comparison; on CPU the target's logit is gathered instead, differentiated by the same comparison; "CPU" is
the platform the program is compiled for, ``jaxrl._compile_target.compile_platform``, so a plan for a TPU or GPU
target traces the reduction):
no ``[tokens, vocab]`` log-softmax, probabilities or one-hot is materialised besides the logits themselves
(issue 20: the log-softmax and its gather cost as much as the ``h @ W`` matmul on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl import _compile_target


def _check_temperature(temperature: float) -> None:
  if not isinstance(temperature, (int, float)) or temperature <= 0:
    raise ValueError(f"temperature must be a positive number, got {temperature!r}")


def _logprobs_entropy(logits, targets, temperature):
  """log p(target) and entropy of ``softmax(logits / temperature)`` along the last axis.

  With ``z = logits / T``, ``m = max z``, ``e = exp(z − m)``, ``s = Σ e``: ``lse = m + log s``,
  ``log p(y) = z_y − lse`` and ``H = −Σ p log p = lse − Σ e·z / s``; every term is a reduction over
  the vocabulary, fused with the elementwise work (nothing ``[..., V]`` besides ``z`` is stored).
  """
  scaled = logits.astype(jnp.float32) / temperature  # [..., V]
  m = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))  # [..., 1]; cancels exactly
  e = jnp.exp(scaled - m)  # [..., V]
  s = jnp.sum(e, axis=-1)  # [...]
  lse = m[..., 0] + jnp.log(s)
  entropy = lse - jnp.sum(e * scaled, axis=-1) / s
  targets = targets.astype(jnp.int32)
  if _compile_target.compile_platform() == "cpu":  # the platform compiled for (a plan's target), not the host's
    target_logit = _target_logit(scaled.shape[-1], scaled, targets)
  else:  # fused into the reduction there, and a vocabulary sharded over devices needs no gather
    vocab = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None], scaled, 0.0), axis=-1)
  return target_logit - lse, entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _target_logit(vocab: int, z, targets):
  """``z[..., targets]``: a gather forward, an iota comparison backward (the CPU backend's target logit).

  The forward reads one value per token. ``Σ_v where(v == y, z, 0)`` (what other backends run) is the same
  number, but XLA:CPU's reduction fusions do not take the iota comparison in, so there the select was
  written as a whole ``[tokens, vocab]`` array and read back (issue 34: 6 % of the tiny bench's train step).
  The backward is ``where(v == y, g, 0)``, an elementwise expression fused into the softmax gradient, so no
  ``[tokens, vocab]`` scatter appears (which plain ``take_along_axis`` would differentiate into). On GPU/TPU
  the select fuses into the reduction, and a gather along a vocabulary sharded over ``tensor`` devices
  could make the partitioner gather the logits, so they keep the sum."""
  got = jnp.take_along_axis(z, targets[..., None], axis=-1, mode="clip")[..., 0]
  return jnp.where((targets >= 0) & (targets < vocab), got, jnp.zeros((), z.dtype))  # out of range: 0, as before


def _target_logit_fwd(vocab, z, targets):
  return _target_logit(vocab, z, targets), targets


def _target_logit_bwd(vocab, targets, g):  # z is float32 here (the scaled logits), as g
  ids = jax.lax.broadcasted_iota(jnp.int32, (*targets.shape, vocab), targets.ndim)
  return jnp.where(ids == targets[..., None], g[..., None], jnp.zeros((), g.dtype)), None


_target_logit.defvjp(_target_logit_fwd, _target_logit_bwd)


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
  so no more than ``chunk_size × V`` logits exist at once (a single chunk is neither looped over nor
  rematerialised). The matmul accumulates in float32.

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

  def one_chunk(args):
    hc, yc = args  # [t, D], [t]
    logits = jnp.einsum("td,dv->tv", hc, unembed, preferred_element_type=jnp.float32)  # [t, V]
    return _logprobs_entropy(logits, yc, temperature)

  with jax.named_scope("token_logprobs"):
    logp, entropy = map_token_chunks(one_chunk, (hidden, targets), chunk_size)  # [B, T] each
  if not return_entropy:
    return logp
  return logp, entropy


def map_token_chunks(fn, arrays: tuple[jax.Array, ...], chunk_size: int):
  """``fn`` over chunks of ``chunk_size`` tokens of ``arrays`` (each ``[B, T, ...]``, flattened to tokens and
  zero-padded to whole chunks); ``fn`` maps a tuple of ``[t, ...]`` chunks to a pytree of ``[t]`` arrays, and
  the result is that pytree at ``[B, T]``. Several chunks run under ``lax.map`` with each chunk
  rematerialised (only one chunk's ``[t, V]`` logits live at a time); a single chunk *is* every token, so
  storing its logits costs no more than recomputing them and it runs directly."""
  b, t = arrays[0].shape[:2]
  n = b * t
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n

  def split(x):  # [B, T, ...] -> [C, t, ...]
    x = x.reshape(n, *x.shape[2:])
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(num_chunks, chunk, *x.shape[1:])

  chunks = tuple(split(x) for x in arrays)
  if num_chunks == 1:
    out = jax.tree.map(lambda x: x[None], fn(tuple(c[0] for c in chunks)))  # [1, t] each
  else:
    out = jax.lax.map(jax.checkpoint(fn), chunks)  # [C, t] each
  return jax.tree.map(lambda x: x.reshape(-1)[:n].reshape(b, t), out)


__all__ = ["logprobs_from_logits", "token_logprobs"]
