"""The learner's programs and what they report: the packed micro-batch layout of a step, the jitted RL
update step (:func:`make_learner_step`) and log-prob program (:func:`make_logprob_program`) that
:class:`jaxrl.rl.RLTrainer` builds and caches and :mod:`jaxrl.plan` compiles from abstract parameters, and the
host-side reduction of the update step's outputs into per-update and per-step metrics."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import models, train
from jaxrl.rl._config import RLConfig
from jaxrl.rl._loss import MICRO_VECTOR_PREFIX, make_loss_fn, make_prepare

_NOT_WEIGHTED = frozenset({"loss", "grad_norm", "lr", "skipped", "weight_sum", "loss_tokens", "logprob_diff_sum"})
"""Update metrics that are not Σ w·m weighted sums (the rest are divided by ``weight_sum``)."""


def packed_layout(cfg: RLConfig, step: int, *, data_parallel: int, processes: int = 1) -> tuple[int, int]:
  """``(row_len, rows)`` of the packed micro-batches at ``step``: the stage's row length (not the largest
  stage's) and ``token_budget // row_len`` global rows, which must split evenly over the ``data_parallel``
  devices and the ``processes``."""
  row_len = cfg.row_len_at(step)
  rows = cfg.micro_batch.token_budget // row_len
  if rows % math.lcm(data_parallel, processes):
    raise ValueError(
        f"micro_batch: token_budget={cfg.micro_batch.token_budget} // row_len={row_len} = {rows} rows per "
        f"micro-batch at step {step}; it must be a multiple of the {data_parallel} data-parallel devices "
        f"and of the {processes} processes")
  return row_len, rows


def make_logprob_program(fn, num_micro: int, *, mesh, batch_sharding):
  """Jitted ``(params, interleaved batch, *frozen) -> [R·M, T]`` masked log-probs of ``fn`` (a
  ``make_logprob_fn`` function), scanning the ``num_micro`` micro-batches on device (one micro-batch live at a
  time); the result stays on device with ``batch_sharding``. A VLM batch's images (``pixel_values``, the
  ``models.VISION_LAYOUT_KEYS`` arrays, ``image_token_mask``) and ``rope_positions`` go with it when present."""
  keys = ("tokens", "targets", "positions", "segment_ids", "loss_columns", "rope_positions", "image_token_mask",
          "pixel_values", *models.VISION_LAYOUT_KEYS)

  def run(params, batch, *frozen):
    micro = train.split_micro_batches({k: batch[k] for k in keys if k in batch}, num_micro, mesh=mesh)
    lp = jax.lax.map(lambda mb: fn(params, mb, *frozen), micro)  # [M, R, T]
    lp = jnp.swapaxes(lp, 0, 1).reshape(batch["tokens"].shape)  # back to the interleaved rows
    return lp * batch["loss_mask"]
  return jax.jit(run, out_shardings=batch_sharding)


def make_learner_step(cfg: RLConfig, graphdef, optimizer, *, num_micro: int, max_len: int, mesh, rules,
                      schedule=None, train_dtype=None, extra_term=None):
  """The jitted RL update step for ``cfg`` (:func:`jaxrl.train.make_train_step` over the algorithm's loss):
  ``num_micro`` scanned micro-batches, the algorithm's batch preparation at ``max_len`` tokens, a LoRA loss under
  ``cfg.lora``, and the parameters viewed in ``train_dtype`` for the forward. ``RLTrainer`` builds one per
  (micro-batches, length) and caches it; ``jaxrl.plan`` compiles the same program from abstract parameters.

  Args:
    cfg: the run's config (``algorithm``, ``rollout.temperature``, ``rollout.prompts_per_step``, ``lora``).
    graphdef: the policy's ``nnx`` graph definition.
    optimizer: the ``optax`` optimizer (:func:`jaxrl.train.make_optimizer`).
    num_micro: micro-batches per update.
    max_len: the aggregation length the algorithm's preparation uses.
    mesh, rules: where the step runs and the logical-axis rules.
    schedule: the learning-rate schedule, logged by the step.
    train_dtype: the compute dtype of the forward (``models.compute_view``).
    extra_term: a term added to the loss (:func:`make_loss_fn`; GKD's JSD to the teacher under
      ``distill.mode: gkd``, whose parameters are then the step's last argument).

  Returns:
    ``step(state, batch, flag) -> (state, metrics)`` as :func:`jaxrl.train.make_train_step` returns it.
  """
  loss_fn = make_loss_fn(graphdef, cfg.algorithm, temperature=cfg.rollout.temperature, num_micro=num_micro,
                         extra_term=extra_term)
  if cfg.lora is not None:
    loss_fn = models.lora_loss(loss_fn)  # (adapters, mb, base, current_as_old)
  return train.make_train_step(
      loss_fn, optimizer, micro_batches=num_micro, mesh=mesh, rules=rules, schedule=schedule,
      prepare=make_prepare(cfg.algorithm, num_groups=cfg.rollout.prompts_per_step, max_len=max_len),
      compute_view=lambda p: models.compute_view(p, train_dtype))


def update_metrics(out: dict[str, Any]) -> dict[str, float]:
  """One update's host metrics: weighted sums renormalised, per-micro-batch vectors reduced."""
  tokens = np.asarray(out[MICRO_VECTOR_PREFIX + "tokens"])
  real = tokens > 0
  ws = float(out["weight_sum"])
  m: dict[str, float] = {}
  for k, v in out.items():
    if k.startswith(MICRO_VECTOR_PREFIX) or k in ("weight_sum", "loss_tokens", "logprob_diff_sum"):
      continue
    v = float(np.asarray(v))
    m[k] = v if k in _NOT_WEIGHTED else (v / ws if ws > 0 else 0.0)
  vec = lambda name: np.asarray(out[MICRO_VECTOR_PREFIX + name])[real]
  has = bool(real.any())
  m["ratio_min"] = float(vec("ratio_min").min()) if has else 1.0
  m["ratio_max"] = float(vec("ratio_max").max()) if has else 1.0
  m["logprob_diff/max_abs"] = float(vec("logprob_diff_max").max()) if has else 0.0
  m["logprob_diff/mean_abs"] = float(out["logprob_diff_sum"]) / max(float(out["loss_tokens"]), 1.0)
  return m


def step_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
  """Means over the step's updates; min/max for ratio bounds; the first update's log-prob gap."""
  out: dict[str, float] = {}
  keys = [k for k in updates[0] if k not in ("ratio_min", "ratio_max", "lr", "skipped")
          and not k.startswith("logprob_diff/")]
  for k in keys:
    out[k] = float(np.mean([u[k] for u in updates]))
  out["ratio_min"] = min(u["ratio_min"] for u in updates)
  out["ratio_max"] = max(u["ratio_max"] for u in updates)
  out["ratio_first_min"] = updates[0]["ratio_min"]
  out["ratio_first_max"] = updates[0]["ratio_max"]
  out["logprob_diff/max_abs"] = updates[0]["logprob_diff/max_abs"]
  out["logprob_diff/mean_abs"] = updates[0]["logprob_diff/mean_abs"]
  out["lr"] = updates[-1]["lr"]
  out["skipped"] = float(sum(u["skipped"] for u in updates))
  return out
