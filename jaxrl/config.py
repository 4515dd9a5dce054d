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
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import re

import yaml


class _Loader(yaml.SafeLoader):
  """PyYAML's safe loader with YAML 1.2's float rule: ``3e-3`` and ``1E5`` are floats (YAML 1.1, and so
  PyYAML, reads a number with an exponent but no dot as a string, and ``optim.lr=3e-3`` failed)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _load(text: str):
  return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)

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


def check_kwargs(fn: Any, kwargs: dict[str, Any], *, key: str, reserved: frozenset[str] | set[str] = frozenset(),
                 what: str | None = None, extra_ok: bool | None = None) -> None:
  """Checks config-given keyword arguments against ``fn``'s signature, naming the offending key.

  A key must be a keyword parameter of ``fn`` that is not in ``reserved`` (inputs the caller
  supplies itself), and its value must match the parameter's annotation (same rules as
  :func:`from_dict`; a mapping for a dataclass-typed parameter is checked field by field). A key
  that only a ``**`` parameter would take counts as unknown when that parameter's name starts with
  ``_`` (``**_``: ignored), and is accepted for any other name (``**fields``: forwarded).

  Args:
    fn: the function the keywords will be bound to.
    kwargs: the keywords from the config.
    key: the config key holding ``kwargs`` (``algorithm.advantage_kwargs``), used in messages.
    reserved: parameter names the caller passes itself.
    what: how to call ``fn`` in messages (default its ``__name__``).
    extra_ok: whether ``fn``'s ``**`` parameter takes config keys; default by its name as above.

  Raises:
    ConfigError: unknown or reserved key, or a value of the wrong type.
  """
  if not isinstance(kwargs, dict):
    raise ConfigError(f"{key}: expected a mapping, got {_describe(kwargs)}")
  what = what or getattr(fn, "__name__", repr(fn))
  params = inspect.signature(fn).parameters
  named = {n: p for n, p in params.items()
           if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n not in reserved}
  var_kw = next((p for p in params.values() if p.kind is p.VAR_KEYWORD), None)
  open_kw = var_kw is not None and (not var_kw.name.startswith("_") if extra_ok is None else extra_ok)
  try:
    hints = get_type_hints(fn)
  except Exception:  # unresolvable annotations: check names only
    hints = {}
  for name, value in kwargs.items():
    sub = f"{key}.{name}"
    if name in reserved:
      raise ConfigError(f"{sub}: {name!r} is an input of {what} (an array the caller passes), not an option")
    if name not in named:
      if open_kw:
        continue
      raise ConfigError(f"unknown config key {sub!r}: {what} takes no {name!r}; valid keys: {sorted(named)}")
    if name in hints:
      tp = hints[name]
      classes = [a for a in (get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
      if isinstance(value, dict) and len(classes) == 1:  # `Config | dict`: check the mapping's fields too
        from_dict(classes[0], value, prefix=sub)
      else:
        _convert(tp, value, sub)


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
  out = _load(yaml.safe_dump(data, sort_keys=False)) or {}  # the file's key order (first-match maps)
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
    node[parts[-1]] = _load(raw)
  return out


def read_yaml(path: str | Path) -> dict[str, Any]:
  """Reads a YAML mapping, with errors that name the file."""
  path = Path(path)
  if not path.is_file():
    raise ConfigError(f"config file not found: {path}")
  try:
    data = _load(path.read_text(encoding="utf-8"))
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


BENCHMARK_TASKS = ("math", "code", "custom", "recipe")
"""How a benchmark's responses are scored: the math reward, the code sandbox, a reward by import path, or the
recipe's own ``reward:`` section (``reward.fn``, ``reward.kwargs``, ``reward.correct_threshold``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Benchmark:
  """One entry of a recipe's ``eval.benchmarks:`` list: a local JSONL file and the protocol a paper reports it
  with (``jaxrl eval --config RECIPE [--benchmark NAME]``, docs/eval.md). The trainers ignore it; the plan
  covers its engine programs (``jaxrl plan``)."""

  name: str
  "Short name (``--benchmark NAME``; the records go to ``<out>/<name>``)."
  data: str
  "A JSONL file the user supplies (nothing is shipped or downloaded); relative paths are read from the cwd."
  task: str = "math"
  "One of :data:`BENCHMARK_TASKS`."
  reward: str | None = None
  "``task: custom``: the reward's import path ``module:function``."
  reward_kwargs: dict[str, Any] | None = None
  "``task: custom``: keyword arguments bound to that reward (as ``reward.kwargs`` of ``jaxrl rl``)."
  require_think: bool = False
  "``task: math``: a response without ``<think>...</think>`` is wrong."
  prompt_field: str | None = None
  "Column holding the prompt text (default: ``prompt`` or ``messages``)."
  answer_field: str | None = None
  "Column holding the reference answer (default: ``answer``)."
  template: str = "{prompt}"
  "Format of a text prompt, with ``{prompt}``."
  n: int = 16
  "Samples per problem."
  metrics: str = ""
  "Comma-separated ``KIND@k`` (avg/pass/maj); empty: ``avg@n,pass@1,pass@n,maj@n``."
  temperature: float = 0.6
  top_p: float = 0.95
  top_k: int = 0
  max_new_tokens: int = 1024
  max_prompt_tokens: int = 1024
  stop: tuple[str, ...] = ()
  "Strings that end a response."
  seed: int = 0
  correct_threshold: float | None = None
  "A sample is correct when its reward is above this (default: the recipe's ``reward.correct_threshold``, else 0.5)."

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
      raise ValueError(f"name must be letters, digits, '_', '.' or '-' (a directory name), got {self.name!r}")
    if self.task not in BENCHMARK_TASKS:
      raise ValueError(f"task must be one of {list(BENCHMARK_TASKS)}, got {self.task!r}")
    if (self.task == "custom") != (self.reward is not None):
      raise ValueError(f"reward (an import path) goes with task custom and only with it (task {self.task!r}, "
                       f"reward {self.reward!r})")
    if self.reward_kwargs is not None and self.task != "custom":
      raise ValueError(f"reward_kwargs go with task custom only (task {self.task!r}; task recipe takes the "
                       "recipe's reward.kwargs)")
    if "{prompt}" not in self.template:
      raise ValueError(f"template must hold {{prompt}}, got {self.template!r}")
    if min(self.n, self.max_new_tokens, self.max_prompt_tokens) < 1:
      raise ValueError("n, max_new_tokens and max_prompt_tokens must be >= 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f"bad sampling settings: temperature={self.temperature}, top_p={self.top_p}, "
                       f"top_k={self.top_k}")


def read_benchmarks(data: dict[str, Any], *, where: str = "") -> tuple[Benchmark, ...]:
  """The ``eval.benchmarks`` list of a recipe mapping (``()`` when absent), each entry checked as
  :class:`Benchmark` with errors naming ``eval.benchmarks[i].key`` (prefixed by ``where``, e.g. the file);
  names must be unique."""
  section = data.get("eval") or {}
  items = section.get("benchmarks", ()) if isinstance(section, dict) else ()
  prefix = f"{where}: " if where else ""
  if not isinstance(items, (list, tuple)):
    raise ConfigError(f"{prefix}eval.benchmarks: expected a list, got {_describe(items)}")
  out = []
  for i, item in enumerate(items):
    try:
      out.append(from_dict(Benchmark, item, prefix=f"eval.benchmarks[{i}]"))
    except ConfigError as e:
      raise ConfigError(f"{prefix}{e}") from None
  names = [b.name for b in out]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ConfigError(f"{prefix}eval.benchmarks: names must be unique, {dup} repeat")
  return tuple(out)
