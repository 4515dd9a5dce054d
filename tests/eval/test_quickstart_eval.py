"""The quickstart's cross-check: `jaxrl eval` on the quickstart's exported SFT and GRPO models and its held-out
file, with the trainer's evaluation settings, gives the numbers the quickstart reports (greedy accuracy, pass@1
at T = 1 over the quickstart's samples), the mean reward and the mean response length, whatever the accuracy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl import quickstart
from jaxrl.cli import eval as eval_cli

PROMPTS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A shortened quickstart (few SFT steps, one GRPO step, a few held-out problems)."""
  out = tmp_path_factory.mktemp("quickstart")
  r = quickstart.run_quickstart(out, seed=0, sft={"steps": 12},
                                rl={"steps": 1, "eval": {"every": 1, "prompts": PROMPTS}}, tensorboard=False)
  return out, r


def _eval(r, model: str, out, *extra: str) -> tuple[dict, list[dict]]:
  """`jaxrl eval` of ``model`` on the quickstart's held-out file with the trainer's engine and lengths."""
  rl = quickstart.RL
  engine = rl["rollout"]["engine"]
  argv = ["--model", model, "--data", r["heldout_file"], "--task", "custom", "--reward", rl["reward"]["fn"],
          "--correct-threshold", str(rl["reward"]["correct_threshold"]), "--limit", str(PROMPTS),
          "--max-prompt-tokens", str(rl["data"]["max_prompt_tokens"]),
          "--max-new-tokens", str(rl["rollout"]["max_new_tokens"]), "--num-slots", str(engine["num_slots"]),
          "--block-size", str(engine["block_size"]), "--kv-cache-bytes", str(engine["kv_cache_bytes"]),
          "--chunk", str(PROMPTS), "--out", str(out), *extra]
  assert eval_cli.main(argv) == 0
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  return json.loads((out / "summary.json").read_text()), records


@pytest.mark.parametrize("which", ["sft", "rl"])
def test_jaxrl_eval_gives_the_quickstart_numbers(run, which, tmp_path):
  out, r = run
  model = r[f"{which}_hf_dir"]
  greedy, records = _eval(r, model, tmp_path / "greedy", "--temperature", "0", "--n", "1", "--metrics", "avg@1")
  want = r["metrics"][which]
  assert len(records) == PROMPTS
  assert greedy["metrics"]["avg@1"] == pytest.approx(r[f"{which}_accuracy"], abs=1e-12)
  assert greedy["metrics"]["avg@1"] == pytest.approx(want["eval/accuracy"], abs=1e-12)
  assert np.mean([x["rewards"] for x in records]) == pytest.approx(want["eval/reward_mean"], abs=1e-6)
  assert greedy["response_tokens"]["mean"] == pytest.approx(want["eval/length_mean"], abs=1e-9)
  # pass@1 at T = 1: the trainer samples with seed + 1 (the quickstart's seed is 0), top-p 1, request ids 0..P-1
  n = quickstart.SAMPLES
  sampled, records = _eval(r, model, tmp_path / "sampled", "--temperature", "1", "--top-p", "1", "--seed", "1",
                           "--n", str(n), "--metrics", f"avg@{n}")
  want = r["metrics"][f"{which}_sampled"]
  assert sampled["metrics"][f"avg@{n}"] == pytest.approx(r[f"{which}_sampled"], abs=1e-12)
  assert np.mean([x["rewards"] for x in records]) == pytest.approx(want["sampled/reward_mean"], abs=1e-6)
  assert sampled["response_tokens"]["mean"] == pytest.approx(want["sampled/length_mean"], abs=1e-9)
