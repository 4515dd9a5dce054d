"""A missing optional extra: one line naming it and the ``pip install`` that brings it, status 2, through
the ``jaxrl`` entry point (absence simulated with ``sys.modules[name] = None``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jaxrl import _extras, cli, targets
from jaxrl.rewards import _reasoning_gym

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_require_names_the_extra_and_returns_the_module(monkeypatch):
  assert _extras.require("json").dumps(1) == "1"  # an installed module comes back
  monkeypatch.setitem(sys.modules, "wordllama", None)
  with pytest.raises(_extras.MissingExtra) as e:
    _extras.require("wordllama")
  assert str(e.value) == "wordllama is not installed (the 'embed' extra): pip install 'jaxrl[embed]'"
  assert isinstance(e.value, ImportError) and e.value.name == "wordllama"


def test_a_module_outside_the_table_keeps_its_error():
  with pytest.raises(ModuleNotFoundError) as e:
    _extras.require("no_such_module_xyz")
  assert not isinstance(e.value, _extras.MissingExtra) and _extras.missing_extra(e.value) is None


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_serve_without_the_serve_extra_is_one_line(monkeypatch, capsys, module):
  monkeypatch.setitem(sys.modules, module, None)
  assert cli.main(["serve", "--model", "/nonexistent"]) == 2
  captured = capsys.readouterr()
  assert captured.err == (f"jaxrl serve: error: {module} is not installed (the 'serve' extra): "
                          "pip install 'jaxrl[serve]'\n")
  assert captured.out == ""


def test_a_wrapped_import_error_is_found_through_its_cause(monkeypatch, capsys):
  """reasoning-gym tasks re-raise the import error with their own message (``raise ... from``)."""
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)
  monkeypatch.setitem(cli.PASSTHROUGH, "rl", lambda rest: _reasoning_gym._rg())
  assert cli.main(["rl", "--config", "x.yaml"]) == 2
  assert capsys.readouterr().err == ("jaxrl rl: error: reasoning_gym is not installed (the 'rewards' extra): "
                                     "pip install 'jaxrl[rewards]'\n")


def test_plan_without_libtpu_is_one_line(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "libtpu", None)
  targets._devices.cache_clear()  # compile-only devices are made once per process
  try:
    rc = cli.main(["plan", "--config", str(CONFIGS / "deepscaler_1p5b.yaml"), "--target", "v5p-8", "--shapes-only"])
  finally:
    targets._devices.cache_clear()
  *progress, last = capsys.readouterr().err.splitlines()  # plan's own progress lines, then the one error line
  assert rc == 2 and all(line.startswith("plan [") for line in progress), progress
  assert last.startswith("jaxrl plan: v5p-8: libtpu is not installed") and last.endswith("pip install 'jaxrl[plan]'")
