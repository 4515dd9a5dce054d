"""RLTrainer with DAPO dynamic sampling (groups with all-equal rewards dropped, rounds drawn until the
batch is full) resumed from a checkpoint continues bit for bit (CPU, float32) like the uninterrupted
run: the prompt stream's position after several rounds is the only state dynamic sampling carries
(surplus informative groups of the last round are dropped, not kept for the next step)."""

import json
import shutil
import sys

import faultlib
import jax
import numpy as np

sys.path.insert(0, str(faultlib.ROOT / "tests" / "rl"))  # rl_testlib: the config and the reward function
from rl_testlib import make_config  # noqa: E402

from jaxrl import rl  # noqa: E402

# tests/rl/test_trainer.py's `recompute_run` (DAPO dynamic sampling with a sparse 0/1 reward, overlong
# filtering, π_old recomputed, KL to the reference), so its compiled programs come from the persistent
# cache whichever test runs first; plus a checkpoint every step.
OVER = {"reward.fn": "rl_testlib:starts_with_digit", "rollout.dynamic_sampling": True, "rollout.max_rounds": 4,
        "rollout.overlong_filter": True, "rollout.stop_strings": ["5", "7"], "algorithm.old_logprobs": "recompute",
        "algorithm.ppo_epochs": 2, "algorithm.kl_coef": 0.01, "steps": 2,
        "checkpoint": {"every": 1, "keep": 2}, "export_hf": False}


def _run(cfg):
  trainer = rl.RLTrainer(cfg)
  try:
    out = trainer.run()
  finally:
    trainer.close()
  return trainer, out


def _curve(trainer):
  return [{k: v for k, v in h.items() if not k.startswith(faultlib.NOT_COMPARED)} for h in trainer.history]


def test_dynamic_sampling_run_resumes_exactly(tmp_path):
  straight, _ = _run(make_config(tmp_path / "a", **OVER))
  host = json.loads((tmp_path / "a" / "run" / "checkpoints" / "1" / "host" / "metadata").read_text())
  rounds = [h["dynamic/rounds"] for h in straight.history]
  # Dynamic sampling really refilled: both steps drew more than one round of 4 prompts.
  assert host["prompts"]["drawn"] == 4 * rounds[0] and min(rounds) > 1, rounds

  # As if stopped after step 1: its checkpoint (written by the uninterrupted run) is all a new run finds.
  shutil.copytree(tmp_path / "a" / "run" / "checkpoints" / "1", tmp_path / "b" / "run" / "checkpoints" / "1")
  resumed, out = _run(make_config(tmp_path / "b", **OVER))
  assert out["start_step"] == 1
  assert _curve(resumed) == _curve(straight)[1:]
  assert resumed.stream.get_state() == straight.stream.get_state()
  for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
