"""``jaxrl._compile_target``: the platform programs are traced for, set by ``compiling_for`` (``jaxrl plan``)."""

from __future__ import annotations

import jax
import pytest

from jaxrl._compile_target import cache_per_platform, compile_platform, compiling_for


def test_outside_compiling_for_the_platform_is_the_host_backend():
  assert compile_platform() == jax.default_backend() == "cpu"


@pytest.mark.parametrize("given, platform", [("tpu", "tpu"), ("cuda", "gpu"), ("rocm", "gpu"), ("GPU", "gpu"),
                                             ("cpu", "cpu")])
def test_compiling_for_names_the_platform_as_jax_does(given, platform):
  with compiling_for(given) as got:
    assert got == compile_platform() == platform
  assert compile_platform() == "cpu"


def test_compiling_for_nests_and_is_undone_when_the_block_raises():
  with pytest.raises(RuntimeError, match="inside"):
    with compiling_for("tpu"):
      with compiling_for("cuda"):
        assert compile_platform() == "gpu"
      assert compile_platform() == "tpu"
      raise RuntimeError("inside")
  assert compile_platform() == "cpu"


def test_an_unknown_platform_is_refused():
  with pytest.raises(ValueError, match="unknown platform 'metal'"):
    with compiling_for("metal"):
      pass


def test_cache_per_platform_builds_once_per_platform():
  """A memoized program builder hands each platform its own programs (its own jit traces), and equal
  arguments on one platform the same ones; ``cache_clear`` empties it."""
  built = []

  @cache_per_platform(maxsize=8)
  def build(n):
    built.append((n, compile_platform()))
    return object()

  host = build(1)
  with compiling_for("tpu"):
    tpu = build(1)
    assert build(1) is tpu
  assert build(1) is host and tpu is not host
  assert built == [(1, "cpu"), (1, "tpu")]
  assert build.cache_info().currsize == 2
  build.cache_clear()
  assert build(1) is not host
