"""Between RL steps nothing new is compiled: steps 2..N reuse step 1's programs (shape bucketing); and
a new process's first step compiles nothing either: every program comes back from the persistent cache."""

import sys
from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache, dispatch

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
import rl_testlib  # noqa: E402

from jaxrl import _cache, rl  # noqa: E402

HIT = "/jax/compilation_cache/cache_hits"


@pytest.fixture
def command_cache(tmp_path):
  """The ``jaxrl`` command's persistent-cache settings (what it writes), on the suite's cache directory
  (or a fresh one); the suite's settings are restored after."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  saved = {k: getattr(jax.config, k) for k in keys}
  jax.clear_caches()
  _cache.enable_compilation_cache(saved["jax_compilation_cache_dir"] or tmp_path / "xla")
  compilation_cache.reset_cache()
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def test_steps_after_the_first_compile_no_new_program_and_a_new_process_reads_every_program(tmp_path, command_cache):
  # Completions stop at EOS (lengths vary per step), the packing changes every step, and the step,
  # the sampler and the host-side glue must still reuse step 1's programs.
  cfg = rl_testlib.make_config(tmp_path, steps=3, **{"algorithm.mini_batches": 1, "rollout.prompts_per_step": 2,
                                                     "micro_batch.token_budget": 768})
  trainer = rl.RLTrainer(cfg)
  lowered, hits = [], []

  def listen(event, duration, **kw):
    if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:  # every new program, compiled or read from a cache
      lowered.append(event)

  def listen_hit(event, **kw):
    if event == HIT:
      hits.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  jax.monitoring.register_event_listener(listen_hit)
  try:
    per_step, lengths = [], []
    for step in (1, 2, 3):
      before = len(lowered)
      rollout, _ = trainer.collect(step)
      trainer.update(rollout, step)
      per_step.append(len(lowered) - before)
      lengths.append(sorted(rollout.lengths.tolist()))
    trainer.close()
    # A second process, emulated: nothing compiled in memory, a new trainer on the same config. Its
    # first step lowers its programs again, and every one of them must be read from the cache the
    # first "process" wrote (the second-run first-step speed-up of `jaxrl rl`, issue 20).
    jax.clear_caches()
    before, hits[:] = len(lowered), []
    trainer = rl.RLTrainer(cfg)
    rollout, _ = trainer.collect(1)
    trainer.update(rollout, 1)
    second = len(lowered) - before
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
    jax.monitoring.unregister_event_listener(listen_hit)
    trainer.close()
  assert per_step[0] > 0, per_step  # the listener sees compilations at all
  assert per_step[1:] == [0, 0], per_step
  assert lengths[0] != lengths[1] or lengths[1] != lengths[2]  # the shapes of the work did vary
  assert second >= per_step[0] and len(hits) == second, (per_step, second, len(hits))
