"""Per-layer parameter arrays for decoding: a ``scan_layers`` model rewritten with ``scan_layers=False``.

A scanned model stacks every block's weights on a leading ``layers`` axis; inside a decode loop XLA
CPU then materialises each layer's slice (a dynamic-slice copy of every weight, every step), which
about doubles the memory traffic of a memory-bound decode step. The unstacked copy holds one array
per layer, read in place. It costs one extra copy of the block weights while the sampler holds it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl import models
from jaxrl.sharding import LogicalRules


def _key(p):
  return p.key if hasattr(p, "key") else p


def _abstract_flat(cfg: models.ModelConfig, lora: models.LoraConfig | None, lora_merged: bool):
  model = models.abstract_model(dataclasses.replace(cfg, scan_layers=False))
  if lora is not None:  # the same adapters, one pair of factors per layer (shapes only)
    models.apply_lora(model, lora)
    models.set_lora_merged(model, lora_merged)
  return model


def _layer_slice(path) -> bool:
  """Whether a flat-model parameter path is one block's slice of a stacked parameter."""
  return path[0] == "layers" or path[:2] == ("visual", "blocks")


@functools.lru_cache(maxsize=16)
def _unstack_fn(graphdef, cfg: models.ModelConfig, mesh: Mesh | None, rules: LogicalRules | None,
                lora: models.LoraConfig | None = None, lora_merged: bool = False):
  flat_graphdef, abs_state = nnx.split(_abstract_flat(cfg, lora, lora_merged))
  paths = [tuple(_key(p) for p in path) for path, _ in nnx.to_flat_state(abs_state)]
  shardings = [v.get_value() for _, v in nnx.to_flat_state(models.state_shardings(abs_state, mesh, rules))]
  sliced = [_layer_slice(path) for path in paths]

  def unstack(stacked: dict) -> list:  # {stacked path: array} -> the per-block arrays, in `paths` order
    out = []
    for path in paths:
      if path[0] == "layers":
        out.append(stacked[("layers",) + path[2:]][path[1]])
      elif path[:2] == ("visual", "blocks"):  # a VLM's vision tower stacks its blocks likewise
        out.append(stacked[("visual", "blocks") + path[3:]][path[2]])
    return out

  layer_shardings = [s for s, keep in zip(shardings, sliced) if keep]
  return flat_graphdef, abs_state, paths, shardings, jax.jit(unstack, out_shardings=layer_shardings)


def unstack_layers(model, *, mesh: Mesh | None = None, rules: LogicalRules | None = None):
  """``model`` with ``scan_layers=False`` and one parameter array per block.

  The block weights are copied (one slice per layer); every other array (embedding, final norm, head)
  is ``model``'s own, not copied, where its placement already is the per-layer model's (else placed
  there), as an unscanned model's sampler shares them with the trainer.

  Args:
    model: a :class:`jaxrl.models.Transformer`; returned unchanged if it is not scanned. LoRA
      factors are unstacked like the weights they adapt (merged or not, as in ``model``).
    mesh, rules: placement of the per-layer arrays (default: one device).

  Returns:
    An equivalent :class:`jaxrl.models.Transformer` whose ``cfg.scan_layers`` is False.
  """
  cfg = model.cfg
  if not cfg.scan_layers:
    return model
  graphdef, state = nnx.split(model)
  lora = getattr(model, "lora_config", None)
  merged = lora is not None and models.has_merged_lora(model)
  flat_graphdef, abs_state, paths, shardings, fn = _unstack_fn(graphdef, cfg, mesh, rules, lora, merged)
  stacked = {tuple(_key(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}
  layers = iter(fn({k: v for k, v in stacked.items() if _layer_slice(k)}))
  values = []
  for path, target in zip(paths, shardings):
    if _layer_slice(path):
      values.append(next(layers))
      continue
    x = stacked[path]
    same = target is None or getattr(x, "sharding", None) == target
    values.append(x if same else jax.device_put(x, target))
  leaves = [(path, var.replace(x)) for (path, var), x in zip(nnx.to_flat_state(abs_state), values)]
  return nnx.merge(flat_graphdef, nnx.from_flat_state(leaves))
