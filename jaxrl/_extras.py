"""Optional dependencies and the extra that installs each (a leaf: stdlib only).

A missing one is reported in one line that names it and the ``pip install`` that brings it:
:func:`require` imports an optional module or raises :class:`MissingExtra`; the ``jaxrl`` command turns a
:class:`MissingExtra`, or a ``ModuleNotFoundError`` of a module below (found by :func:`missing_extra`),
into that line and exit status 2 instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS: dict[str, str] = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "openai": "serve",
    "httpx": "serve",
    "wordllama": "embed",
    "reasoning_gym": "rewards",
    "libtpu": "plan",
    "jax_cuda12_plugin": "plan",
}
"""Top-level module of an optional dependency -> the ``jaxrl`` extra (pyproject.toml) that installs it."""


class MissingExtra(ImportError):
  """An optional dependency is not installed; the message names it and the ``pip install`` that brings it."""

  def __init__(self, module: str, extra: str):
    super().__init__(f"{module} is not installed (the {extra!r} extra): pip install 'jaxrl[{extra}]'",
                     name=module)
    self.module, self.extra = module, extra


def require(module: str) -> ModuleType:
  """Imports the optional dependency ``module`` (a key of :data:`EXTRAS`, or one of its submodules).

  Raises:
    MissingExtra: when its top-level package is not installed.
  """
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    missing = missing_extra(e)
    if missing is None:
      raise
    raise missing from e


def missing_extra(error: BaseException | None) -> MissingExtra | None:
  """The :class:`MissingExtra` that ``error`` reports: itself, a ``ModuleNotFoundError`` of a module in
  :data:`EXTRAS`, or either of those as an explicit cause (``raise ... from``) further down its chain."""
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, MissingExtra):
      return error
    if isinstance(error, ModuleNotFoundError) and error.name in EXTRAS:
      return MissingExtra(error.name, EXTRAS[error.name])
    error = error.__cause__
  return None
