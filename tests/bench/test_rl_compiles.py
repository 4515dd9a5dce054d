"""Between RL steps nothing new is compiled: steps 2..N reuse step 1's programs (shape bucketing)."""

import sys
from pathlib import Path

import jax
from jax._src import dispatch

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
import rl_testlib  # noqa: E402

from jaxrl import rl  # noqa: E402


def test_steps_after_the_first_compile_no_new_program(tmp_path):
  # Completions stop at EOS (lengths vary per step), the packing changes every step, and the step,
  # the sampler and the host-side glue must still reuse step 1's programs.
  cfg = rl_testlib.make_config(tmp_path, steps=3, **{"algorithm.mini_batches": 1, "rollout.prompts_per_step": 2,
                                                     "micro_batch.token_budget": 768})
  trainer = rl.RLTrainer(cfg)
  lowered = []

  def listen(event, duration, **kw):
    if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:  # every new program, compiled or read from a cache
      lowered.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    per_step, lengths = [], []
    for step in (1, 2, 3):
      before = len(lowered)
      rollout, _ = trainer.collect(step)
      trainer.update(rollout, step)
      per_step.append(len(lowered) - before)
      lengths.append(sorted(rollout.lengths.tolist()))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
    trainer.close()
  assert per_step[0] > 0, per_step  # the listener sees compilations at all
  assert per_step[1:] == [0, 0], per_step
  assert lengths[0] != lengths[1] or lengths[1] != lengths[2]  # the shapes of the work did vary
