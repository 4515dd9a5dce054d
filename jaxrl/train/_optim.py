"""Optimizers and learning-rate schedules (Optax)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal

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
  lr_multipliers: dict[str, float] = dataclasses.field(default_factory=dict)
  """Per-module learning rate: ``{regex: factor}``; a parameter whose path (:func:`param_path`, e.g.
  ``visual/merger/fc1``) ``re.search``-matches a regex (the first that matches wins) has its AdamW update scaled
  by ``factor`` (effective lr ``factor × schedule``; Adam's moments unchanged). Factors > 0 (freeze with
  ``freeze_vision``); a regex that matches no trainable parameter is an error."""

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
    for pattern, factor in self.lr_multipliers.items():
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"optim.lr_multipliers: {pattern!r} is not a regular expression ({e})") from e
      if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"optim.lr_multipliers[{pattern!r}] must be a finite number > 0, got {factor!r} "
                         "(to freeze the vision tower use freeze_vision: true)")


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

  ``lr_scale`` is how LoRA+ gives ``B`` matrices their own learning-rate multiplier; ``cfg.lr_multipliers``
  (by parameter path, :func:`scale_by_path`) multiplies on top of it. Adam's moments
  are float32 whatever the parameters' dtype (:func:`float32_state`), so the state keeps one dtype
  from the first step on (no retrace) and bf16-stored weights still get float32 statistics.
  """
  schedule = make_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_norm is not None:
    parts.append(clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
  if cfg.weight_decay:
    parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask))
  if lr_scale is not None:
    parts.append(_scale_by_tree(lr_scale))
  lr = optax.scale_by_learning_rate(schedule)
  parts.append(scale_by_path(cfg.lr_multipliers, lr) if cfg.lr_multipliers else lr)
  return float32_state(optax.chain(*parts))


def _f32(x):
  return x.astype(jnp.float32) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """:func:`optax.clip_by_global_norm` (same empty state, so checkpoints are unchanged) as one scalar factor
  ``min(1, max_norm / norm)`` multiplied into each gradient.

  Why: optax's per-element ``select(norm < max_norm, g, g / norm · max_norm)`` is a fusion XLA does not
  duplicate into Adam's two consumers (``mu`` and ``nu``), so the clipped gradients were written out as a
  second gradient tree beside the gradients (0.87 GB of the train step's temporaries at 0.5B in float32); a multiply
  by a scalar fuses into both. The clipped values may differ from optax's by one rounding (``g · (m / n)``
  against ``(g / n) · m``).
  """
  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


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


def param_path(path) -> str:
  """A pytree key path as ``a/b/0/c`` (dict keys and sequence indices; the ``.value`` of nnx variables dropped):
  ``visual/merger/fc1``, ``layers/attn/q_proj``, ``layers/attn/q_proj_lora_b``."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
      parts.append(k.name)
  return "/".join(parts)


def path_multipliers(multipliers: dict[str, float], params) -> Any:
  """A pytree of floats like ``params``: the factor of the first regex of ``multipliers`` that ``re.search``-es
  the leaf's :func:`param_path`, 1 where none does. A regex that matches no leaf is an error naming it."""
  compiled = [(p, re.compile(p), float(f)) for p, f in multipliers.items()]
  used = set()

  def one(path, _):
    name = param_path(path)
    for pattern, rx, factor in compiled:
      if rx.search(name):
        used.add(pattern)
        return factor
    return 1.0

  out = jax.tree_util.tree_map_with_path(one, params)
  unused = [p for p in multipliers if p not in used]
  if unused:
    names = sorted({param_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]})
    raise ValueError(f"optim.lr_multipliers: {unused[0]!r} matches no trainable parameter (paths: "
                     f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
  return out


def scale_by_path(multipliers: dict[str, float], inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` (the learning-rate scaling) with each update leaf then scaled by its :func:`path_multipliers`
  factor. ``inner``'s state as it is (a checkpoint's optimizer state has the same structure with or without
  multipliers); the factors are resolved from the tree's paths when traced, and checked at ``init`` (unless it
  gets a bare leaf, as ``optax.tree_map_params`` passes) and at every trace of ``update``."""
  def init(params):
    if any(path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]):
      path_multipliers(multipliers, params)
    return inner.init(params)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, state, params)
    scales = path_multipliers(multipliers, updates)
    return jax.tree.map(lambda u, s: u if s == 1.0 else u * jnp.asarray(s, u.dtype), updates, scales), state

  return optax.GradientTransformation(init, update)
