"""``jaxrl info``: what JAX sees, and the mesh (and model shapes, and the rollout engine's KV budget) a
config would build."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxrl import config as config_lib
from jaxrl import models, plan, sharding
from jaxrl.models import describe_model_section
from jaxrl.rl import RLConfig


def _model_section(data: dict) -> tuple[dict, str | None]:
  """The model section, with the recipe's ``plan.preset`` standing in for a checkpoint that is not here
  (real-size recipes name a local HF directory); the note says so."""
  section = dict(data["model"])
  preset = (data.get("plan") or {}).get("preset")
  hf_dir = section.get("hf_dir")
  if preset and section.get("preset") is None and hf_dir and not (Path(hf_dir) / "config.json").is_file():
    section.update(preset=preset, hf_dir=None)
    return section, f"shapes from plan.preset={preset} ({hf_dir}/config.json is not here)"
  return section, None


def describe(config_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
  lines = [
      f"jax {jax.__version__}  backend={jax.default_backend()}",
      f"processes: {jax.process_count()} (this is process {jax.process_index()})",
      f"devices: {jax.device_count()} global, {jax.local_device_count()} local: "
      + ", ".join(sorted({d.device_kind for d in jax.devices()})),
  ]
  data = config_lib.read_yaml(config_path) if config_path else {}
  data = config_lib.apply_overrides(data, overrides)
  mesh_cfg = config_lib.from_dict(sharding.MeshConfig, data.get("mesh", {}), prefix="mesh")
  mesh = mesh_cfg.build()
  lines.append("mesh: " + " × ".join(f"{a}={n}" for a, n in mesh.shape.items()))
  if "model" in data:
    section, note = _model_section(data)
    if note:
      lines.append(f"note: {note}")
    lines.extend(describe_model_section(section, mesh, mesh_cfg.logical_rules()))
    if (data.get("rollout") or {}).get("engine"):
      lines.extend(engine_lines(data, section, mesh))
  return "\n".join(lines)


def engine_lines(data: dict, model_section: dict, mesh) -> list[str]:
  """The rollout engine's KV budget per device on ``mesh``, per distinct ``max_len`` of the stages."""
  cfg = config_lib.from_dict(RLConfig, {**data, "model": model_section})
  model_cfg = config_lib.from_dict(models.ModelSource, model_section, prefix="model").config()
  try:
    found = plan.recipe_budgets(cfg, model_cfg, mesh)
  except ValueError as e:  # kv_cache_fraction: known only once the engine sees free memory
    return [f"engine KV budget: {e}"]
  return [line for tag, b in found for line in b.lines(f"stages {tag}, on this mesh")]
