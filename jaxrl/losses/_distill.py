"""Distillation from a teacher policy: GKD's generalised Jensen–Shannon divergence and the per-token
reverse-KL advantage of on-policy distillation.

Two ways to pull a student ``S`` towards a teacher ``T`` on sequences the student sampled:

* **GKD** (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes", ICLR; TRL ``GKDTrainer``): at every response position, a divergence between the student's and
  the teacher's full next-token distributions, differentiated through the student's logits
  (:func:`generalized_jsd`, :func:`generalized_jsd_loss`, and :func:`token_generalized_jsd` from hidden states
  without materialising ``[tokens, vocab]`` logits).
* **On-policy distillation** (Thinking Machines, "On-Policy Distillation", 2025; the Qwen3 technical report's
  small models): the per-token advantage ``A_t = −(log S(y_t) − log T(y_t))`` of the *sampled* tokens, the
  single-sample estimate of the negative reverse KL, fed to the ordinary policy-gradient loss
  (:func:`reverse_kl_advantages`). Needs the teacher's log-probs of the sampled tokens only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._aggregate import loss_weights as _loss_weights
from jaxrl.losses._logprobs import map_token_chunks

__all__ = ["generalized_jsd", "generalized_jsd_loss", "reverse_kl_advantages", "token_generalized_jsd"]


def _check(beta: float, temperature: float) -> None:
  if not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
    raise ValueError(f"generalized_jsd: beta must be a number in [0, 1], got {beta!r}")
  if not isinstance(temperature, (int, float)) or temperature <= 0:
    raise ValueError(f"generalized_jsd: temperature must be a positive number, got {temperature!r}")


def _upcast(x: jax.Array) -> jax.Array:
  """``x`` in float32, or wider when it already is (float64 references)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """``KL(p‖q) = Σ_v p_v (log p_v − log q_v)`` along the last axis (``p_v = 0`` terms are 0)."""
  p = jnp.exp(log_p)
  return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def generalized_jsd(
    student_logits: jax.Array,  # [..., V]
    teacher_logits: jax.Array,  # [..., V]
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> jax.Array:  # [...] float32
  """Per-position generalised JSD of GKD between tempered student and teacher distributions, TRL's convention.

  With ``S = softmax(s / τ)``, ``T = softmax(t / τ)`` and the mixture ``M = β T + (1 − β) S``::

      JSD_β(T‖S) = β KL(T‖M) + (1 − β) KL(S‖M)        for 0 < β < 1
      β = 0:  KL(T‖S)   (forward KL, teacher-weighted: "mode covering")
      β = 1:  KL(S‖T)   (reverse KL, student-weighted: "mode seeking")

  This is TRL 0.19 ``GKDTrainer.generalized_jsd_loss`` exactly (values and gradients w.r.t. the student logits,
  checked to rtol 1e-5 against its recorded output in ``tests/losses/test_distill.py``). Differences from the
  paper (Agarwal et al. 2024, eq. 1, ``D_JSD(β)(P‖Q) = β KL(P‖βP+(1−β)Q) + (1−β) KL(Q‖βP+(1−β)Q)``, ``P`` the
  teacher): the paper's divergence is identically 0 at β ∈ {0, 1} and only its *rescaled* limits
  ``D/β → KL(T‖S)`` (β → 0) and ``D/(1−β) → KL(S‖T)`` (β → 1) are the KLs; TRL (and this function)
  substitutes the unscaled KLs at the endpoints, so the loss jumps in scale between β = 0 and β = 0.01 (an
  interior JSD is at most ``H_2(β) ≤ log 2``). Neither multiplies by ``τ²`` (Hinton's distillation
  convention): the temperature only softens both distributions.

  Args:
    student_logits: ``[..., V]`` student logits (any float dtype; computed in float32, or float64 if given).
    teacher_logits: ``[..., V]`` teacher logits (no gradient flows to them).
    beta: β in ``[0, 1]`` (static).
    temperature: τ > 0 applied to both.

  Returns:
    ``[...]`` float32 divergences (≥ 0).

  Example::

    d = generalized_jsd(s_logits, t_logits, beta=0.5, temperature=0.9)   # [B, T]
  """
  _check(beta, temperature)
  s = jax.nn.log_softmax(_upcast(student_logits) / temperature, axis=-1)
  t = jax.nn.log_softmax(_upcast(jax.lax.stop_gradient(teacher_logits)) / temperature, axis=-1)
  if beta == 0.0:
    return _kl(t, s)
  if beta == 1.0:
    return _kl(s, t)
  m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))  # log M
  return beta * _kl(t, m) + (1.0 - beta) * _kl(s, m)


def generalized_jsd_loss(
    student_logits: jax.Array,  # [B, T, V]
    teacher_logits: jax.Array,  # [B, T, V]
    mask: jax.Array,  # [B, T]
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    mode: str = "token_mean",
    loss_weights: jax.Array | None = None,  # [B, T]
    **aggregation,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GKD's loss: :func:`generalized_jsd` per response token, aggregated with one of our modes.

  ``L = Σ_{b,t} w_{b,t} · JSD_β(T_{b,t} ‖ S_{b,t})`` with ``w = loss_weights(mask, mode=mode, ...)``
  (:func:`jaxrl.losses.loss_weights`; ``aggregation`` passes its ``segment_ids``, ``group_ids``,
  ``num_groups``, ``max_len``, ``global_counts``, ``axis_name``) or the precomputed ``loss_weights`` of a global
  batch. ``mode="token_mean"`` is TRL's ``reduction="batchmean"`` with ``labels == -100`` masked: the sum over
  unmasked tokens divided by their number. Masked positions never contribute, even with non-finite logits.

  Args:
    student_logits, teacher_logits: ``[B, T, V]`` logits of the same positions.
    mask: ``[B, T]`` 1 on tokens in the loss.
    beta, temperature: as :func:`generalized_jsd`.
    mode: a :data:`jaxrl.losses.AGGREGATION_MODES` entry (ignored when ``loss_weights`` is given).
    loss_weights: ``[B, T]`` precomputed weights (a micro-batch of a global batch).

  Returns:
    ``(loss, {"jsd": token mean of the divergence over the mask})``.

  References: Agarwal et al. 2024 (GKD), eq. 1; TRL ``GKDTrainer.generalized_jsd_loss``.
  """
  mask = jnp.asarray(mask).astype(jnp.float32)
  w = loss_weights if loss_weights is not None else _loss_weights(mask, mode=mode, **aggregation)
  jsd = generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)  # [B, T]
  loss = jnp.sum(jnp.where(w != 0, w * jsd, 0.0))
  mean = jnp.sum(jnp.where(mask > 0, jsd, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)
  return loss, {"jsd": jax.lax.stop_gradient(mean)}


def token_generalized_jsd(
    student_hidden: jax.Array,  # [B, T, D]
    student_unembed: jax.Array,  # [D, V]
    teacher_hidden: jax.Array,  # [B, T, D']
    teacher_unembed: jax.Array,  # [D', V]
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> jax.Array:  # [B, T] float32
  """:func:`generalized_jsd` of ``h_s W_s`` and ``h_t W_t`` per token, ``chunk_size`` tokens at a time.

  The teacher may be wider than the student (``D' ≠ D``); both share the vocabulary ``V``. Tokens are
  flattened, padded to a multiple of ``chunk_size`` and mapped over with ``lax.map`` under
  ``jax.checkpoint`` (as :func:`jaxrl.losses.token_logprobs`), so at most ``2 × chunk_size × V`` logits exist at
  once, forward and backward. The matmuls accumulate in float32.

  Args:
    student_hidden, teacher_hidden: final (normed) hidden states of the same positions.
    student_unembed, teacher_unembed: output projections.
    beta, temperature: as :func:`generalized_jsd`.
    chunk_size: tokens per chunk (static).

  Returns:
    ``[B, T]`` float32 divergences.
  """
  _check(beta, temperature)
  if chunk_size < 1:
    raise ValueError(f"token_generalized_jsd: chunk_size must be >= 1, got {chunk_size!r}")
  wt = jax.lax.stop_gradient(teacher_unembed)
  acc = jnp.promote_types(student_hidden.dtype, jnp.float32)  # float32 accumulation (float64 stays)

  def one_chunk(args):
    cs, ct = args
    s = jnp.einsum("td,dv->tv", cs, student_unembed, preferred_element_type=acc)  # [t, V]
    te = jnp.einsum("td,dv->tv", ct, wt, preferred_element_type=acc)  # [t, V]
    return generalized_jsd(s, te, beta=beta, temperature=temperature)

  with jax.named_scope("token_generalized_jsd"):
    return map_token_chunks(one_chunk, (student_hidden, jax.lax.stop_gradient(teacher_hidden)), chunk_size)


def reverse_kl_advantages(
    student_logprobs: jax.Array,  # [B, T]
    teacher_logprobs: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    *,
    coef: float = 1.0,
) -> jax.Array:  # [B, T] float32
  """On-policy distillation's per-token advantage: ``A_t = −coef · (log S(y_t) − log T(y_t))`` on the mask.

  For ``y_t`` sampled from the student ``S``, ``log S(y_t) − log T(y_t)`` is the single-sample (``k1``)
  estimate of the per-token reverse KL ``KL(S‖T)``; using its negative as the advantage of the ordinary
  policy-gradient loss (importance ratio and clipping as PPO's) lowers the reverse KL to the teacher, with a
  dense, per-token signal and no reward model (Thinking Machines, "On-Policy Distillation", 2025, whose
  ``advantages = −kl_coef · (sampled_logprobs − teacher_logprobs)``; Qwen3 technical report §4, strong-to-weak
  distillation). Each token's advantage is its own (no sum over later tokens: discount 0, as in the recipe);
  the student's log-probs are a constant here (evaluated at the rollout parameters). Masked tokens get 0.

  Args:
    student_logprobs: ``[B, T]`` log-probs of the sampled tokens under the student at rollout time.
    teacher_logprobs: ``[B, T]`` log-probs of the same tokens under the teacher (same temperature).
    mask: ``[B, T]`` 1 on response tokens.
    coef: the KL coefficient.

  Returns:
    ``[B, T]`` float32 advantages, 0 off the mask.
  """
  s = jax.lax.stop_gradient(_upcast(student_logprobs))
  t = jax.lax.stop_gradient(_upcast(teacher_logprobs))
  mask = jnp.asarray(mask)
  return jnp.where(mask > 0, -coef * (s - t), 0.0)
