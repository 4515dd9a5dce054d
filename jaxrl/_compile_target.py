"""The platform the programs being traced are compiled for (a leaf: stdlib only; JAX is imported when asked).

A few trace-time choices depend on the platform that will run the program: the target logit of
:func:`jaxrl.losses.token_logprobs` (a gather on CPU, an iota-select reduction elsewhere), the attention kernel
``impl="auto"`` picks (:mod:`jaxrl.kernels`) and whether the engine and sampler unstack the layer weights
(:mod:`jaxrl.sampling`). They read :func:`compile_platform`, not ``jax.default_backend()``: the two differ when
``jaxrl plan`` compiles TPU and NVIDIA programs on a CPU host with compile-only devices, and the plan must
compile the program that will run there, not the host's variant. Every plan entry point traces and compiles
inside :func:`compiling_for` its target's platform; everywhere else the context is unset and the platform is
the process's default backend, as before.

The choice is made at trace time, and ``jax.jit`` caches traces by function and argument types, not by this
context: a jitted function traced under one platform is reused under another. Programs that read the
platform are therefore built per plan (fresh closures), or memoized with the platform in their key.

Runtime checks that must see the real backend (the cuDNN kernel's "needs an NVIDIA GPU backend", the bench,
``jaxrl info``) keep reading ``jax.default_backend()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

PLATFORMS = ("cpu", "gpu", "tpu")
"""Platforms as :func:`compile_platform` names them (JAX's own names for its backends)."""

_ALIASES = {"cuda": "gpu", "rocm": "gpu"}

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxrl_compile_platform", default=None)


def normalise_platform(platform: str) -> str:
  """``platform`` as JAX names a backend: ``"cuda"`` and ``"rocm"`` become ``"gpu"``; an unknown name is an
  error (``ValueError`` naming it)."""
  name = _ALIASES.get(str(platform).lower(), str(platform).lower())
  if name not in PLATFORMS:
    raise ValueError(f"compiling_for: unknown platform {platform!r}; known: {[*PLATFORMS, *_ALIASES]}")
  return name


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[str]:
  """Within the block, :func:`compile_platform` is ``platform`` (normalised; yielded). Nests, and is local
  to the thread or task that enters it (a ``contextvars`` variable)."""
  token = _PLATFORM.set(normalise_platform(platform))
  try:
    yield _PLATFORM.get()
  finally:
    _PLATFORM.reset(token)


def compile_platform() -> str:
  """The platform programs traced now are compiled for: the innermost :func:`compiling_for`, else this
  process's default backend (``"cpu"``, ``"gpu"``, ``"tpu"``, or a plugin's own name)."""
  platform = _PLATFORM.get()
  if platform is not None:
    return platform
  import jax  # kept off this leaf's import: every caller has JAX loaded already

  backend = jax.default_backend()
  return _ALIASES.get(backend, backend)  # not checked: a plugin backend (e.g. METAL) keeps its own name


def cache_per_platform(maxsize: int | None = 128) -> Callable[[Callable], Callable]:
  """``functools.lru_cache(maxsize)`` whose key also holds :func:`compile_platform`: a builder of jitted
  programs memoized this way hands a plan for another platform its own programs (and so its own traces),
  never ones traced for the host. The wrapper keeps ``cache_clear`` and ``cache_info``."""
  def wrap(fn: Callable) -> Callable:
    @functools.lru_cache(maxsize=maxsize)
    def cached(platform, *args, **kwargs):
      del platform  # a key only
      return fn(*args, **kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
      return cached(compile_platform(), *args, **kwargs)

    call.cache_clear, call.cache_info = cached.cache_clear, cached.cache_info
    return call
  return wrap


__all__ = ["PLATFORMS", "cache_per_platform", "compile_platform", "compiling_for", "normalise_platform"]
