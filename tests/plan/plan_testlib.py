"""Helpers shared by the plan tests."""

from __future__ import annotations

import pytest

from jaxrl import plan


def need(target: str) -> None:
  """Skips the calling test when ``target``'s compile-only devices are unavailable on this machine."""
  try:
    plan.get_target(target).compile_devices()
  except plan.TargetUnavailable as e:
    pytest.skip(f"compile-only devices unavailable: {e}")
