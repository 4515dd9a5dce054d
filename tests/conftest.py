"""Test set-up: 8 fake CPU devices, configured before JAX initialises."""

import importlib.util
import os
import pathlib
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jaxrl  # noqa: E402,F401  (before JAX: its first import drops the CUDA stub's notices, jaxrl/_platform.py)
import jaxrl._cache  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")
# Many tests compile the same small programs (tiny models on the same meshes): share compiled
# executables between tests and xdist workers through JAX's persistent cache.
_XLA_CACHE = os.path.join(tempfile.gettempdir(), "jaxrl-test-xla-cache")
os.makedirs(_XLA_CACHE, exist_ok=True)
jaxrl._cache.adopt_entries(_XLA_CACHE)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
# A size cap makes JAX lock the directory around each read and write: unlocked, a worker could read an entry
# the other worker is still writing and abort in deserialising it (jaxrl/_cache.py, MAX_BYTES).
jax.config.update("jax_compilation_cache_max_size", 8 << 30)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionstart(session):
  """Test modules are imported by basename (rootdir import mode, sibling helper imports), so two
  files of the same name in different folders break collection on a clean checkout only; name them."""
  import collections
  import pathlib
  import pytest
  seen = collections.defaultdict(list)
  for path in pathlib.Path(__file__).parent.rglob("test_*.py"):
    seen[path.name].append(str(path.relative_to(pathlib.Path(__file__).parent)))
  dups = {name: paths for name, paths in seen.items() if len(paths) > 1}
  if dups:
    raise pytest.UsageError(f"test file basenames must be unique under tests/: {dups}")


def _load_fixture_digest():
  """tests/fixtures/fixture_digest.py, loaded by path (tests/fixtures is not on sys.path)."""
  path = pathlib.Path(__file__).parent / "fixtures" / "fixture_digest.py"
  spec = importlib.util.spec_from_file_location("fixture_digest", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


import pytest  # noqa: E402

MAP_BUDGET = 25_000
"""Memory maps a test worker may hold at the end of a test file before its compiled programs are dropped. XLA's
CPU backend maps every loaded executable's code in regions of its own (about 160 maps for a program of a few
dozen operations), the jit and lru caches keep them alive, and Linux refuses new maps past
``vm.max_map_count`` (65,530 by default): late in a worker's life, compiling or loading the next program then
crashed XLA (docs/reliability.md). One file adds at most about 17,000 (``tests/sampling/test_engine.py``)."""
HARD_MAP_BUDGET = 50_000
"""Maps past which the programs are dropped after any test, even inside a file (whose module-scoped engines
then compile again: a recompile beats a crash)."""


def memory_maps() -> int:
  """This process's memory-map count (``/proc/self/maps`` lines; 0 where there is no procfs)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def pytest_runtest_teardown(item, nextitem):
  """Drops every compiled program when a test file ends with the worker past :data:`MAP_BUDGET` memory maps
  (or any test ends past :data:`HARD_MAP_BUDGET`): later files recompile, or load from the persistent cache, what
  they need. At a file's end, so tests that count the compiles of a module-scoped engine see none."""
  maps = memory_maps()
  file_ends = nextitem is None or nextitem.path != item.path
  if maps > HARD_MAP_BUDGET or (file_ends and maps > MAP_BUDGET):
    import gc
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def source_digest():
  """``source_digest(script_path)``: the digest a recorded fixture stores for the script that wrote it
  (tests/fixtures/fixture_digest.py); a test compares it to refuse results written by other code."""
  return _load_fixture_digest().source_digest
