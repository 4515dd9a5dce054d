"""The typed YAML config loader: types, unknown keys and overrides name the key."""

import dataclasses
from typing import Literal

import pytest

from jaxrl import config as config_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
  lr: float = 1e-3
  mode: Literal["a", "b"] = "a"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
  name: str
  steps: int = 10
  inner: Inner = dataclasses.field(default_factory=Inner)
  sizes: tuple[int, ...] = ()
  extra: dict[str, float] = dataclasses.field(default_factory=dict)
  maybe: float | None = None


def test_nested_yaml_with_overrides(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("name: run\ninner:\n  lr: 0.1\nsizes: [1, 2]\n")
  cfg = config_lib.load(Outer, path, ["inner.mode=b", "steps=5", "extra.x=2", "maybe=null"])
  assert cfg == Outer(name="run", steps=5, inner=Inner(lr=0.1, mode="b"), sizes=(1, 2), extra={"x": 2.0})
  assert config_lib.from_dict(Outer, config_lib.to_dict(cfg)) == cfg


@pytest.mark.parametrize("data,match", [
    ({"name": "r", "stpes": 3}, "unknown config key 'stpes'"),
    ({"name": "r", "inner": {"lr": "fast"}}, "inner.lr: expected a float"),
    ({"name": "r", "inner": {"mode": "c"}}, "inner.mode: 'c'"),
    ({"name": "r", "steps": 1.5}, "steps: expected an int"),
    ({"name": "r", "steps": True}, "steps: expected an int"),
    ({"name": "r", "sizes": [1, "x"]}, r"sizes\[1\]"),
    ({}, "missing required config key 'name'"),
])
def test_bad_values_name_the_key(data, match):
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.from_dict(Outer, data)


def test_file_errors_name_the_file(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="not found"):
    config_lib.load(Outer, tmp_path / "missing.yaml")
  bad = tmp_path / "bad.yaml"
  bad.write_text("name: [unclosed\n")
  with pytest.raises(config_lib.ConfigError, match="bad.yaml: invalid YAML"):
    config_lib.load(Outer, bad)
  with pytest.raises(config_lib.ConfigError, match="key.sub=value"):
    config_lib.apply_overrides({}, ["no_equals_sign"])


def test_exponent_without_a_dot_is_a_float_in_files_and_overrides(tmp_path):
  """YAML 1.2's float rule: ``3e-3`` is 0.003 (PyYAML alone reads it as the string "3e-3")."""
  path = tmp_path / "c.yaml"
  path.write_text("name: run\ninner: {lr: 3e-3}\n")
  cfg = config_lib.load(Outer, path, ["maybe=1E2"])
  assert cfg.inner.lr == 0.003 and cfg.maybe == 100.0
  assert config_lib.apply_overrides({}, ["a=1e", "b=12", "c=-2e+4"]) == {"a": "1e", "b": 12, "c": -20000.0}
