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

from jaxrl.models._config import ModelConfig
from jaxrl.models._lora import (
    LORA_MODULES,
    LoraConfig,
    _SITE_OF,
    _dims,
    _factor_names,
    _is_concrete,
    _sites,
    apply_lora,
    has_lora,
    has_merged_lora,
)
from jaxrl.models._transformer import Transformer
from jaxrl.sharding import LogicalRules

SAFETENSORS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_HF_SITE = {"attn": "self_attn", "mlp": "mlp"}
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(LORA_MODULES) + r")\.lora_([AB])\.weight$")


# --------------------------------------------------------------------------------------------------
# PEFT files


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
  path = Path(path)
  config = read_peft_config(path)
  file = path / SAFETENSORS_NAME
  if not file.is_file():
    raise FileNotFoundError(f"{path}: no {SAFETENSORS_NAME} (only safetensors adapters are supported)")
  cfg, r = model.cfg, config["r"]
  found = _read_peft_tensors(file, cfg, r)
  names = _targeted_modules(file, found, cfg.num_layers)
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
  _set_adapters(model, lcfg, found)
  return model


def _read_peft_tensors(file: Path, cfg: ModelConfig, r: int) -> dict[tuple[int, str, str], np.ndarray]:
  """Every ``lora_A`` / ``lora_B`` tensor of ``file`` by ``(layer, module, "A"|"B")``, in PEFT's layout,
  after checking its key and its shape against the base model ``cfg`` at rank ``r``."""
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
  return found


def _targeted_modules(file: Path, found: dict[tuple[int, str, str], np.ndarray], num_layers: int) -> tuple[str, ...]:
  """The modules ``found`` adapts (in :data:`LORA_MODULES` order); each must have both factors in every layer."""
  names = tuple(m for m in LORA_MODULES if any(k[1] == m for k in found))
  if not names:
    raise ValueError(f"{file}: no LoRA tensors")
  missing = [_peft_key(i, m, x) for m in names for i in range(num_layers) for x in "AB"
             if (i, m, x) not in found]
  if missing:
    raise ValueError(f"{file}: adapters must cover every layer of each targeted module; missing {missing[:4]}"
                     + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
  return names


def _set_adapters(model: Transformer, lcfg: LoraConfig, found: dict[tuple[int, str, str], np.ndarray]) -> None:
  """Writes the PEFT factors ``found`` into ``model``'s adapters: ``A = lora_A.T`` reshaped to ``[*in, r]``,
  ``B = lora_B.T`` reshaped to ``[r, *out]``, stacked over layers under ``scan_layers``, each in its
  adapter's dtype and sharding."""
  cfg, r = model.cfg, lcfg.rank
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
