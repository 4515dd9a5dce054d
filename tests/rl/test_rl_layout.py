"""Packed rows follow the current context stage (not the largest), and the micro-batch shape of every
stage is checked when the trainer is built."""

import numpy as np
import pytest
from rl_testlib import make_config

from jaxrl import rl
from jaxrl.rl._rollout import Rollout

STAGED = {"micro_batch.token_budget": 1536, "micro_batch.row_len": None, "steps": 2,
          "rollout.context_schedule": [{"start_step": 2, "max_new_tokens": 32}]}


def _rollout(groups: int, n: int, length: int) -> Rollout:
  rng = np.random.default_rng(0)
  rows = groups * n
  return Rollout(prompt_ids=tuple(rng.integers(1, 100, size=5).astype(np.int32) for _ in range(rows)),
                 tokens=rng.integers(1, 100, size=(rows, length)).astype(np.int32),
                 logprobs=np.full((rows, length), -1.0, np.float32), lengths=np.full(rows, length, np.int32),
                 truncated=np.zeros(rows, bool), group_ids=np.repeat(np.arange(groups, dtype=np.int32), n),
                 rewards=rng.random(rows).astype(np.float32), task_rewards=np.zeros(rows, np.float32),
                 texts=("",) * rows)


def test_row_length_follows_the_context_stage(tmp_path):
  cfg = make_config(tmp_path, **STAGED)
  assert (cfg.row_len_at(1), cfg.row_len_at(2), cfg.row_len) == (32 + 16, 32 + 32, 32 + 32)
  trainer = rl.RLTrainer(cfg)
  try:
    assert trainer.layout(1) == (48, 1536 // 48) and trainer.layout(2) == (64, 1536 // 64)
    packed, _ = trainer.pack(_rollout(4, 4, 16), step=1)
    assert {pb.shape[1:] for pb in packed} == {(32, 48)}
  finally:
    trainer.close()


def test_a_stage_whose_rows_do_not_split_over_the_devices_is_refused_up_front(tmp_path):
  cfg = make_config(tmp_path, **dict(STAGED, **{"micro_batch.token_budget": 1024}))  # 1024 // 48 = 21 rows
  with pytest.raises(ValueError, match=r"token_budget=1024 // row_len=48 = 21 rows per micro-batch at step 1"):
    rl.RLTrainer(cfg)
