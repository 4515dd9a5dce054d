"""The ``model:`` section of a config: a preset (random init) or a local HF directory."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import Mesh

from jaxrl.models._config import PRESETS, ModelConfig
from jaxrl.models._hf import config_from_dir, load_pretrained
from jaxrl.models._placement import abstract_model, init_model, state_shardings
from jaxrl.sharding import LogicalRules
from jaxrl import config as config_lib
from jaxrl.models._hf import load_tokenizer, save_pretrained


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
  """Where a model comes from. Exactly one of ``preset`` / ``hf_dir``."""

  preset: str | None = None
  "Name in jaxrl.models.PRESETS (shapes only; weights are randomly initialised)."
  hf_dir: str | None = None
  "Local Hugging Face directory (config.json + *.safetensors)."
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  "ModelConfig fields, e.g. {dtype: bfloat16, param_dtype: float32, remat: dots}; dtype = compute, param_dtype = storage (default float32)."
  seed: int = 0
  "Initialisation seed for presets."

  def __post_init__(self):
    if (self.preset is None) == (self.hf_dir is None):
      raise ValueError(f"model: give exactly one of preset / hf_dir (got preset={self.preset!r}, "
                       f"hf_dir={self.hf_dir!r})")
    if self.preset is not None and self.preset not in PRESETS:
      raise ValueError(f"model.preset: unknown {self.preset!r}; known: {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = set(self.overrides) - known
    if bad:
      raise ValueError(f"model.overrides: unknown ModelConfig fields {sorted(bad)}")

  def config(self) -> ModelConfig:
    """The config :meth:`build` uses, without reading weights (``hf_dir``: only config.json)."""
    if self.preset is not None:
      return dataclasses.replace(PRESETS[self.preset](), **self.overrides)
    from pathlib import Path
    path = Path(self.hf_dir) / "config.json"
    if not path.is_file():
      raise FileNotFoundError(f"model.hf_dir: {path} not found")
    return config_from_dir(self.hf_dir, **self.overrides)

  def build(self, *, mesh: Mesh | None = None, rules: LogicalRules | None = None):
    """The model, each parameter placed with its sharding on ``mesh``."""
    if self.preset is not None:
      return init_model(self.config(), mesh=mesh, rules=rules, seed=self.seed)
    return load_pretrained(self.hf_dir, mesh=mesh, rules=rules, **self.overrides)

  def abstract(self, *, mesh: Mesh | None = None, rules: LogicalRules | None = None):
    """The model with shape-only leaves (placed on ``mesh`` if given); see :func:`abstract_model`."""
    return abstract_model(self.config(), mesh=mesh, rules=rules)


def describe_model_section(section: dict[str, Any], mesh: Mesh, rules: LogicalRules) -> list[str]:
  """Lines for ``jaxrl info``: the model's shapes, size and per-parameter shardings (no weights)."""
  from flax import nnx
  source = config_lib.from_dict(ModelSource, section, prefix="model")
  cfg = source.config()
  lines = [f"model: {cfg.model_type} layers={cfg.num_layers} d={cfg.hidden_size} heads={cfg.num_heads}/"
           f"{cfg.num_kv_heads} head_dim={cfg.head_dim} mlp={cfg.intermediate_size} vocab={cfg.vocab_size} "
           f"params={cfg.num_params() / 1e9:.3f}B dtype={cfg.dtype}/{cfg.param_dtype}"]
  _, abs_state = nnx.split(source.abstract())
  shardings = state_shardings(abs_state, mesh, rules)
  notes = set()
  per_device = 0
  for (path, var), (_, shard) in zip(nnx.to_flat_state(abs_state), nnx.to_flat_state(shardings)):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    shard = shard.get_value() if hasattr(shard, "get_value") else getattr(shard, "value", shard)
    names = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
    if names:
      notes.update(rules.fallbacks(names, mesh, value.shape))
    per_device += math.prod(shard.shard_shape(value.shape)) * value.dtype.itemsize
  lines.append(f"parameter bytes per device: {per_device / 2**30:.3f} GiB")
  lines.extend(f"  note: {n}" for n in sorted(notes))
  return lines


def convert(src: str | None, dst: str, *, dtype: str | None = None, tokenizer: str | None = None,
            preset: str | None = None) -> str:
  """``jaxrl convert``: re-save an HF dir through jaxrl (e.g. to bf16), or write a random preset."""
  if (src is None) == (preset is None):
    raise ValueError("convert: give a source directory or --preset, not both")
  if preset is not None:
    model = ModelSource(preset=preset).build()
  else:
    model = load_pretrained(src)
    dtype = dtype or model.cfg.dtype  # keep the source's dtype (the compute dtype defaults to it)
  tok_dir = tokenizer or src
  tok = None
  if tok_dir is not None:
    from pathlib import Path
    if any((Path(tok_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
      tok = load_tokenizer(tok_dir)
  save_pretrained(model, dst, tokenizer=tok, dtype=dtype)
  return f"wrote {dst} ({model.cfg.model_type}, {model.cfg.num_params() / 1e6:.1f}M params)"
