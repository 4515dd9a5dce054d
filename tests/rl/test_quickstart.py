"""`jaxrl quickstart`, shortened: SFT warm start then GRPO; the reward and held-out accuracy rise."""

import json
from pathlib import Path

import pytest

from jaxrl import quickstart


@pytest.mark.slow
def test_shortened_quickstart_raises_reward_and_heldout_accuracy(tmp_path):
  # The full SFT warm start (~2 min on 2 cores), a quarter of the GRPO steps.
  r = quickstart.run_quickstart(tmp_path, seed=0, rl={"steps": 25, "eval": {"every": 25, "prompts": 64}},
                                tensorboard=False)
  assert r["reward_last10"] > r["reward_first10"], r
  assert r["rl_accuracy"] > r["sft_accuracy"], r  # greedy held-out exact match
  assert r["rl_sampled"] > r["sft_sampled"], r  # pass@1 at T = 1
  assert [step for step, _ in r["eval_curve"]] == [0, 25]
  saved = json.loads((tmp_path / "quickstart.json").read_text())
  assert saved["rl_accuracy"] == r["rl_accuracy"] and Path(r["plot"]).stat().st_size > 0
  # The SFT data really mix the two endings; the reward accepts only one.
  records = quickstart.sft_records(200, seed=0)
  alt = sum("The answer is" in rec["messages"][-1]["content"] for rec in records) / len(records)
  assert abs(alt - quickstart.ALT_FORMAT_FRACTION) < 0.1
