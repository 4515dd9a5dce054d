"""LoRA adapters on every projection of the decoder, PEFT-compatible, with the note's LR rules.

``W' = W + (alpha / r)·B·A`` (Hu et al. 2021), computed as ``x·W + s·((x·A)·B)`` so ``W'`` is
never formed while training; ``s = alpha / r`` or, with rsLoRA, ``alpha / sqrt(r)`` (Kalajdzievski
2023). In this model's ``[in, out]`` layout ``A`` is ``[*in, r]`` and ``B`` is ``[r, *out]``
(``q_proj [D, N, H]``: ``A [D, r]``, ``B [r, N, H]``; ``o_proj [N, H, D]``: ``A [N, H, r]``,
``B [r, D]``). PEFT's initialisation: ``A ~ U(-1/sqrt(d_in), 1/sqrt(d_in))`` (``kaiming_uniform_(a=√5)``),
``B = 0``, so the adapted model starts equal to the base.

Adapters are :class:`LoraParam` variables (a subclass of ``nnx.Param``) named ``{proj}_lora_a`` /
``{proj}_lora_b`` on the :class:`~jaxrl.models._transformer.Attention` / ``MLP`` modules, stacked
over ``layers`` like the base; their logical axes are the base weight's input axes + ``lora_rank``
(A) and ``lora_rank`` + its output axes (B), and ``lora_rank`` maps to no mesh axis. Train them
alone::

    model = apply_lora(models.load_pretrained(hf_dir, mesh=mesh), LoraConfig(rank=16))
    graphdef, adapters, base = split_lora(model)        # adapters: the only trainable state
    opt = train.make_optimizer(OptimConfig(lr=lora_lr(full_ft_lr)), steps,
                               lr_scale=lr_scale_tree(adapters, b_lr_ratio=1.0))
    step = train.make_train_step(lora_loss(loss_fn), opt)   # step(state, batch, base)

The optimizer then holds moments for the adapters only. :func:`base_logits` runs the same model with
adapters switched off, so the frozen base is the KL reference without a second copy of the weights.

Reference: "LoRA Without Regret" (Thinking Machines, 2025), /work/shared/seeds/000_66f2e4027e8fa57d.txt
lines 205-580 (parametrisation 392-446, LR ratio 449-478, FLOPs 537-562, parameter table 329-352).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl.models._config import ModelConfig
from jaxrl.models._transformer import LORA_OFF, LORA_SUFFIXES, Transformer
from jaxrl.sharding import LogicalRules

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES
"""Projections LoRA can adapt (the HF module names; the embedding and head are never adapted)."""
TARGET_SETS = {"all": LORA_MODULES, "attn": ATTN_MODULES, "mlp": MLP_MODULES}

LORA_LR_MULTIPLIER = 10.0
"""LoRA LR / full-FT LR for long runs: the note measures 9.8 over 14 models (seeds file line 466) and
rounds to 10 (line 451: "LoRA 的最优学习率始终是 ... FullFT 最优学习率的 10 倍")."""
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

SAFETENSORS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_HF_SITE = {"attn": "self_attn", "mlp": "mlp"}
_SITE_OF = {**{m: "attn" for m in ATTN_MODULES}, **{m: "mlp" for m in MLP_MODULES}}
_IN_NDIM = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
"""Leading input axes of each base weight (``o_proj [N, H, D]`` contracts ``N, H``)."""
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(LORA_MODULES) + r")\.lora_([AB])\.weight$")


class LoraParam(nnx.Param):
  """A LoRA factor. ``nnx.split(model, LoraParam, ...)`` separates the trainable adapters from the base."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Rank, scale, target projections and learning-rate rules of a LoRA adapter.

  Example::

      LoraConfig(rank=16)                                   # all layers, alpha 32, LR 10x full FT
      LoraConfig(rank=64, targets=("q_proj", "v_proj"))     # the original paper's choice
  """

  rank: int = 32
  "r >= 1. The note finds the optimal LR nearly independent of r thanks to the 1/r scale (lines 399-407)."
  alpha: float = 32.0
  "Scale numerator: s = alpha / r (alpha / sqrt(r) with rslora). 32 as in the note and PEFT practice."
  targets: str | tuple[str, ...] = "all"
  "'all' (q,k,v,o,gate,up,down; the note's recommendation), 'attn', 'mlp', or explicit module names."
  rslora: bool = False
  "Rank-stabilised scale alpha / sqrt(r) (PEFT use_rslora)."
  lr_multiplier: float = LORA_LR_MULTIPLIER
  "LoRA LR = lr_multiplier x the full-FT LR: 10 (measured 9.8) for long runs, ~15 for runs under ~100 steps."
  b_lr_ratio: float = 1.0
  "LoRA+: extra LR multiplier for B (lr_scale_tree); 1 = PEFT's standard equal rates."
  param_dtype: str = "float32"
  "Storage dtype of A and B ('float32' or 'bfloat16'), independent of the base's."

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora.rank: must be an int >= 1, got {self.rank!r}")
    for name in ("alpha", "lr_multiplier", "b_lr_ratio"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"lora.{name}: must be a positive number, got {value!r}")
    if self.param_dtype not in _DTYPES:
      raise ValueError(f"lora.param_dtype: {self.param_dtype!r} is not one of {list(_DTYPES)}")
    targets = self.targets
    if isinstance(targets, str):
      if targets not in TARGET_SETS:
        raise ValueError(f"lora.targets: {targets!r} is not one of {list(TARGET_SETS)} or a list of module "
                         f"names from {list(LORA_MODULES)}")
    else:
      targets = tuple(targets)
      bad = [t for t in targets if t not in LORA_MODULES]
      if bad or not targets:
        raise ValueError(f"lora.targets: unknown module names {bad} (valid: {list(LORA_MODULES)}, or one of "
                         f"{list(TARGET_SETS)})" if bad else "lora.targets: empty list; name at least one module")
      if len(set(targets)) != len(targets):
        raise ValueError(f"lora.targets: duplicate module names in {list(targets)}")
      object.__setattr__(self, "targets", targets)

  @property
  def modules(self) -> tuple[str, ...]:
    """The targeted projections in canonical order (q, k, v, o, gate, up, down)."""
    chosen = TARGET_SETS[self.targets] if isinstance(self.targets, str) else self.targets
    return tuple(m for m in LORA_MODULES if m in chosen)

  @property
  def scale(self) -> float:
    """``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``."""
    return float(self.alpha) / (math.sqrt(self.rank) if self.rslora else self.rank)


# --------------------------------------------------------------------------------------------------
# Adding, splitting, merging


def _sites(model: Transformer) -> Iterator[tuple[int | None, str, nnx.Module]]:
  """``(layer or None if stacked, "attn" | "mlp", module)`` for every block's attention and MLP."""
  blocks = [(None, model.layers)] if model.cfg.scan_layers else list(enumerate(model.layers))
  for i, block in blocks:
    yield i, "attn", block.attn
    yield i, "mlp", block.mlp


def _factor_names(name: str) -> tuple[str, str]:
  return name + LORA_SUFFIXES[0], name + LORA_SUFFIXES[1]


def has_lora(model: Transformer) -> bool:
  """Whether :func:`apply_lora` (or :func:`load_peft`) has added adapters to ``model``."""
  return getattr(model, "lora_config", None) is not None


def _is_concrete(x) -> bool:
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def apply_lora(model: Transformer, cfg: LoraConfig, *, seed: int = 0,
               rules: LogicalRules | None = None) -> Transformer:
  """Adds LoRA factors to the targeted projections of ``model`` (in place) and returns it.

  ``A [L, *in, r] ~ U(-1/sqrt(d_in), 1/sqrt(d_in))`` with ``d_in = prod(*in)`` (PEFT's
  ``kaiming_uniform_(a=sqrt(5))``), drawn on the host per layer from
  ``numpy.random.default_rng([seed, module, layer])`` (no compilation; scanned and looped models get
  the same factors; every host draws the same); ``B [L, r, *out] = 0``. On a sharded model the
  factors are placed on the base weight's mesh by ``rules``. Works under ``nnx.eval_shape``.

  Args:
    model: a :class:`Transformer` without adapters.
    cfg: rank, scale and targets.
    seed: seed of ``A``.
    rules: logical-to-mesh rules (default :meth:`LogicalRules.default`).

  Returns:
    ``model``, whose forward pass is now ``x·W + s·((x·A)·B)`` on every targeted projection.
  """
  if has_lora(model):
    raise ValueError("model already has LoRA adapters (merge_lora/unmerge_lora, or load a fresh base)")
  r, np_dtype = cfg.rank, _NP_DTYPES[cfg.param_dtype]
  for layer, site, module in _sites(model):
    for name in cfg.modules:
      if _SITE_OF[name] != site:
        continue
      w = getattr(module, name)
      names, shape, value = tuple(w.get_metadata()["out_sharding"]), tuple(w.shape), w.get_value()
      lead, k = (0 if layer is not None else 1), _IN_NDIM[name]
      layers = [layer] if layer is not None else range(shape[0])
      in_shape = shape[lead:lead + k]
      bound = 1.0 / math.sqrt(math.prod(in_shape))
      a = np.stack([np.random.default_rng([seed, LORA_MODULES.index(name), i]).uniform(-bound, bound, (*in_shape, r))
                    for i in layers]).astype(np.float32).astype(np_dtype)
      a = a[0] if layer is not None else a  # [L?, *in, r]
      b = np.zeros((*shape[:lead], r, *shape[lead + k:]), np_dtype)  # [L?, r, *out]
      a_names = names[:lead + k] + ("lora_rank",)
      b_names = names[:lead] + ("lora_rank",) + names[lead + k:]
      a_attr, b_attr = _factor_names(name)
      setattr(module, a_attr, LoraParam(_to_device(a, _target_sharding(value, a_names, a.shape, rules)),
                                        out_sharding=a_names, eager_sharding=False))
      setattr(module, b_attr, LoraParam(_to_device(b, _target_sharding(value, b_names, b.shape, rules)),
                                        out_sharding=b_names, eager_sharding=False))
  for _, _, module in _sites(model):
    module.lora_scale = cfg.scale
    module.lora_merged = False
  model.lora_config = cfg
  return model


def _target_sharding(like, names: tuple[str, ...], shape: tuple[int, ...], rules: LogicalRules | None):
  """Where a factor goes: the base weight ``like``'s mesh with the factor's logical ``names``."""
  if not _is_concrete(like):
    return None
  sharding = like.sharding
  if isinstance(sharding, NamedSharding):
    return (rules or LogicalRules.default()).sharding(names, sharding.mesh, shape)
  return sharding


def _to_device(x: np.ndarray, sharding) -> jax.Array:
  """``x`` placed with ``sharding`` (each device, on any host, takes its slice), or on the default device."""
  if sharding is None:
    return jnp.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def lora_state(model: Transformer) -> nnx.State:
  """The adapters' state (the trainable part)."""
  return nnx.state(model, LoraParam)


def split_lora(model: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """``(graphdef, adapters, base)``; ``nnx.merge(graphdef, adapters, base)`` rebuilds the model."""
  return nnx.split(model, LoraParam, ...)


def lora_loss(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """Turns ``loss_fn(params, batch, *extra)`` over the full state into one over the adapters alone.

  Returns ``f(adapters, batch, base, *extra) = loss_fn(merge_state(base, adapters), batch, *extra)``:
  pass it to :func:`jaxrl.train.make_train_step` and call ``step(state, batch, base)`` with
  ``state.params = adapters``; gradients and optimizer state then exist only for the adapters and
  the frozen base is an ordinary (non-donated) input.
  """
  def f(adapters, batch, base, *extra):
    base = jax.tree.map(lambda x: x, base)  # fresh Variables at this trace level (nnx refuses outer ones)
    return loss_fn(nnx.merge_state(base, adapters), batch, *extra)
  return f


def _delta(a: jax.Array, b: jax.Array, stacked: bool) -> jax.Array:
  """``A·B`` in float32: ``[*in, r] · [r, *out] -> [*in, *out]`` (per layer when stacked)."""
  prod = lambda a, b: jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1,
                                    precision=jax.lax.Precision.HIGHEST)
  return jax.vmap(prod)(a, b) if stacked else prod(a, b)


def _fold(model: Transformer, sign: float) -> None:
  for layer, _, module in _sites(model):
    if not hasattr(module, "lora_scale"):
      continue
    for name in LORA_MODULES:
      a_attr, b_attr = _factor_names(name)
      if not hasattr(module, a_attr):
        continue
      w = getattr(module, name)
      old = w.get_value()
      d = _delta(getattr(module, a_attr).get_value(), getattr(module, b_attr).get_value(), layer is None)
      new = (old.astype(jnp.float32) + sign * module.lora_scale * d).astype(old.dtype)
      w.set_value(jax.device_put(new, old.sharding) if _is_concrete(old) else new)
    module.lora_merged = sign > 0


def merge_lora(model: Transformer) -> Transformer:
  """Folds every adapter into its base weight, ``W <- W + s·A·B`` (in place), for fast sampling.

  The forward pass then skips the adapters (no double counting) and the sampler, which reads the
  projections directly, sees the adapted weights. With a bfloat16 base the fold rounds to bfloat16,
  so :func:`unmerge_lora` recovers the base only up to that rounding.
  """
  if not has_lora(model):
    raise ValueError("model has no LoRA adapters to merge")
  if has_merged_lora(model):
    raise ValueError("LoRA adapters are already merged")
  _fold(model, +1.0)
  return model


def unmerge_lora(model: Transformer) -> Transformer:
  """Undoes :func:`merge_lora`: ``W <- W - s·A·B`` (in place); the forward uses the adapters again."""
  if not has_lora(model):
    raise ValueError("model has no LoRA adapters to unmerge")
  if not has_merged_lora(model):
    raise ValueError("LoRA adapters are not merged")
  _fold(model, -1.0)
  return model


def has_merged_lora(model: Transformer) -> bool:
  """Whether ``model``'s adapters are folded into its weights (:func:`merge_lora`)."""
  return any(getattr(m, "lora_merged", False) for _, _, m in _sites(model))


def merged_base(model: Transformer) -> Transformer:
  """A plain :class:`Transformer` (no adapters) with ``W + s·A·B`` weights, e.g. for ``save_pretrained``.

  ``model`` is not changed. Arrays keep their shardings.
  """
  if not has_lora(model):
    raise ValueError("model has no LoRA adapters")
  graphdef, adapters, base = split_lora(model)
  # Fresh Variables: merge reuses the state's Variable objects, and folding writes into them.
  copy = nnx.merge(graphdef, *jax.tree.map(lambda x: x, (adapters, base)))
  if not has_merged_lora(copy):
    _fold(copy, +1.0)
  _, _, base = split_lora(copy)
  plain = nnx.eval_shape(lambda: Transformer(model.cfg, rngs=nnx.Rngs(0)))
  plain_graphdef, _ = nnx.split(plain)
  return nnx.merge(plain_graphdef, base)


@contextlib.contextmanager
def lora_disabled(model: Transformer | None = None):
  """Within the block every LoRA adapter is skipped: models run as their base.

  The switch acts on what is traced or run inside the block (call the model there, e.g. inside the
  jitted loss); a function jitted earlier and only *called* inside keeps its compiled behaviour.
  Raises for a merged ``model`` (its weights already include the adapters).
  """
  if model is not None and has_lora(model) and has_merged_lora(model):
    raise ValueError("LoRA adapters are merged into the weights; unmerge_lora before running the base")
  token = LORA_OFF.set(True)
  try:
    yield model
  finally:
    LORA_OFF.reset(token)


def base_logits(model: Transformer, tokens: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                **kwargs) -> jax.Array:
  """The frozen base's output ``[B, T, V]`` (gradient stopped): the KL reference of LoRA RL.

  Equal to the model before :func:`apply_lora`, computed with the same weights (no second copy).

  Args:
    model: an adapted (unmerged) model.
    tokens, positions, segment_ids: ``[B, T]`` as for :class:`Transformer`.
    **kwargs: further :class:`Transformer` arguments (``return_hidden``, ``cache``...).
  """
  with lora_disabled(model):
    out = model(tokens, positions=positions, segment_ids=segment_ids, **kwargs)
  return jax.lax.stop_gradient(out)


# --------------------------------------------------------------------------------------------------
# PEFT files


def _dims(cfg: ModelConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Our ``(*in, *out)`` of one layer's base weight."""
  d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  return {"q_proj": ((d,), (n, h)), "k_proj": ((d,), (k, h)), "v_proj": ((d,), (k, h)),
          "o_proj": ((n, h), (d,)), "gate_proj": ((d,), (f,)), "up_proj": ((d,), (f,)),
          "down_proj": ((f,), (d,))}[name]


def _peft_key(layer: int, name: str, factor: str) -> str:
  return f"base_model.model.model.layers.{layer}.{_HF_SITE[_SITE_OF[name]]}.{name}.lora_{factor}.weight"


def _host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_peft(model: Transformer, path: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
  """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads.

  Keys are PEFT's (checked with peft 0.21): ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
  ``[r, d_in]`` and ``...lora_B.weight`` ``[d_out, r]`` (``nn.Linear`` layout), likewise ``k/v/o_proj`` and
  ``mlp.{gate,up,down}_proj``. HF flattens ``(N, H)`` to ``N·H`` in our order, so ``lora_A = A.reshape(d_in, r).T``
  and ``lora_B = B.reshape(r, d_out).T``. On several hosts every process calls this; process 0 writes.

  Args:
    model: an adapted model (merged or not; the factors are saved either way).
    path: output directory (created).
    base_model_name_or_path: recorded in the config (PEFT uses it when no base model is passed).
  """
  from safetensors.numpy import save_file

  if not has_lora(model):
    raise ValueError("model has no LoRA adapters to save")
  lcfg, cfg = model.lora_config, model.cfg
  tensors: dict[str, np.ndarray] = {}
  for layer, _, module in _sites(model):
    for name in lcfg.modules:
      a_attr, b_attr = _factor_names(name)
      if not hasattr(module, a_attr):
        continue
      a, b = _host(getattr(module, a_attr).get_value()), _host(getattr(module, b_attr).get_value())
      layers = range(cfg.num_layers) if layer is None else [layer]
      for i in layers:
        ai, bi = (a[i], b[i]) if layer is None else (a, b)
        tensors[_peft_key(i, name, "A")] = np.ascontiguousarray(ai.reshape(-1, lcfg.rank).T)
        tensors[_peft_key(i, name, "B")] = np.ascontiguousarray(bi.reshape(lcfg.rank, -1).T)
  if jax.process_index() != 0:
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / SAFETENSORS_NAME), metadata={"format": "pt"})
  alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else float(lcfg.alpha)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": lcfg.rank, "lora_alpha": alpha, "use_rslora": lcfg.rslora, "target_modules": list(lcfg.modules),
      "lora_dropout": 0.0, "bias": "none", "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
      "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
      "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
  }
  (path / CONFIG_NAME).write_text(json.dumps(config, indent=2))


_UNSUPPORTED_KEYS = ("use_dora", "use_qalora", "lora_bias", "fan_in_fan_out", "modules_to_save",
                     "layers_to_transform", "layer_replication", "rank_pattern", "alpha_pattern",
                     "trainable_token_indices", "target_parameters", "alora_invocation_tokens", "use_bdlora",
                     "arrow_config")
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
"""``init_lora_weights`` schemes that also rewrite the base weights; their adapters need that base."""


def read_peft_config(path: str | os.PathLike) -> dict[str, Any]:
  """``adapter_config.json`` of a PEFT LoRA directory, rejecting options this model cannot run."""
  file = Path(path) / CONFIG_NAME
  if not file.is_file():
    raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (is this a PEFT adapter directory?)")
  config = json.loads(file.read_text())
  if config.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{file}: peft_type {config['peft_type']!r} is not supported; only 'LORA'")
  for key in _UNSUPPORTED_KEYS:
    if config.get(key):
      raise ValueError(f"{file}: {key}={config[key]!r} is not supported by jaxrl's LoRA")
  if config.get("bias", "none") != "none":
    raise ValueError(f"{file}: bias={config['bias']!r} is not supported; only 'none'")
  init = config.get("init_lora_weights", True)
  if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
    raise ValueError(f"{file}: init_lora_weights={init!r} modifies the base weights; not supported")
  r = config.get("r")
  if isinstance(r, bool) or not isinstance(r, int) or r < 1:
    raise ValueError(f"{file}: r={r!r} must be an int >= 1")
  return config


def load_peft(model: Transformer, path: str | os.PathLike, *, param_dtype: str = "float32",
              rules: LogicalRules | None = None) -> Transformer:
  """Reads a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into ``model``.

  The targets are the modules the file holds (``target_modules`` may be a list, a regex or
  ``"all-linear"``); every layer must have them. Adds adapters with :func:`apply_lora` when the model
  has none, else overwrites matching ones. Inverse of :func:`save_peft`: ``A = lora_A.T.reshape(*in, r)``,
  ``B = lora_B.T.reshape(r, *out)``.

  Args:
    model: the base model the adapter was trained on (any sharding; modified in place).
    path: the adapter directory.
    param_dtype: adapter dtype when new adapters are added.
    rules: logical-to-mesh rules for new adapters.

  Returns:
    ``model``. Raises ValueError naming the key and both shapes when a tensor does not fit the base,
    and for options jaxrl cannot run (DoRA, biases, per-module ranks, ...).
  """
  from safetensors import safe_open

  path = Path(path)
  config = read_peft_config(path)
  file = path / SAFETENSORS_NAME
  if not file.is_file():
    raise FileNotFoundError(f"{path}: no {SAFETENSORS_NAME} (only safetensors adapters are supported)")
  cfg, r = model.cfg, config["r"]
  found: dict[tuple[int, str, str], np.ndarray] = {}
  with safe_open(str(file), framework="np") as f:
    keys = sorted(f.keys())
    unknown = [k for k in keys if not _PEFT_KEY.match(k)]
    if unknown:
      raise ValueError(f"{file}: tensors jaxrl cannot place (only layers.*.self_attn|mlp.*_proj.lora_A|B.weight): "
                       f"{sorted(unknown)[:8]}")
    for key in keys:
      layer, _, name, factor = _PEFT_KEY.match(key).groups()
      layer = int(layer)
      if layer >= cfg.num_layers:
        raise ValueError(f"{file}: tensor {key!r} is for layer {layer}, but the base model has {cfg.num_layers}")
      in_dims, out_dims = _dims(cfg, name)
      want = (r, math.prod(in_dims)) if factor == "A" else (math.prod(out_dims), r)
      got = tuple(f.get_slice(key).get_shape())
      if got != want:
        raise ValueError(f"{file}: tensor {key!r} has shape {list(got)}, but the base model expects {list(want)} "
                         f"(r={r}, {name}: d_in={math.prod(in_dims)}, d_out={math.prod(out_dims)})")
      found[(layer, name, factor)] = f.get_tensor(key)
  names = tuple(m for m in LORA_MODULES if any(k[1] == m for k in found))
  if not names:
    raise ValueError(f"{file}: no LoRA tensors")
  missing = [_peft_key(i, m, x) for m in names for i in range(cfg.num_layers) for x in "AB"
             if (i, m, x) not in found]
  if missing:
    raise ValueError(f"{file}: adapters must cover every layer of each targeted module; missing {missing[:4]}"
                     + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
  lcfg = LoraConfig(rank=r, alpha=config.get("lora_alpha", 8), targets=names,
                    rslora=bool(config.get("use_rslora", False)), param_dtype=param_dtype)
  if has_lora(model):
    have = model.lora_config
    if (have.rank, have.modules, have.scale) != (lcfg.rank, lcfg.modules, lcfg.scale):
      raise ValueError(f"{path}: adapter (rank {lcfg.rank}, targets {list(lcfg.modules)}, scale {lcfg.scale}) does not "
                       f"match the model's (rank {have.rank}, targets {list(have.modules)}, scale {have.scale})")
    if has_merged_lora(model):
      raise ValueError("LoRA adapters are merged; unmerge_lora before loading new ones")
  else:
    apply_lora(model, lcfg, rules=rules)
  for layer, _, module in _sites(model):
    for name in lcfg.modules:
      a_attr, b_attr = _factor_names(name)
      if not hasattr(module, a_attr):
        continue
      in_dims, out_dims = _dims(cfg, name)
      layers = range(cfg.num_layers) if layer is None else [layer]
      a = np.stack([found[(i, name, "A")].T.reshape(*in_dims, r) for i in layers])
      b = np.stack([found[(i, name, "B")].T.reshape(r, *out_dims) for i in layers])
      for attr, value in ((a_attr, a), (b_attr, b)):
        var = getattr(module, attr)
        old = var.get_value()
        value = value if layer is None else value[0]
        value = jnp.asarray(value.astype(np.float32)).astype(old.dtype)
        var.set_value(jax.device_put(value, old.sharding) if _is_concrete(old) else value)
  return model


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

