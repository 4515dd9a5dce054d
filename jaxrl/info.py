"""``jaxrl info``: what JAX sees, and the mesh (and model shapes) a config would build."""

from __future__ import annotations

import jax

from jaxrl import config as config_lib
from jaxrl import sharding


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
    from jaxrl.models import describe_model_section
    lines.extend(describe_model_section(data["model"], mesh, mesh_cfg.logical_rules()))
  return "\n".join(lines)
