"""Typed configuration: YAML files and ``key.sub=value`` overrides loaded into frozen dataclasses.

Every config in jaxrl is a frozen, keyword-only dataclass. :func:`from_dict` builds one from a
nested mapping, checking each key and type and naming the offending key (``sft.optim.lr``) in the
error; :func:`load` reads a YAML file and applies command-line overrides first.

Example::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Optim:
        lr: float = 1e-4
        "Peak learning rate."

    cfg = load(Optim, "optim.yaml", overrides=["lr=3e-4"])
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
  """A config key is unknown, missing or has a value of the wrong type."""


def _describe(value: Any) -> str:
  return f"{value!r} ({type(value).__name__})"


def _convert(tp: Any, value: Any, key: str) -> Any:
  """Checks ``value`` against the annotation ``tp`` and converts containers/dataclasses."""
  origin = get_origin(tp)
  if tp is Any:
    return value
  if origin is typing.Union or origin is types.UnionType:
    args = get_args(tp)
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _convert(arg, value, key)
      except ConfigError as e:
        errors.append(str(e))
    if len(errors) == 1:  # `X | None`: X's own error says what is wrong
      raise ConfigError(errors[0])
    raise ConfigError(f"{key}: {_describe(value)} matches none of {tp}" + "".join(f"\n  - {e}" for e in errors))
  if origin is Literal:
    if value not in get_args(tp):
      raise ConfigError(f"{key}: {_describe(value)} is not one of {list(get_args(tp))}")
    return value
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {_describe(value)}")
    return from_dict(tp, value, prefix=key)
  if origin in (tuple, list):
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {_describe(value)}")
    args = get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
      if len(args) != len(value):
        raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
      items = [_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    else:
      item_tp = args[0] if args else Any
      items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items
  if origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping, got {_describe(value)}")
    kt, vt = get_args(tp) or (Any, Any)
    return {_convert(kt, k, key): _convert(vt, v, f"{key}.{k}") for k, v in value.items()}
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}: expected a float, got {_describe(value)}")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}: expected an int, got {_describe(value)}")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}: expected true/false, got {_describe(value)}")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
    return value
  if isinstance(tp, type) and not isinstance(value, tp):
    raise ConfigError(f"{key}: expected {tp.__name__}, got {_describe(value)}")
  return value


def from_dict(cls: type[T], data: dict[str, Any], *, prefix: str = "") -> T:
  """Builds dataclass ``cls`` from ``data``; unknown keys and wrong types name the key."""
  if not isinstance(data, dict):
    raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {_describe(data)}")
  hints = get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  kwargs = {}
  for name, value in data.items():
    key = f"{prefix}.{name}" if prefix else str(name)
    if name not in fields:
      raise ConfigError(f"unknown config key {key!r}; valid keys: {sorted(fields)}")
    kwargs[name] = _convert(hints[name], value, key)
  for name, f in fields.items():
    if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
      key = f"{prefix}.{name}" if prefix else name
      raise ConfigError(f"missing required config key {key!r}")
  try:
    return cls(**kwargs)
  except (ValueError, TypeError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def to_dict(cfg: Any) -> Any:
  """The inverse of :func:`from_dict`: plain dicts, lists and scalars (YAML-safe)."""
  if dataclasses.is_dataclass(cfg):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
  if isinstance(cfg, (list, tuple)):
    return [to_dict(v) for v in cfg]
  if isinstance(cfg, dict):
    return {k: to_dict(v) for k, v in cfg.items()}
  return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
  """Applies ``a.b.c=value`` strings (value parsed as YAML) to a nested dict, returning a copy."""
  out = yaml.safe_load(yaml.safe_dump(data)) or {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
      raise ConfigError(f"override {item!r} has an empty key part")
    node = out
    for p in parts[:-1]:
      child = node.setdefault(p, {})
      if not isinstance(child, dict):
        raise ConfigError(f"override {item!r}: {p!r} is not a mapping")
      node = child
    node[parts[-1]] = yaml.safe_load(raw)
  return out


def read_yaml(path: str | Path) -> dict[str, Any]:
  """Reads a YAML mapping, with errors that name the file."""
  path = Path(path)
  if not path.is_file():
    raise ConfigError(f"config file not found: {path}")
  try:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: invalid YAML: {e}") from e
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
  return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
  """Loads dataclass ``cls`` from a YAML file (optional) plus ``key=value`` overrides."""
  data = read_yaml(path) if path is not None else {}
  data = apply_overrides(data, overrides)
  try:
    return from_dict(cls, data)
  except ConfigError as e:
    where = f"{path}: " if path is not None else ""
    raise ConfigError(f"{where}{e}") from e
