"""Vision-R1's PTST (progressive thinking suppression): the context schedule changes both the response budget
and the group size at the configured steps, and a resumed run continues in the stage of its step."""

import collections

import numpy as np
from rl_testlib import make_config

from jaxrl import config as config_lib
from jaxrl import rl

PTST = [{"start_step": 2, "max_new_tokens": 12, "n": 4}, {"start_step": 4, "max_new_tokens": 16, "n": 2}]


def test_vision_r1_schedule_in_config():
  """The paper's stages: 4K tokens x 16 samples, then 8K x 8, then 16K x 4."""
  r = config_lib.from_dict(rl.RolloutConfig, {"prompts_per_step": 8, "n": 16, "max_new_tokens": 4096, "context_schedule": [
    {"start_step": 101, "max_new_tokens": 8192, "n": 8}, {"start_step": 201, "max_new_tokens": 16384, "n": 4}]})
  assert [r.stage(s) for s in (1, 100, 101, 200, 201, 500)] == [
    (0, 4096, 16), (0, 4096, 16), (1, 8192, 8), (1, 8192, 8), (2, 16384, 4), (2, 16384, 4)]


def _run(cfg, **kw):
  trainer = rl.RLTrainer(cfg)
  seen = []
  update = trainer.update
  trainer.update = lambda ro, step: (seen.append((step, ro, trainer._stage)), update(ro, step))[1]
  try:
    out = trainer.run(**kw)
  finally:
    trainer.close()
  return out, seen


def _groups(ro):
  return sorted(collections.Counter(np.asarray(ro.group_ids).tolist()).values())


def test_group_size_and_budget_change_per_stage_and_resume_in_the_right_stage(tmp_path):
  cfg = make_config(tmp_path, **{"rollout.n": 8, "rollout.max_new_tokens": 8, "rollout.context_schedule": PTST,
                                 "rollout.prompts_per_step": 2, "algorithm.mini_batches": 1, "checkpoint": {"every": 1, "keep": 8}, "steps": 4})
  out1, first = _run(cfg, until=2)
  assert out1["steps"] == 2 and [s for s, *_ in first] == [1, 2]
  (_, ro1, st1), (_, ro2, st2) = first
  assert (st1, _groups(ro1), int(np.max(ro1.lengths)) <= 8) == (0, [8] * 2, True)
  assert (st2, _groups(ro2), int(np.max(ro2.lengths)) <= 12) == (1, [4] * 2, True)
  assert int(np.max(ro2.lengths)) > 8, "stage 1's budget (12) was not used"
  out2, second = _run(cfg)  # a fresh process resumes from the checkpoint of step 2: stage 1, then stage 2
  assert out2["start_step"] == 2 and [s for s, *_ in second] == [3, 4]
  (_, ro3, st3), (_, ro4, st4) = second
  assert (st3, _groups(ro3)) == (1, [4] * 2) and int(np.max(ro3.lengths)) <= 12
  assert (st4, _groups(ro4)) == (2, [2] * 2) and 12 < int(np.max(ro4.lengths)) <= 16
  assert len(ro1.lengths) == 16 and len(ro3.lengths) == 8 and len(ro4.lengths) == 4
