"""The ``model:`` section of a config: a preset (random init) or a local HF directory."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxrl.models._config import PRESETS, ModelConfig
from jaxrl.models._hf import abstract_model, init_model, load_pretrained
from jaxrl.sharding import LogicalRules


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
  """Where a model comes from. Exactly one of ``preset`` / ``hf_dir``."""

  preset: str | None = None
  "Name in jaxrl.models.PRESETS (shapes only; weights are randomly initialised)."
  hf_dir: str | None = None
  "Local Hugging Face directory (config.json + *.safetensors)."
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  "ModelConfig fields to override, e.g. {dtype: bfloat16, remat: dots, num_layers: 4}."
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
    """The model's shapes without reading weights (``hf_dir``: only config.json)."""
    if self.preset is not None:
      return dataclasses.replace(PRESETS[self.preset](), **self.overrides)
    import json
    from pathlib import Path
    path = Path(self.hf_dir) / "config.json"
    if not path.is_file():
      raise FileNotFoundError(f"model.hf_dir: {path} not found")
    cfg = ModelConfig.from_hf_config(json.loads(path.read_text()))
    return dataclasses.replace(cfg, **self.overrides)

  def build(self, *, mesh: Mesh | None = None, rules: LogicalRules | None = None):
    """The model, each parameter placed with its sharding on ``mesh``."""
    if self.preset is not None:
      return init_model(self.config(), mesh=mesh, rules=rules, seed=self.seed)
    return load_pretrained(self.hf_dir, mesh=mesh, rules=rules, **self.overrides)

  def abstract(self):
    return abstract_model(self.config())
