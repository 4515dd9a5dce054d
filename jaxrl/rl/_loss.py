"""The RL update's loss: model forward + ``jaxrl.losses`` pieces chosen by name in the config.

``prepare`` folds the aggregation's global normaliser into per-token ``weights`` once per global
mini-batch (before it is split into micro-batches); ``loss_fn`` of a micro-batch is then the plain
weighted sum ``Σ w·ℓ`` of the configured objective (+ β·KL − c·entropy), so the accumulated loss and
gradient equal those of the unsplit mini-batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import losses, models
from jaxrl.rl._config import AlgorithmConfig

MICRO_VECTOR_PREFIX = "mb/"
"""Metrics under this prefix are ``[M]`` vectors, one entry per micro-batch (min/max do not add up)."""


def policy_hidden(graphdef, params, mb):
  """``(model, hidden [B, T, D])``: the policy and its final hidden states over packed rows."""
  model = nnx.merge(graphdef, params)
  return model, model(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                      rope_positions=mb.get("rope_positions"), images=models.VisionInputs.from_batch(mb),
                      return_hidden=True)


def head_logprobs(model, hidden, mb, *, temperature: float, chunk_size: int, return_entropy: bool = False):
  """:func:`jaxrl.losses.token_logprobs` of ``hidden [B, T, D]`` against ``mb["targets"]``, ``[B, T]``.

  When ``mb`` carries ``loss_columns [B, K]`` (:func:`jaxrl.rl.with_loss_columns`: each row's loss positions,
  padded with ``T``), the head runs on those ``K`` columns only and its output is scattered back, zero elsewhere:
  a prompt's positions cost no ``[D, V]`` matmul and softmax, forward or backward. The gather's index is
  clipped and the scatter drops the padding, so padded columns contribute nothing.
  """
  kw = dict(chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy)
  cols = mb.get("loss_columns")
  if cols is None:
    return losses.token_logprobs(hidden, model.unembed_matrix(), mb["targets"], **kw)
  picked = jnp.take_along_axis(hidden, cols[..., None], axis=1, mode="clip")  # [B, K, D]
  targets = jnp.take_along_axis(mb["targets"], cols, axis=1, mode="clip")  # [B, K]
  out = losses.token_logprobs(picked, model.unembed_matrix(), targets, **kw)
  rows = jnp.arange(cols.shape[0])[:, None]
  back = lambda x: jnp.zeros(mb["targets"].shape, x.dtype).at[rows, cols].set(x, mode="drop")  # [B, T]
  return jax.tree.map(back, out)


def policy_logprobs(graphdef, params, mb, *, temperature: float, chunk_size: int, return_entropy: bool = False):
  """``log π(targets)`` (and entropy) at ``temperature`` over packed rows, float32 ``[B, T]`` (only at
  ``loss_columns`` when the rows carry them, :func:`head_logprobs`); a VLM's rows carry ``rope_positions`` and
  per-row images (:meth:`jaxrl.models.VisionInputs.from_batch`), which the rollout must hand over exactly as it
  sampled them."""
  model, hidden = policy_hidden(graphdef, params, mb)  # [B, T, D]
  return head_logprobs(model, hidden, mb, chunk_size=chunk_size, temperature=temperature,
                       return_entropy=return_entropy)


def make_logprob_fn(graphdef, *, temperature: float, chunk_size: int, lora: bool = False,
                    base_only: bool = False):
  """Jitted ``fn(params, micro_batch[, base]) -> [R, T]`` log-probs (old-policy recompute, reference).

  With ``lora``, ``params`` are the adapters and ``base`` the frozen base state
  (:func:`jaxrl.models.split_lora`); ``base_only`` then runs the model with every adapter skipped
  (:func:`jaxrl.models.lora_disabled`, traced inside this function): the KL reference of LoRA RL,
  computed from the same base arrays, with no second copy of the weights.
  """
  if base_only and not lora:
    raise ValueError("base_only needs lora=True")

  def full(params, mb):
    return policy_logprobs(graphdef, params, mb, temperature=temperature, chunk_size=chunk_size)

  if not lora:
    return jax.jit(full)
  adapted = models.lora_loss(full)  # (adapters, mb, base) -> full(merge_state(base, adapters), mb)

  def fn(adapters, mb, base):
    if not base_only:
      return adapted(adapters, mb, base)
    with models.lora_disabled():
      return adapted(adapters, mb, base)
  return jax.jit(fn)


def make_prepare(algo: AlgorithmConfig, *, num_groups: int, max_len: int):
  """``prepare(batch) -> batch`` adding ``weights = loss_weights(loss_mask, mode=aggregation)``."""
  def prepare(batch):
    w = losses.loss_weights(batch["loss_mask"], mode=algo.aggregation, group_ids=batch["group_ids"],
                            num_groups=num_groups, segment_ids=batch["segment_ids"], max_len=max_len)
    return dict(batch, weights=w)
  return prepare


def make_loss_fn(graphdef, algo: AlgorithmConfig, *, temperature: float, num_micro: int, extra_term=None):
  """``loss_fn(params, micro_batch, current_as_old[, *extra]) -> (loss, metrics)`` for ``make_train_step``.

  ``extra_term(model, hidden, micro_batch, *extra) -> (term, metrics)``, when given, is added to the loss with the
  policy's hidden states ``[B, T, D]`` of the same forward (GKD's JSD to a teacher whose parameters are ``extra``,
  :class:`jaxrl.rl._distill.Teacher`); its metrics are weighted sums like the objective's.

  ``current_as_old`` (scalar bool) makes π_old the stop-gradient of the current log-probs: the
  first mini-batch of a step, whose parameters *are* the rollout parameters (ratio exactly 1, as
  verl's on-policy shortcut). Otherwise π_old is ``old_logprobs`` (sampler or recomputed).
  ``decoupled_ppo`` gets the sampler's log-probs as π_behav and the trainer's as π_prox.

  Metrics: the objective's weighted sums (add up over micro-batches), ``loss_tokens``,
  ``logprob_diff_sum`` (``Σ mask·|log π_θ − log π_sampler|``), and ``mb/*`` one-hot vectors for
  per-micro-batch ratio min/max and the log-prob difference max.
  """
  objective = losses.OBJECTIVES[algo.objective]

  def loss_fn(params, mb, current_as_old, *extra):
    model, hidden = policy_hidden(graphdef, params, mb)  # [B, T, D]
    logp, entropy = head_logprobs(model, hidden, mb, temperature=temperature, chunk_size=algo.logprob_chunk_size,
                                  return_entropy=True)  # [B, T]
    w, mask = mb["weights"], mb["loss_mask"]
    sampler_lp = mb["sampler_logprobs"]
    old = jnp.where(current_as_old, jax.lax.stop_gradient(logp), mb["old_logprobs"])
    if algo.decoupled:
      anchors = dict(old_logprobs=sampler_lp, prox_logprobs=old)
    else:
      anchors = dict(old_logprobs=old)
    loss, metrics = objective(logprobs=logp, advantages=mb["advantages"], loss_weights=w, response_mask=mask,
                              segment_ids=mb["segment_ids"], entropy=entropy, **anchors, **algo.objective_kwargs)
    if algo.kl_coef > 0:
      kl, kl_metrics = losses.kl_loss(logprobs=logp, ref_logprobs=mb["ref_logprobs"], loss_weights=w,
                                      estimator=algo.kl_estimator)
      loss = loss + algo.kl_coef * kl
      metrics["kl"] = kl_metrics["kl"]
    if algo.entropy_coef > 0:
      loss = loss - algo.entropy_coef * jnp.sum(jnp.where(w != 0, w * entropy, 0.0))
    if extra_term is not None:
      term, term_metrics = extra_term(model, hidden, mb, *extra)
      loss = loss + term
      metrics.update(term_metrics)
    onehot = jax.nn.one_hot(mb["mb_index"][0], num_micro, dtype=jnp.float32)  # [M]
    valid = mask > 0
    diff = jnp.where(valid, jnp.abs(jax.lax.stop_gradient(logp) - sampler_lp), 0.0)
    p = MICRO_VECTOR_PREFIX
    metrics[p + "ratio_min"] = onehot * metrics.pop("ratio_min")
    metrics[p + "ratio_max"] = onehot * metrics.pop("ratio_max")
    metrics[p + "logprob_diff_max"] = onehot * jnp.max(diff)
    metrics[p + "tokens"] = onehot * jnp.sum(mask)
    metrics["loss_tokens"] = jnp.sum(mask)
    metrics["logprob_diff_sum"] = jnp.sum(diff)
    return loss, metrics

  return loss_fn
