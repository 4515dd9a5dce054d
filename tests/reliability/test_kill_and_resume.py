"""kill -9 and SIGTERM at chosen points of a tiny SFT run and a tiny RL run, resumed with
``checkpoint.resume=auto``: the metric curve and the final weights equal an uninterrupted run exactly
(CPU, float32), and no committed checkpoint ever fails its integrity check.

A sample of the full suite (``scripts/fault_injection.py``: 20 SFT and 10 RL kill points, figures in
docs/reliability.md): each launch is a fresh process, so each point costs an interpreter start.
"""

import sys

import faultlib
import pytest

from jaxrl import config as config_lib
from jaxrl import rl, sft

pytestmark = pytest.mark.slow
sys.path.insert(0, str(faultlib.ROOT / "tests" / "rl"))  # the reward function, rl_testlib:digit_fraction


def _uninterrupted(kind, config, out_dir):
  cfg = config_lib.from_dict(sft.SFTConfig if kind == "sft" else rl.RLConfig, dict(config, out_dir=str(out_dir)))
  trainer = (sft.SFTTrainer if kind == "sft" else rl.RLTrainer)(cfg)
  try:
    trainer.run()
  finally:
    if kind == "rl":
      trainer.close()


def test_sft_preempted_then_killed_during_a_commit_resumes_exactly(tmp_path):
  config = faultlib.sft_config(3)
  _uninterrupted("sft", config, tmp_path / "straight")
  # SIGTERM after step 2 (its checkpoint, exit 143); the resumed launch trains step 3 and is killed
  # while committing it (files written, not committed); the last launch ignores that partial
  # checkpoint, resumes from step 2 and trains step 3 again.
  launches = faultlib.run_chain("sft", config, tmp_path / "chain", ["sigterm:2", "in_commit:3"])
  assert "stopped by SIGTERM after step 2" in launches[0].stderr
  assert "partial checkpoint of step 3" in launches[2].stderr
  assert faultlib.compare(tmp_path / "straight", tmp_path / "chain") == []


def test_rl_killed_during_reward_scoring_after_an_epoch_boundary_resumes_exactly(tmp_path):
  config = faultlib.rl_config(3)
  _uninterrupted("rl", config, tmp_path / "straight")
  # Step 3 starts the prompt stream's second epoch; killed while its rewards are being scored
  # (the rollout is generated, one sample scored; in_step, after scoring, is in the script's suite).
  faultlib.run_chain("rl", config, tmp_path / "chain", ["in_reward:3"])
  assert faultlib.compare(tmp_path / "straight", tmp_path / "chain") == []
