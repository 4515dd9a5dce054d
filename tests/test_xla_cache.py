"""The ``jaxrl`` command's persistent compilation cache: directory choice, ``off``, the flag."""

import jax
import pytest

from jaxrl import _cache
from jaxrl.config import ConfigError

KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture(autouse=True)
def restore_jax_config():
  saved = {k: getattr(jax.config, k) for k in KEYS}
  yield
  for k, v in saved.items():
    jax.config.update(k, v)


def test_default_directory_is_in_the_user_cache_dir(monkeypatch, tmp_path):
  monkeypatch.delenv(_cache.ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  jax.config.update("jax_compilation_cache_dir", None)
  got = _cache.enable_compilation_cache()
  assert got == tmp_path / "jaxrl" / "xla" and got.is_dir()
  assert jax.config.jax_compilation_cache_dir == str(got)
  # a size cap: JAX then locks the directory around reads and writes (no half-written entry is read)
  assert jax.config.jax_compilation_cache_max_size == _cache.MAX_BYTES > 0


def test_env_var_and_flag_choose_the_directory_or_turn_it_off(monkeypatch, tmp_path):
  monkeypatch.setenv(_cache.ENV, str(tmp_path / "env"))
  assert _cache.enable_compilation_cache() == tmp_path / "env"
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
  rest = _cache.from_argv(["--xla-cache", str(tmp_path / "flag"), "rl", "--config", "x.yaml"])
  assert rest == ["rl", "--config", "x.yaml"]
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "flag")
  jax.config.update("jax_compilation_cache_dir", "unchanged")
  assert _cache.from_argv(["--xla-cache=off", "info"]) == ["info"]
  assert jax.config.jax_compilation_cache_dir == "unchanged"


def test_configured_jax_cache_is_left_alone_and_bad_flag_is_a_config_error(monkeypatch, tmp_path):
  monkeypatch.delenv(_cache.ENV, raising=False)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  jax.config.update("jax_compilation_cache_max_size", -1)
  assert _cache.enable_compilation_cache() == tmp_path / "mine"
  assert jax.config.jax_compilation_cache_max_size == _cache.MAX_BYTES  # capped, so locked
  jax.config.update("jax_compilation_cache_max_size", 1 << 30)
  assert _cache.enable_compilation_cache() == tmp_path / "mine"
  assert jax.config.jax_compilation_cache_max_size == 1 << 30  # a cap the user chose is kept
  with pytest.raises(ConfigError, match="--xla-cache"):
    _cache.from_argv(["--xla-cache"])
  (tmp_path / "file").write_text("")
  with pytest.raises(ConfigError, match="cannot create"):
    _cache.enable_compilation_cache(tmp_path / "file" / "sub")


def test_entries_written_without_a_cap_are_adopted_so_capped_writes_work(tmp_path):
  """A directory filled without a size cap has no last-use times; JAX's capped cache reads one per entry
  before each write (jax._src.lru_cache) and fails there until :func:`_cache.adopt_entries` gives them."""
  from jax._src.lru_cache import LRUCache
  (tmp_path / "old-cache").write_bytes(b"entry")
  with pytest.raises(FileNotFoundError):
    LRUCache(str(tmp_path), max_size=1 << 20).put("new", b"x")
  assert _cache.adopt_entries(tmp_path) == 1 and _cache.adopt_entries(tmp_path) == 0
  LRUCache(str(tmp_path), max_size=1 << 20).put("new", b"x")
  assert LRUCache(str(tmp_path), max_size=1 << 20).get("new") == b"x"
