"""LoRA adapters on every projection of the decoder: adding, splitting, merging, switching off.

PEFT files are read and written by :mod:`jaxrl.models._peft`; parameter/FLOP accounting and the note's
learning-rate rules live in :mod:`jaxrl.models._lora_budget`.

``W' = W + (alpha / r)·B·A`` (Hu et al. 2021), computed as ``x·W + s·((x·A)·B)`` so ``W'`` is
never formed while training; ``s = alpha / r`` or, with rsLoRA, ``alpha / sqrt(r)`` (Kalajdzievski
2023). In this model's ``[in, out]`` layout ``A`` is ``[*in, r]`` and ``B`` is ``[r, *out]``
(``q_proj [D, N, H]``: ``A [D, r]``, ``B [r, N, H]``; ``o_proj [N, H, D]``: ``A [N, H, r]``,
``B [r, D]``). PEFT's initialisation: ``A ~ U(-1/sqrt(d_in), 1/sqrt(d_in))`` (``kaiming_uniform_(a=√5)``),
``B = 0``, so the adapted model starts equal to the base.

A VLM may also adapt its vision tower (``LoraConfig.vision_targets``: each block's ``qkv``/``proj`` and MLP, the
merger's ``fc1``/``fc2``); the tower's base weights stay frozen like the decoder's.

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

Reference: "LoRA Without Regret" (Thinking Machines, 2025), project notes seeds/000_66f2e4027e8fa57d.txt
lines 205-580 (parametrisation 392-446, LR ratio 449-478, FLOPs 537-562, parameter table 329-352).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
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

VISION_LORA_MODULES = ("qkv", "proj", "gate", "up", "down", "fc1", "fc2", "merger.fc1", "merger.fc2")
"""Vision-tower projections LoRA can adapt (a VLM's ``visual``): each block's attention ``qkv``/``proj``, its MLP
(``gate``/``up``/``down``: Qwen2.5-VL; ``fc1``/``fc2``: Qwen2-VL) and the patch merger's two linears. HF/PEFT
module names: ``visual.blocks.{i}.attn.qkv|proj``, ``visual.blocks.{i}.mlp.gate_proj|up_proj|down_proj|fc1|fc2``,
``visual.merger.mlp.0|2``."""
VISION_TARGET_SETS = {"attn": ("qkv", "proj"), "mlp": ("gate", "up", "down", "fc1", "fc2"),
                      "merger": ("merger.fc1", "merger.fc2")}
VISION_TARGET_SETS["all"] = VISION_LORA_MODULES
_ALL_KEYS = LORA_MODULES + VISION_LORA_MODULES
_VISION_HF = {"qkv": ("attn.qkv", 1), "proj": ("attn.proj", 2), "gate": ("mlp.gate_proj", 1),
              "up": ("mlp.up_proj", 1), "down": ("mlp.down_proj", 1), "fc1": ("mlp.fc1", 1), "fc2": ("mlp.fc2", 1)}
"""A vision block's projection -> (HF module path under ``visual.blocks.{i}``, leading input axes)."""
_HF_SITE = {"attn": "self_attn", "mlp": "mlp"}

LORA_LR_MULTIPLIER = 10.0
"""LoRA LR / full-FT LR for long runs: the note measures 9.8 over 14 models (seeds file line 466) and
rounds to 10 (line 451: "LoRA 的最优学习率始终是 ... FullFT 最优学习率的 10 倍")."""

_SITE_OF = {**{m: "attn" for m in ATTN_MODULES}, **{m: "mlp" for m in MLP_MODULES}}
_IN_NDIM = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
"""Leading input axes of each base weight (``o_proj [N, H, D]`` contracts ``N, H``)."""
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


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
  vision_targets: str | tuple[str, ...] = ()
  "VLMs: also adapt the vision tower: 'all', 'attn', 'mlp', 'merger', or a list of those groups and names from "
  "VISION_LORA_MODULES; () (default) leaves the tower to its base weights."
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
      if bad or not (targets or self.vision_targets):
        raise ValueError(f"lora.targets: unknown module names {bad} (valid: {list(LORA_MODULES)}, or one of "
                         f"{list(TARGET_SETS)})" if bad else "lora.targets: empty list; name at least one module")
      if len(set(targets)) != len(targets):
        raise ValueError(f"lora.targets: duplicate module names in {list(targets)}")
      object.__setattr__(self, "targets", targets)
    object.__setattr__(self, "vision_targets", _check_vision_targets(self.vision_targets))

  @property
  def vision_modules(self) -> tuple[str, ...]:
    """The targeted vision projections in :data:`VISION_LORA_MODULES` order (those a tower lacks are skipped)."""
    chosen = {m for t in self.vision_targets for m in VISION_TARGET_SETS.get(t, (t,))}
    return tuple(m for m in VISION_LORA_MODULES if m in chosen)

  @property
  def modules(self) -> tuple[str, ...]:
    """The targeted projections in canonical order (q, k, v, o, gate, up, down)."""
    chosen = TARGET_SETS[self.targets] if isinstance(self.targets, str) else self.targets
    return tuple(m for m in LORA_MODULES if m in chosen)

  @property
  def scale(self) -> float:
    """``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``."""
    return float(self.alpha) / (math.sqrt(self.rank) if self.rslora else self.rank)


def _check_vision_targets(value) -> tuple[str, ...]:
  """``lora.vision_targets`` as a tuple of group and module names, or a ValueError naming the bad entries."""
  value = (value,) if isinstance(value, str) else tuple(value)
  bad = [t for t in value if t not in VISION_TARGET_SETS and t not in VISION_LORA_MODULES]
  if bad:
    raise ValueError(f"lora.vision_targets: unknown names {bad} (groups {list(VISION_TARGET_SETS)} or modules "
                     f"{list(VISION_LORA_MODULES)})")
  if len(set(value)) != len(value):
    raise ValueError(f"lora.vision_targets: duplicate names in {list(value)}")
  return value


# --------------------------------------------------------------------------------------------------
# Adding, splitting, merging


@dataclasses.dataclass(frozen=True)
class _Site:
  """One adaptable weight: ``module.name``, its target key (``q_proj``, ``qkv``, ``merger.fc1``...), its HF
  module path (``{i}`` = layer), the HF layers it covers, whether it is stacked on a leading layer axis, and
  how many leading axes are its input (``o_proj``/``proj``: 2)."""

  module: Any
  name: str
  key: str
  path: str
  layers: tuple[int, ...]
  stacked: bool
  in_ndim: int

  def dims(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(*in, *out)`` of one layer's weight."""
    shape = tuple(getattr(self.module, self.name).shape)[int(self.stacked):]
    return shape[:self.in_ndim], shape[self.in_ndim:]


def _all_sites(model: Transformer) -> list[_Site]:
  """Every adaptable weight of ``model``: the decoder's projections, then (a VLM) the tower's blocks and merger.
  HF paths are relative to the ``model.`` prefix transformers gives both (``layers.{i}.self_attn.q_proj`` for a
  text model, ``language_model.layers.{i}...`` and ``visual.blocks.{i}.attn.qkv`` for a VLM)."""
  lm = "language_model." if model.cfg.vision is not None else ""
  out = []
  for layer, site, module in _sites(model):
    layers = tuple(range(model.cfg.num_layers)) if layer is None else (layer,)
    for name in (ATTN_MODULES if site == "attn" else MLP_MODULES):
      out.append(_Site(module, name, name, f"{lm}layers.{{i}}.{_HF_SITE[site]}.{name}", layers, layer is None,
                       _IN_NDIM[name]))
  visual = getattr(model, "visual", None)
  if visual is None:
    return out
  scanned = visual.scan_layers
  for layer, block in ([(None, visual.blocks)] if scanned else list(enumerate(visual.blocks))):
    layers = tuple(range(visual.cfg.depth)) if layer is None else (layer,)
    for name, (hf, k) in _VISION_HF.items():
      if hasattr(block, name):
        out.append(_Site(block, name, name, f"visual.blocks.{{i}}.{hf}", layers, layer is None, k))
  for name, hf in (("fc1", "0"), ("fc2", "2")):
    out.append(_Site(visual.merger, name, f"merger.{name}", f"visual.merger.mlp.{hf}", (0,), False, 1))
  return out


def _lora_sites(model: Transformer) -> list[_Site]:
  """The sites of ``model`` that hold adapters."""
  return [s for s in _all_sites(model) if hasattr(s.module, _factor_names(s.name)[0])]


def _modules(model: Transformer) -> list[nnx.Module]:
  """Every module that owns an adaptable weight, once."""
  return list({id(s.module): s.module for s in _all_sites(model)}.values())


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
  """Adds LoRA factors to the targeted projections of ``model`` (in place) and returns it: the decoder's
  ``cfg.modules`` and, for a VLM, the tower's ``cfg.vision_modules`` (blocks stacked like the decoder's; the
  merger's ``fc1``/``fc2`` unstacked).

  ``A [L, *in, r] ~ U(-1/sqrt(d_in), 1/sqrt(d_in))`` with ``d_in = prod(*in)`` (PEFT's
  ``kaiming_uniform_(a=sqrt(5))``), drawn on the host per layer from
  ``numpy.random.default_rng([seed, module, layer])`` (``module`` the index in ``LORA_MODULES +
  VISION_LORA_MODULES``; no compilation; scanned and looped models get
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
  if cfg.vision_targets and getattr(model, "visual", None) is None:
    raise ValueError(f"lora.vision_targets={list(cfg.vision_targets)}: model_type {model.cfg.model_type!r} has no "
                     "vision tower")
  r, np_dtype = cfg.rank, _NP_DTYPES[cfg.param_dtype]
  wanted = set(cfg.modules) | set(cfg.vision_modules)
  for site in _all_sites(model):
    if site.key not in wanted:
      continue
    w = getattr(site.module, site.name)
    names, shape, value = tuple(w.get_metadata()["out_sharding"]), tuple(w.shape), w.get_value()
    lead, k = int(site.stacked), site.in_ndim
    in_shape = shape[lead:lead + k]
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = np.stack([np.random.default_rng([seed, _ALL_KEYS.index(site.key), i]).uniform(-bound, bound, (*in_shape, r))
                  for i in site.layers]).astype(np.float32).astype(np_dtype)
    a = a if site.stacked else a[0]  # [L?, *in, r]
    b = np.zeros((*shape[:lead], r, *shape[lead + k:]), np_dtype)  # [L?, r, *out]
    a_names = names[:lead + k] + ("lora_rank",)
    b_names = names[:lead] + ("lora_rank",) + names[lead + k:]
    a_attr, b_attr = _factor_names(site.name)
    setattr(site.module, a_attr, LoraParam(_to_device(a, _target_sharding(value, a_names, a.shape, rules)),
                                           out_sharding=a_names, eager_sharding=False))
    setattr(site.module, b_attr, LoraParam(_to_device(b, _target_sharding(value, b_names, b.shape, rules)),
                                           out_sharding=b_names, eager_sharding=False))
  for module in _modules(model):
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
  for site in _lora_sites(model):
    a_attr, b_attr = _factor_names(site.name)
    w = getattr(site.module, site.name)
    old = w.get_value()
    d = _delta(getattr(site.module, a_attr).get_value(), getattr(site.module, b_attr).get_value(), site.stacked)
    new = (old.astype(jnp.float32) + sign * site.module.lora_scale * d).astype(old.dtype)
    w.set_value(jax.device_put(new, old.sharding) if _is_concrete(old) else new)
  set_lora_merged(model, sign > 0)


def set_lora_merged(model: Transformer, merged: bool) -> None:
  """Marks every adapted module of ``model`` merged (its forward skips the adapters) or not, without touching
  weights: for a copy whose weights already are (or are not) folded, e.g. an unstacked view of a merged model."""
  for module in _modules(model):
    if hasattr(module, "lora_scale"):
      module.lora_merged = bool(merged)


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
  return any(getattr(m, "lora_merged", False) for m in _modules(model))


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


def _dims(cfg: ModelConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Our ``(*in, *out)`` of one layer's base weight."""
  d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  return {"q_proj": ((d,), (n, h)), "k_proj": ((d,), (k, h)), "v_proj": ((d,), (k, h)),
          "o_proj": ((n, h), (d,)), "gate_proj": ((d,), (f,)), "up_proj": ((d,), (f,)),
          "down_proj": ((f,), (d,))}[name]
