"""The TRL 0.19.1 preference/GKD fixture shared by test_preference.py and test_distill.py."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

TRL_FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "preference_trl.npz"


@pytest.fixture(scope="module")
def trl(source_digest):
  """TRL's recorded losses and gradients (tests/fixtures/make_preference_fixtures.py, float64), refused when
  the script that wrote them has changed since."""
  data = dict(np.load(TRL_FIXTURE))
  script = TRL_FIXTURE.parent / "make_preference_fixtures.py"
  assert str(data["source_sha256"]) == source_digest(script), (
      f"{TRL_FIXTURE.name} was written by another version of {script.name}: regenerate it "
      "(its docstring says how)")
  assert str(data["trl_version"]) == "0.19.1"
  return data
