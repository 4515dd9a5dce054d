"""Optimizers and learning-rate schedules (Optax)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with warmup and a decay schedule, global-norm clipping."""

  lr: float = 1e-4
  "Peak learning rate."
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  "Decay after warmup: cosine or linear to `final_lr_ratio · lr`, or constant."
  warmup_steps: int = 0
  "Linear warmup from 0 to `lr` over this many steps."
  final_lr_ratio: float = 0.1
  "End of the decay as a fraction of `lr`."
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  "Decoupled weight decay; not applied to 1-D parameters (norms, biases)."
  clip_norm: float | None = 1.0
  "Global gradient-norm clip; null disables it."

  def __post_init__(self):
    if self.lr <= 0:
      raise ValueError(f"optim.lr must be > 0, got {self.lr}")
    if self.warmup_steps < 0:
      raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0.0 <= self.final_lr_ratio <= 1.0:
      raise ValueError(f"optim.final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}")
    if self.clip_norm is not None and self.clip_norm <= 0:
      raise ValueError(f"optim.clip_norm must be > 0 or null, got {self.clip_norm}")
    if self.weight_decay < 0:
      raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Warmup then cosine/linear/constant; the decay ends at ``total_steps``."""
  decay_steps = max(total_steps - cfg.warmup_steps, 1)
  end = cfg.lr * cfg.final_lr_ratio
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_ratio)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(cfg.lr, end, decay_steps)
  else:
    decay = optax.constant_schedule(cfg.lr)
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def _decay_mask(params):
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def make_optimizer(cfg: OptimConfig, total_steps: int, *, lr_scale=None) -> optax.GradientTransformation:
  """Clip → AdamW(schedule). ``lr_scale`` (a pytree of floats like the params) scales per leaf.

  ``lr_scale`` is how LoRA+ gives ``B`` matrices their own learning-rate multiplier. Adam's moments
  are float32 whatever the parameters' dtype (:func:`float32_state`), so the state keeps one dtype
  from the first step on (no retrace) and bf16-stored weights still get float32 statistics.
  """
  schedule = make_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
  if cfg.weight_decay:
    parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask))
  if lr_scale is not None:
    parts.append(_scale_by_tree(lr_scale))
  parts.append(optax.scale_by_learning_rate(schedule))
  return float32_state(optax.chain(*parts))


def _f32(x):
  return x.astype(jnp.float32) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x


def float32_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` with its state initialised from float32 views of the parameters.

  Optax sizes moments like the parameters (``zeros_like``), so bf16 parameters would start bf16
  moments that the first float32 gradient turns float32: the state's dtype would change between
  step 1 and 2 (a retrace) and the statistics would be bf16. Float32 parameters are used as they
  are (``astype`` to the same dtype makes no copy).
  """
  def init(params):
    return inner.init(jax.tree.map(_f32, params))

  return optax.GradientTransformation(init, inner.update)


def _scale_by_tree(scales) -> optax.GradientTransformation:
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, s: u * s, updates, scales), state

  return optax.GradientTransformation(init, update)
