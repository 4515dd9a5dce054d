"""PEFT adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors`` read into and
written from the LoRA adapters of :mod:`jaxrl.models._lora` (keys and config as ``peft`` writes them)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models._lora import (
    LORA_MODULES,
    VISION_LORA_MODULES,
    LoraConfig,
    _all_sites,
    _factor_names,
    _is_concrete,
    _lora_sites,
    _Site,
    apply_lora,
    has_lora,
    has_merged_lora,
)
from jaxrl.models._transformer import Transformer
from jaxrl.sharding import LogicalRules

SAFETENSORS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_PEFT_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


# --------------------------------------------------------------------------------------------------
# PEFT files


def _peft_key(site: _Site, layer: int, factor: str) -> str:
  return f"base_model.model.model.{site.path.format(i=layer)}.lora_{factor}.weight"


def _module_path(key: str, vlm: bool) -> str | None:
  """The HF module path (relative to ``model.``) a PEFT tensor key names, or None. A VLM's adapter may use
  transformers 5's names (``model.language_model.layers.*``, ``model.visual.*``) or the hub's older ones
  (``model.layers.*``, ``visual.*``)."""
  match = _PEFT_KEY.match(key)
  if match is None:
    return None
  path = match.group(1)
  path = path[len("model."):] if path.startswith("model.") else path
  return "language_model." + path if vlm and path.startswith("layers.") else path


def _target_modules(model: Transformer, sites: list[_Site]) -> str | list[str]:
  """``target_modules`` for ``adapter_config.json``: a text model's module names (as PEFT writes them); for a
  VLM a regex PEFT full-matches against module paths, so ``gate_proj`` in the decoder does not also adapt the
  tower's ``mlp.gate_proj`` (and a tower target does not reach the decoder)."""
  if model.cfg.vision is None:
    return [m for m in LORA_MODULES if any(s.key == m for s in sites)]
  paths = dict.fromkeys(re.escape("model." + s.path).replace(re.escape("{i}"), r"\d+") for s in sites)
  return "|".join(paths)


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
  and ``lora_B = B.reshape(r, d_out).T``. A VLM's keys are transformers 5's module paths:
  ``base_model.model.model.language_model.layers.{i}...``, and with tower adapters
  ``...model.visual.blocks.{i}.attn.qkv``, ``...visual.blocks.{i}.mlp.gate_proj``, ``...visual.merger.mlp.0``;
  its ``target_modules`` is a regex of exactly those paths. On several hosts every process calls this;
  process 0 writes.

  Args:
    model: an adapted model (merged or not; the factors are saved either way).
    path: output directory (created).
    base_model_name_or_path: recorded in the config (PEFT uses it when no base model is passed).
  """
  if not has_lora(model):
    raise ValueError("model has no LoRA adapters to save")
  lcfg = model.lora_config
  tensors: dict[str, np.ndarray] = {}
  sites = _lora_sites(model)
  for site in sites:
    a_attr, b_attr = _factor_names(site.name)
    a, b = _host(getattr(site.module, a_attr).get_value()), _host(getattr(site.module, b_attr).get_value())
    for j, i in enumerate(site.layers):
      ai, bi = (a[j], b[j]) if site.stacked else (a, b)
      tensors[_peft_key(site, i, "A")] = np.ascontiguousarray(ai.reshape(-1, lcfg.rank).T)
      tensors[_peft_key(site, i, "B")] = np.ascontiguousarray(bi.reshape(lcfg.rank, -1).T)
  if jax.process_index() != 0:
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / SAFETENSORS_NAME), metadata={"format": "pt"})
  alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else float(lcfg.alpha)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": lcfg.rank, "lora_alpha": alpha, "use_rslora": lcfg.rslora, "target_modules": _target_modules(model, sites),
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
  ``"all-linear"``); every layer must have them. For a VLM these may include the tower's (``visual.blocks.*``,
  ``visual.merger.mlp.*``: ``LoraConfig.vision_targets``), under transformers 5's or the hub's older prefixes.
  Adds adapters with :func:`apply_lora` when the model has none, else overwrites matching ones. Inverse of
  :func:`save_peft`: ``A = lora_A.T.reshape(*in, r)``, ``B = lora_B.T.reshape(r, *out)``.

  Args:
    model: the base model the adapter was trained on (any sharding; modified in place).
    path: the adapter directory.
    param_dtype: adapter dtype when new adapters are added.
    rules: logical-to-mesh rules for new adapters.

  Returns:
    ``model``. Raises ValueError naming the key and both shapes when a tensor does not fit the base,
    and for options jaxrl cannot run (DoRA, biases, per-module ranks, ...).
  """
  path = Path(path)
  config = read_peft_config(path)
  file = path / SAFETENSORS_NAME
  if not file.is_file():
    raise FileNotFoundError(f"{path}: no {SAFETENSORS_NAME} (only safetensors adapters are supported)")
  r = config["r"]
  sites = _all_sites(model)
  found = _read_peft_tensors(file, model, sites, r)
  keys = _targeted_keys(file, found, sites)
  lcfg = LoraConfig(rank=r, alpha=config.get("lora_alpha", 8),
                    targets=tuple(k for k in keys if k in LORA_MODULES),
                    vision_targets=tuple(k for k in keys if k in VISION_LORA_MODULES),
                    rslora=bool(config.get("use_rslora", False)), param_dtype=param_dtype)
  if has_lora(model):
    have = model.lora_config
    have_keys = tuple(dict.fromkeys(s.key for s in _lora_sites(model)))
    if (have.rank, have_keys, have.scale) != (lcfg.rank, keys, lcfg.scale):
      raise ValueError(f"{path}: adapter (rank {lcfg.rank}, targets {list(keys)}, scale {lcfg.scale}) does not "
                       f"match the model's (rank {have.rank}, targets {list(have_keys)}, scale {have.scale})")
    if has_merged_lora(model):
      raise ValueError("LoRA adapters are merged; unmerge_lora before loading new ones")
  else:
    apply_lora(model, lcfg, rules=rules)
  _set_adapters(model, lcfg.rank, found)
  return model


def _read_peft_tensors(file: Path, model: Transformer, sites: list[_Site],
                       r: int) -> dict[tuple[str, str], np.ndarray]:
  """Every ``lora_A`` / ``lora_B`` tensor of ``file`` by ``(HF module path, "A"|"B")``, in PEFT's layout, after
  checking its key and its shape against the base ``model``'s weight at rank ``r``."""
  vlm = model.cfg.vision is not None
  where = {s.path.format(i=i): s for s in sites for i in s.layers}  # HF module path -> its site
  found: dict[tuple[str, str], np.ndarray] = {}
  with safe_open(str(file), framework="np") as f:
    keys = sorted(f.keys())
    unknown = [k for k in keys if _module_path(k, vlm) not in where]
    if unknown:
      raise ValueError(f"{file}: tensors jaxrl cannot place (only lora_A|B weights of the decoder's *_proj and a VLM "
                       f"tower's attn.qkv|proj, mlp.*, merger.mlp.0|2, in this model's layers): {sorted(unknown)[:8]}")
    for key in keys:
      module, factor = _module_path(key, vlm), _PEFT_KEY.match(key).group(2)
      in_dims, out_dims = where[module].dims()
      want = (r, math.prod(in_dims)) if factor == "A" else (math.prod(out_dims), r)
      got = tuple(f.get_slice(key).get_shape())
      if got != want:
        raise ValueError(f"{file}: tensor {key!r} has shape {list(got)}, but the base model expects {list(want)} "
                         f"(r={r}, {where[module].key}: d_in={math.prod(in_dims)}, d_out={math.prod(out_dims)})")
      found[(module, factor)] = f.get_tensor(key)
  return found


def _targeted_keys(file: Path, found: dict[tuple[str, str], np.ndarray], sites: list[_Site]) -> tuple[str, ...]:
  """The target keys ``found`` adapts (decoder's in :data:`LORA_MODULES` order, then the tower's); each must have
  both factors in every layer."""
  hit = {s.key for s in sites for i in s.layers if (s.path.format(i=i), "A") in found or
         (s.path.format(i=i), "B") in found}
  keys = tuple(k for k in LORA_MODULES + VISION_LORA_MODULES if k in hit)
  if not keys:
    raise ValueError(f"{file}: no LoRA tensors")
  missing = [_peft_key(s, i, x) for s in sites if s.key in hit for i in s.layers for x in "AB"
             if (s.path.format(i=i), x) not in found]
  if missing:
    raise ValueError(f"{file}: adapters must cover every layer of each targeted module; missing {missing[:4]}"
                     + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
  return keys


def _set_adapters(model: Transformer, r: int, found: dict[tuple[str, str], np.ndarray]) -> None:
  """Writes the PEFT factors ``found`` into ``model``'s adapters: ``A = lora_A.T`` reshaped to ``[*in, r]``,
  ``B = lora_B.T`` reshaped to ``[r, *out]``, stacked over layers where the site is, each in its adapter's
  dtype and sharding."""
  for site in _lora_sites(model):
    in_dims, out_dims = site.dims()
    a = np.stack([found[(site.path.format(i=i), "A")].T.reshape(*in_dims, r) for i in site.layers])
    b = np.stack([found[(site.path.format(i=i), "B")].T.reshape(r, *out_dims) for i in site.layers])
    for attr, value in zip(_factor_names(site.name), (a, b)):
      var = getattr(site.module, attr)
      old = var.get_value()
      value = value if site.stacked else value[0]
      value = jnp.asarray(value.astype(np.float32)).astype(old.dtype)
      var.set_value(jax.device_put(value, old.sharding) if _is_concrete(old) else value)
