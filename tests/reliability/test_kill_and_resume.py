"""kill -9 and SIGTERM at chosen points of a tiny SFT run and a tiny RL run, resumed with
``checkpoint.resume=auto``: the metric curve and the final weights equal an uninterrupted run exactly
(CPU, float32), and no committed checkpoint ever fails its integrity check.

A sample of the full suite (``scripts/fault_injection.py``: 20 SFT and 10 RL kill points, figures in
docs/reliability.md): each launch is a fresh process, so each point costs an interpreter start; two
launches per test.
"""

import json
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


def test_sft_killed_during_an_async_checkpoint_write_resumes_exactly(tmp_path):
  config = faultlib.sft_config(3)
  _uninterrupted("sft", config, tmp_path / "straight")
  # Killed right after step 2's asynchronous checkpoint write started (a save first waits for the
  # previous one, so step 1's is committed); the next launch resumes from the newest committed step and
  # trains the rest. SIGTERM and a kill during a commit: test_multiprocess_fault.py (two processes);
  # every phase: scripts/fault_injection.py.
  launches = faultlib.run_chain("sft", config, tmp_path / "chain", ["after_save:2"])
  assert json.loads((tmp_path / "chain" / "results.json").read_text())["start_step"] >= 1, launches[-1].stderr[-3000:]
  assert faultlib.compare(tmp_path / "straight", tmp_path / "chain") == []


def test_rl_killed_during_reward_scoring_at_an_epoch_boundary_resumes_exactly(tmp_path):
  config = faultlib.rl_config(2, prompts=4)
  _uninterrupted("rl", config, tmp_path / "straight")
  # 4 prompts, 4 per step: step 2 starts the prompt stream's second epoch; killed while its rewards are
  # being scored (the rollout is generated, one sample scored; in_step, after scoring, is in the script's suite).
  faultlib.run_chain("rl", config, tmp_path / "chain", ["in_reward:2"])
  assert faultlib.compare(tmp_path / "straight", tmp_path / "chain") == []
