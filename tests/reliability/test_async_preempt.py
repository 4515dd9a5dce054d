"""SIGTERM during an AsyncRLTrainer run: the trainer finishes the step, commits its checkpoint and raises
``Preempted`` (``jaxrl rl`` exits 143), as RLTrainer does."""

import os
import signal
import sys
import time

import faultlib

sys.path.insert(0, str(faultlib.ROOT / "tests" / "rl"))  # rl_testlib: the config and the reward function
from rl_testlib import make_config  # noqa: E402

import pytest  # noqa: E402

from jaxrl import train  # noqa: E402
from jaxrl.rl._async import AsyncRLTrainer  # noqa: E402

pytestmark = pytest.mark.slow
ENGINE = {"num_slots": 12, "kv_cache_bytes": 1 << 20, "block_size": 8, "steps_per_call": 4}


def test_sigterm_commits_the_step_and_stops_the_async_trainer(tmp_path):
  # tests/rl/test_async_trainer.py's shapes (its compiled programs come from the persistent cache).
  cfg = make_config(tmp_path, **{"rollout.engine": ENGINE, "algorithm.objective": "decoupled_ppo", "steps": 3,
                                 "asynchronous": {"rollout_devices": 6, "max_staleness": 1},
                                 "checkpoint": {"every": 0}, "export_hf": False})
  trainer = AsyncRLTrainer(cfg)
  trainer.checkpointer = train.Checkpointer(tmp_path / "ckpt", every=100)  # only a forced save writes
  update = trainer.update

  def update_then_sigterm(rollout, step):
    out = update(rollout, step)
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)  # handled: the run stops after this step
      deadline = time.monotonic() + 30  # the handler runs on the main thread, not this trainer thread: wait
      while trainer.preemption.signum is None and time.monotonic() < deadline:  # for it before the step ends
        time.sleep(0.01)
    return out
  trainer.update = update_then_sigterm
  before = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(train.Preempted, match="stopped by SIGTERM after step 1; checkpoint of step 1 written") as info:
      trainer.run()
  finally:
    trainer.close()
  assert info.value.exit_code == 143 and len(trainer.history) == 1
  assert train.Checkpointer(tmp_path / "ckpt", every=100).latest_step() == 1
  assert signal.getsignal(signal.SIGTERM) == before  # the handlers are put back
