"""JAX's persistent compilation cache for the ``jaxrl`` command, on by default.

A second run of the same config (same shapes, same jax/jaxlib, same devices) loads its compiled
programs from disk instead of compiling them again, so its first step starts much sooner. The
directory is, in order of precedence:

1. ``jaxrl --xla-cache DIR ...`` (``off`` disables it),
2. the ``JAXRL_XLA_CACHE`` environment variable (a directory, or ``off``),
3. JAX's own ``JAX_COMPILATION_CACHE_DIR`` / ``jax_compilation_cache_dir`` if already set (its directory
   is kept; it gets :data:`MAX_BYTES` as its cap if it has none),
4. ``$XDG_CACHE_HOME/jaxrl/xla``, default ``~/.cache/jaxrl/xla``.

Entries are keyed by JAX on the program, its shapes and shardings, the compiler options and
versions; stale entries are never used, and the directory can be deleted at any time.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from jaxrl.config import ConfigError

ENV = "JAXRL_XLA_CACHE"
OFF = ("off", "0", "none", "false")
MAX_BYTES = 16 << 30
"""The directory's size cap (least recently used entries go first). Setting a cap also makes JAX take a file
lock around every read and write of the directory; without one, a process can read an entry that another
process (the other process of a multi-host job on one machine, a second run) is still writing, and abort
while deserialising it."""
MIN_COMPILE_SECONDS = 0.0
_ENTRY, _ATIME = "-cache", "-atime"
"""File suffixes of JAX's cache directory (``jax._src.lru_cache``): an entry and its last-use time."""
"""Programs that compiled faster than this are not written. Zero: a process's first RL step dispatches
dozens of small programs (buffer installs, table updates, block copies) of 20-100 ms compile each, against
a few ms to read one back, and a threshold in seconds of compile time writes a load-dependent subset."""


def default_dir() -> Path:
  """``$XDG_CACHE_HOME/jaxrl/xla``, or ``~/.cache/jaxrl/xla``."""
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "jaxrl" / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
  """Points JAX's persistent compilation cache at ``path`` (see the module docstring for the default).

  Args:
    path: the directory, ``"off"`` to leave the cache disabled, or ``None`` for ``$JAXRL_XLA_CACHE``,
      then an already configured JAX cache directory, then :func:`default_dir`.

  Returns:
    The directory in use, or ``None`` when disabled.
  """
  import jax

  chosen = os.fspath(path) if path is not None else os.environ.get(ENV)
  if chosen is None:
    configured = jax.config.jax_compilation_cache_dir
    if configured:
      if jax.config.jax_compilation_cache_max_size == -1:  # uncapped: no lock; give it ours
        adopt_entries(configured)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
      return Path(configured)
    chosen = str(default_dir())
  if chosen.strip().lower() in OFF:
    return None
  directory = Path(chosen).expanduser()
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"{ENV} / --xla-cache: cannot create the compilation cache directory {directory}: {e}") from e
  adopt_entries(directory)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


def adopt_entries(directory: str | os.PathLike) -> int:
  """Gives every entry of ``directory`` without a last-use time one (now), and returns how many it gave.

  A directory written without a size cap (an older jaxrl, or JAX's default) has entries but no last-use
  times; with a cap, JAX reads the time of every entry before each write and would fail every write there.
  """
  directory = Path(directory)
  stamp = time.time_ns().to_bytes(8, "little")
  adopted = 0
  for entry in directory.glob(f"*{_ENTRY}"):
    atime = entry.with_name(entry.name.removesuffix(_ENTRY) + _ATIME)
    if not atime.exists():
      with contextlib.suppress(OSError):  # another process got there first, or the entry went
        atime.write_bytes(stamp)
        adopted += 1
  return adopted


HELP = (f"--xla-cache DIR|off (before the command): JAX's persistent compilation cache directory; default "
        f"${ENV}, else ~/.cache/jaxrl/xla")


def from_argv(argv: list[str]) -> list[str]:
  """Takes a leading ``--xla-cache DIR|off`` (or ``--xla-cache=DIR``) off ``argv``, enables the
  cache accordingly (:func:`enable_compilation_cache`) and returns the rest of the command line."""
  path = None
  if argv and argv[0].startswith("--xla-cache="):
    path, argv = argv[0].split("=", 1)[1], argv[1:]
  elif argv and argv[0] == "--xla-cache":
    if len(argv) < 2:
      raise ConfigError("--xla-cache needs a directory or 'off'")
    path, argv = argv[1], argv[2:]
  enable_compilation_cache(path)
  return argv
