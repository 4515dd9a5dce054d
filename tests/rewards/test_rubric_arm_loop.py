"""Rubric-ARM's alternating loop on two tiny models: one round (a judge phase, then a generator phase);
whichever side is frozen keeps bit-identical parameters while the other trains."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.rl import RubricARM, RubricARMConfig

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rubric_arm_tiny.yaml"
SMALL = ("{vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 4, num_kv_heads: 2, "
         "head_dim: 8, dtype: float32, param_dtype: float32}")


def _params(trainer) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.array(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.state.params)}


def _changed(before, after) -> list[str]:
  return [k for k in before if not np.array_equal(before[k], after[k])]


@pytest.mark.slow
def test_alternating_phases_train_one_side_and_freeze_the_other(tmp_path):
  cfg = config_lib.load(RubricARMConfig, CONFIG, [
      "rounds=1", "pairs.builtin.n_train=16", "rubric_template='{question}'",
      "judge_template='{rubric}|{question}|{a}|{b}'",
      f"generator.model.overrides={SMALL}", f"judge.model.overrides={SMALL}",
      "generator.steps=1", "judge.steps=1", "generator.rollout.prompts_per_step=2", "judge.rollout.prompts_per_step=2",
      "generator.rollout.max_new_tokens=4", "judge.rollout.max_new_tokens=4",
      "generator.data.max_prompt_tokens=72", "generator.micro_batch={token_budget: 640, row_len: 80}",
      "judge.data.max_prompt_tokens=72", "judge.micro_batch={token_budget: 640, row_len: 80}",
      # the same shapes for both roles: the second trainer reuses the first one's compiled programs
      # decoupled weight decay moves the decayed weights of the side that trains, even at zero advantage
      "generator.optim.weight_decay=0.1", "judge.optim.weight_decay=0.1",
      f"out_dir={tmp_path / 'arm'}", "tensorboard=false"])
  arm = RubricARM(cfg)
  snaps = [(_params(arm.generator), _params(arm.judge))]
  try:
    out = arm.run(after_phase=lambda _: snaps.append((_params(arm.generator), _params(arm.judge))))
    records = arm.judge.train_prompts.records  # the judge phase's prompts: cached rubrics, chosen at `label`
  finally:
    arm.close()
  (g0, j0), (g1, j1), (g2, j2) = snaps
  assert _changed(g0, g1) == [], "the generator changed during the judge phase"
  assert _changed(j0, j1), "the judge did not train in its phase"
  assert _changed(j1, j2) == [], "the judge changed during the generator phase"
  assert _changed(g1, g2), "the generator did not train in its phase"
  assert arm._judge_calls == 2 * 4 * 2  # each of the 2 x 4 rubrics judged by the frozen judge in both orders
  assert arm.judge_generate_calls == 1  # ... all in one batched generate call for the generator's one step
  chosen, rejected = {p["chosen"] for p in arm.pairs}, {p["rejected"] for p in arm.pairs}
  assert len(records) == 2
  for r, rubric in zip(records, arm.last_rubrics):
    head, a, b = r["prompt"].rsplit("|", 2)
    assert head.startswith(rubric + "|")
    assert (a, b) in ({(c, w) for c in chosen for w in rejected} if r["label"] == "A" else
                      {(w, c) for c in chosen for w in rejected})
  assert [(p["role"], p["steps"]) for p in out["phases"]] == [("judge", 1), ("generator", 1)]
  logged = [json.loads(line) for line in (tmp_path / "arm" / "phases.jsonl").read_text().splitlines()]
  assert [p["reward_mean"] for p in logged] == [p["reward_mean"] for p in out["phases"]]
  for role in ("judge", "generator"):
    assert "reward/mean" in json.loads((tmp_path / "arm" / role / "metrics.jsonl").read_text().splitlines()[-1])
