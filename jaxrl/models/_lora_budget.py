"""LoRA accounting (adapter parameters, FLOPs per token, optimizer-state bytes) and the learning-rate
rules of "LoRA Without Regret" (Thinking Machines, 2025; project notes seeds/000_66f2e4027e8fa57d.txt,
LR ratio lines 449-478, FLOPs 537-562, parameter table 329-352)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.models._config import ModelConfig
from jaxrl.models._lora import (
    LORA_LR_MULTIPLIER,
    LORA_MODULES,
    LoraConfig,
    _dims,
    lora_state,
    split_lora,
)
from jaxrl.models._transformer import LORA_SUFFIXES

SHORT_RUN_LR_MULTIPLIER = 15.0
"""The same ratio for runs under ~100 steps (line 478: "约 100 步以内 ... 约为 FullFT 的 15 倍")."""
FITTED_LORA_MULTIPLIER = 9.8
"""``M_LoRA`` of the hidden-size rule as fitted (line 466); ``LoRA pow = 0`` (line 467)."""
HIDDEN_SIZE_LR_BASE = 5e-5
"""Full-FT LR at hidden size 2000 in the hidden-size rule (tinker-cookbook ``hyperparam_utils.get_lr``;
the note gives the formula, line 458, but not this constant)."""
MODEL_POW = {"llama": 0.781, "qwen": 0.0775}
"""``model pow`` per family (tinker-cookbook ``hyperparam_utils.get_lr``; the note, line 459-463,
says it is fitted per family but does not print the values)."""


# --------------------------------------------------------------------------------------------------
# Accounting


def _resolve_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
  return LoraConfig(rank=1, targets=targets if isinstance(targets, str) else tuple(targets)).modules


def lora_param_counts(model_cfg: ModelConfig, *, targets: str | Sequence[str] = "all", rank: int) -> dict[str, int]:
  """Adapter parameters per targeted module (summed over layers) and their ``"total"``.

  ``count(W) = L · r · (d_in + d_out)`` for ``A [d_in, r]`` and ``B [r, d_out]`` — the note's sum of
  ``rank·d_in + rank·d_out`` over all weight matrices (seeds file line 373).

  Example: ``ModelConfig.qwen3_8b()``, rank 256: attn 0.245B, mlp 0.453B, all 0.698B; mlp at rank 128
  0.226B — the note's table (lines 351-352 and 333-341: 0.25B, 0.49B, 0.70B, 0.24B) up to its mlp rows.
  """
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"rank: must be an int >= 1, got {rank!r}")
  out = {}
  for name in _resolve_targets(targets):
    in_dims, out_dims = _dims(model_cfg, name)
    out[name] = model_cfg.num_layers * rank * (math.prod(in_dims) + math.prod(out_dims))
  out["total"] = sum(out.values())
  return out


def lora_flops_per_token(model_cfg: ModelConfig, rank: int, targets: str | Sequence[str] = "all") -> dict[str, float]:
  """Training FLOPs per token of the weight matmuls, LoRA vs full fine-tuning (attention excluded).

  Per weight matrix ``W [d_in, d_out]`` in multiply-adds (the note, lines 537-562, with ``N x N``):
  full FT runs ``y = xW``, ``x̄ = ȳWᵀ`` and ``W̄ = xᵀȳ``: ``3·d_in·d_out`` (``3N²``); LoRA keeps the
  first two and trains ``A``, ``B`` at ``3`` MACs per factor element: ``2·d_in·d_out + 3r(d_in + d_out)``
  (``2N² + 6NR``). Matrices LoRA does not adapt, and the output head, cost ``2·d_in·d_out`` under LoRA.
  FLOPs = 2 x MACs.

  Returns:
    ``{"full": F_full, "lora": F_lora, "ratio": F_lora / F_full}`` (FLOPs per token).
  """
  chosen = _resolve_targets(targets)
  full = lora = 0.0
  for name in LORA_MODULES:
    in_dims, out_dims = _dims(model_cfg, name)
    di, do = math.prod(in_dims), math.prod(out_dims)
    full += 3 * di * do * model_cfg.num_layers
    lora += (2 * di * do + (3 * rank * (di + do) if name in chosen else 0)) * model_cfg.num_layers
  head = model_cfg.hidden_size * model_cfg.vocab_size
  full, lora = 2 * (full + 3 * head), 2 * (lora + 2 * head)
  return {"full": full, "lora": lora, "ratio": lora / full}


# --------------------------------------------------------------------------------------------------
# Learning rates


def lora_lr(full_ft_lr: float, *, short_run: bool = False) -> float:
  """The LoRA learning rate for a known-good full-FT one: ``10x`` (``15x`` for runs under ~100 steps).

  The note (seeds file lines 451, 466 and 478): the optimal LoRA LR is ~10x the full-FT optimum
  in SL and RL (fitted 9.8), and ~15x for short runs because B starts at zero.
  """
  if not full_ft_lr > 0:
    raise ValueError(f"full_ft_lr: must be > 0, got {full_ft_lr!r}")
  return full_ft_lr * (SHORT_RUN_LR_MULTIPLIER if short_run else LORA_LR_MULTIPLIER)


def _family(model_type: str) -> str:
  if model_type == "llama":
    return "llama"
  if model_type.startswith("qwen"):
    return "qwen"
  raise ValueError(f"family: {model_type!r} has no fitted model_pow; known: {sorted(MODEL_POW)} (or llama/qwen2/qwen3)")


def hidden_size_lr(model: ModelConfig | int, *, family: str | None = None, lora: bool = True,
                   base_lr: float = HIDDEN_SIZE_LR_BASE) -> float:
  """The note's fitted optimum ``LR = base · M · (2000 / hidden)^(model_pow + LoRA_pow)``.

  ``M = 9.8`` with LoRA, 1 for full FT, and ``LoRA_pow = 0`` (seeds file lines 458-467); the note does
  not print ``model_pow`` or the base, so they are taken from Thinking Machines' tinker-cookbook
  (``hyperparam_utils.get_lr``: base 5e-5; model_pow 0.781 Llama, 0.0775 Qwen).

  Args:
    model: a :class:`ModelConfig` (its ``hidden_size`` and ``model_type``) or a hidden size.
    family: ``"llama"`` or ``"qwen"``; default from ``model.model_type``.
    lora: the LoRA LR (``M = 9.8``) or the full-FT one (``M = 1``).
    base_lr: full-FT LR at hidden size 2000.
  """
  if isinstance(model, ModelConfig):
    hidden, family = model.hidden_size, family or _family(model.model_type)
  else:
    hidden = model
    if family is None:
      raise ValueError("family: give 'llama' or 'qwen' with a bare hidden size")
  family = _family(family) if family not in MODEL_POW else family
  if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
    raise ValueError(f"hidden_size: must be a positive int, got {hidden!r}")
  m = FITTED_LORA_MULTIPLIER if lora else 1.0
  return base_lr * m * (2000.0 / hidden) ** MODEL_POW[family]


def lr_scale_tree(adapters, b_lr_ratio: float) -> Any:
  """Per-leaf LR multipliers for :func:`jaxrl.train.make_optimizer` ``(lr_scale=...)``: 1 for A, ratio for B.

  LoRA+ (Hayou et al. 2024) trains B faster; in the note's basis this lengthens A's time scale
  ``init_A / LR_A`` (seeds file lines 433-440). ``b_lr_ratio = 1`` is PEFT's standard parametrisation.

  Args:
    adapters: the adapter state (:func:`lora_state` / :func:`split_lora`), or any pytree whose paths
      name the factors (``..._lora_a``, ``..._lora_b``).
    b_lr_ratio: ``LR_B / LR_A`` (> 0).

  Returns:
    A pytree of floats with ``adapters``' structure.
  """
  if isinstance(b_lr_ratio, bool) or not isinstance(b_lr_ratio, (int, float)) or not b_lr_ratio > 0:
    raise ValueError(f"b_lr_ratio: must be a positive number, got {b_lr_ratio!r}")

  def one(path, _):
    key = jax.tree_util.keystr(path)
    if LORA_SUFFIXES[1] in key:
      return float(b_lr_ratio)
    if LORA_SUFFIXES[0] in key:
      return 1.0
    raise ValueError(f"lr_scale_tree: leaf {key} is not a LoRA factor")

  return jax.tree_util.tree_map_with_path(one, adapters)


def optimizer_state_bytes(opt_state) -> int:
  """Bytes of an optax state pytree (concrete or ``jax.eval_shape`` output)."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state)
                 if hasattr(x, "shape")))
