"""Device meshes and the logical-axis rules that map model axes onto them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
"""Mesh axis names jaxrl knows, outermost first (``tensor`` innermost: fastest interconnect)."""


def make_mesh(shape: Mapping[str, int] | None = None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh over all (or the given) devices, e.g. ``{"data": -1, "fsdp": 1, "tensor": 1}``.

  One axis may be ``-1``: it takes the devices the others leave. Axes not named get size 1, so every
  mesh has all of :data:`MESH_AXES` and sharding rules never refer to a missing axis.
  """
  shape = dict(shape or {"data": -1})
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid axes: {list(MESH_AXES)}")
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  free = [a for a, s in shape.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {free}")
  for a, s in shape.items():
    if s != -1 and (not isinstance(s, int) or s < 1):
      raise ValueError(f"mesh axis {a!r} must be a positive int or -1, got {s!r}")
  fixed = math.prod(s for s in shape.values() if s != -1)
  if free:
    if n % fixed:
      raise ValueError(f"mesh {shape}: {n} devices are not divisible by the fixed axes' product {fixed}")
    shape[free[0]] = n // fixed
  sizes = tuple(shape.get(a, 1) for a in MESH_AXES)
  if math.prod(sizes) != n:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {n}")
  if devices == list(jax.devices()):
    device_array = jax.make_mesh(sizes, MESH_AXES, devices=devices).devices
  else:
    device_array = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(device_array, MESH_AXES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogicalRules:
  """Maps logical axis names (``embed``, ``heads``, ...) to mesh axes; the only place that does.

  Each logical name maps to ``None`` (replicated), one mesh axis, or a tuple of mesh axes. A
  partition spec never uses one mesh axis twice: :meth:`spec` raises if two logical axes of one
  array would.
  """

  rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]

  def __post_init__(self):
    seen = set()
    for item in self.rules:
      if len(item) != 2:
        raise ValueError(f"sharding rule {item!r} must be a (logical_name, mesh_axes) pair")
      name, axes = item
      if name in seen:
        raise ValueError(f"logical axis {name!r} appears twice in the sharding rules")
      seen.add(name)
      for a in _as_tuple(axes):
        if a not in MESH_AXES:
          raise ValueError(f"sharding rule {name!r} -> {a!r}: unknown mesh axis; valid: {list(MESH_AXES)}")

  @classmethod
  def default(cls) -> LogicalRules:
    """FSDP shards weights' model dimension over ``fsdp``; tensor parallelism shards heads/mlp/vocab."""
    return cls(rules=DEFAULT_RULES)

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, str | Sequence[str] | None]) -> LogicalRules:
    return cls(rules=tuple((k, v if v is None or isinstance(v, str) else tuple(v)) for k, v in mapping.items()))

  def mesh_axes(self, name: str | None) -> tuple[str, ...]:
    if name is None:
      return ()
    for n, axes in self.rules:
      if n == name:
        return _as_tuple(axes)
    raise KeyError(f"logical axis {name!r} has no sharding rule; known: {[n for n, _ in self.rules]}")

  def spec(self, names: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry logical ``names``.

    A dimension whose size is not divisible by its mesh axes' product is replicated instead
    (e.g. 2 kv heads on a 4-way tensor axis); :meth:`fallbacks` lists such cases for reporting.
    """
    used: dict[str, str] = {}
    parts = []
    for i, name in enumerate(names):
      axes = tuple(a for a in self.mesh_axes(name) if mesh.shape[a] > 1)
      for a in axes:
        if a in used:
          raise ValueError(
              f"logical axes {used[a]!r} and {name!r} of one array both map to mesh axis {a!r}")
        used[a] = name
      if shape is not None and axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
        axes = ()
      parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)

  def sharding(self, names: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, self.spec(names, mesh, shape))

  def fallbacks(self, names: Sequence[str | None], mesh: Mesh, shape: Sequence[int]) -> list[str]:
    """Human-readable notes for dimensions :meth:`spec` replicates because they do not divide."""
    notes = []
    for i, name in enumerate(names):
      axes = tuple(a for a in self.mesh_axes(name) if mesh.shape[a] > 1)
      size = math.prod(mesh.shape[a] for a in axes) if axes else 1
      if axes and shape[i] % size:
        notes.append(f"{name}={shape[i]} not divisible by {'x'.join(axes)}={size}: replicated")
    return notes


def _as_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("layers", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("lora_rank", None),
    # KV cache
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
    ("cache_kv_heads", "tensor"),
)


def logical_sharding(names: Sequence[str | None], mesh: Mesh, rules: LogicalRules | None = None,
                     shape: Sequence[int] | None = None) -> NamedSharding:
  """``NamedSharding`` for logical axis ``names`` under ``rules`` (default rules if None)."""
  return (rules or LogicalRules.default()).sharding(names, mesh, shape)


def batch_sharding(mesh: Mesh, rules: LogicalRules | None = None, ndim: int = 2) -> NamedSharding:
  """Sharding of a ``[batch, seq, ...]`` input array: batch over the data-parallel axes."""
  return logical_sharding(("batch", "seq") + (None,) * (ndim - 2), mesh, rules)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """The ``mesh:`` section of a config."""

  shape: dict[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
  "Mesh axis sizes over data/fsdp/sequence/tensor; one axis may be -1 (the remaining devices)."
  rules: dict[str, str | list[str] | None] = dataclasses.field(default_factory=dict)
  "Overrides of the default logical-axis rules, e.g. {embed: null} to stop FSDP sharding."

  def __post_init__(self):
    unknown = set(self.shape) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"shape: unknown axes {sorted(unknown)}; valid: {list(MESH_AXES)}")
    known = {n for n, _ in DEFAULT_RULES}
    bad = set(self.rules) - known
    if bad:
      raise ValueError(f"rules: unknown logical axes {sorted(bad)}; known: {sorted(known)}")

  def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
    return make_mesh(self.shape, devices=devices)

  def logical_rules(self) -> LogicalRules:
    merged = dict(DEFAULT_RULES)
    merged.update({k: v if v is None or isinstance(v, str) else tuple(v) for k, v in self.rules.items()})
    return LogicalRules(rules=tuple(merged.items()))
