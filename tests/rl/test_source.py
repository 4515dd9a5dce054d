"""The rollout-source protocol: the synchronous rounds (DAPO dynamic sampling) a source draws, the one engine
``max_len`` rule, and the three sources' shape (no model: a scripted round function)."""

import numpy as np
import pytest

from jaxrl import rl
from jaxrl.envs import AgenticTrainer, EpisodeRollout
from jaxrl.rl import PromptStream, RolloutConfig, draw_rounds, rollout_max_len
from jaxrl.rl._async_rollout import AsyncRollout
from rl_testlib import make_config

N = 2  # samples per prompt


def _scripted(rewards_by_prompt: dict[int, list[float]], calls: list):
  """A round function whose group ``g`` (prompt ``idx[g]``) gets ``rewards_by_prompt[idx[g]]`` and a metric."""

  def generate(idx, request_ids, *, max_new, n):
    calls.append((list(idx), list(request_ids), max_new, n))
    r = np.asarray([v for i in idx for v in rewards_by_prompt[i]], np.float32)
    g = len(idx)
    ro = rl.Rollout(prompt_ids=tuple(np.asarray([i], np.int32) for i in idx for _ in range(n)),
                    tokens=np.full((g * n, 3), 7, np.int32), logprobs=np.zeros((g * n, 3), np.float32),
                    lengths=np.full(g * n, 3, np.int32), truncated=np.zeros(g * n, bool),
                    group_ids=np.repeat(np.arange(g, dtype=np.int32), n), rewards=r, task_rewards=r,
                    texts=("",) * (g * n))
    info = {"time_generate": 1.5, "time_reward": 0.25, "reward_errors": 1.0, "agent/turns_mean": float(len(calls))}
    return ro, info
  return generate


def test_dynamic_sampling_rounds_keep_the_first_informative_groups_and_add_up_round_metrics():
  r = RolloutConfig(prompts_per_step=3, n=N, max_new_tokens=5, dynamic_sampling=True, max_rounds=3)
  stream = PromptStream(6, seed=0)
  order = PromptStream(6, seed=0).take(9)[0]
  # Round 1: only the second prompt is informative; round 2: its first two are, the third would be surplus.
  informative = {order[1], order[3], order[4], order[5]}
  rewards = {p: ([0.0, 1.0] if p in informative else [1.0, 1.0]) for p in range(6)}
  calls = []
  scripted = _scripted(rewards, calls)

  def generate(*args, **kw):  # a monitor only the second round's samples report (averaged over that round alone)
    ro, info = scripted(*args, **kw)
    return ro, info | ({"reward/monitor/x": 4.0} if len(calls) == 2 else {})
  batch = draw_rounds(generate, 1, stream, r)
  assert [c[0] for c in calls] == [order[:3], order[3:6]] and [c[1] for c in calls] == [[0, 1, 2], [3, 4, 5]]
  assert all(c[2:] == (5, N) for c in calls)
  assert [int(p[0]) for p in batch.rollout.prompt_ids[::N]] == [order[1], order[3], order[4]]
  np.testing.assert_array_equal(batch.rollout.group_ids, np.repeat(np.arange(3), N))
  assert batch.drawn.num_samples == 6 * N and stream.drawn == 6
  assert batch.metrics == {"time_generate": 3.0, "time_reward": 0.5, "reward_errors": 2.0,
                           "dynamic/groups_kept": 3.0, "dynamic/rounds": 2.0, "dynamic/groups_generated": 6.0,
                           "agent/turns_mean": 1.5, "reward/monitor/x": 4.0}


def test_a_step_without_an_informative_group_trains_nothing_and_one_round_is_the_batch_without_dynamic_sampling():
  flat = {p: [1.0, 1.0] for p in range(4)}
  batch = draw_rounds(_scripted(flat, []), 1, PromptStream(4, seed=1),
                      RolloutConfig(prompts_per_step=2, n=N, dynamic_sampling=True, max_rounds=2))
  assert batch.rollout is None and batch.drawn.num_samples == 4 * N and batch.metrics["dynamic/rounds"] == 2.0
  calls = []
  batch = draw_rounds(_scripted(flat, calls), 1, PromptStream(4, seed=1), RolloutConfig(prompts_per_step=2, n=N))
  assert len(calls) == 1 and batch.rollout is batch.drawn and "dynamic/rounds" not in batch.metrics


def test_each_process_generates_its_share_of_the_global_prompts():
  calls = []
  draw_rounds(_scripted({p: [0.0, 1.0] for p in range(8)}, calls), 1, PromptStream(8, seed=2),
              RolloutConfig(prompts_per_step=4, n=N), procs=2, pid=1)
  order, ids = PromptStream(8, seed=2).take(4)
  assert calls[0][:2] == (order[2:], ids[2:])


@pytest.mark.parametrize("eval_new, stage2, want", [(None, None, (48, 48)), (24, None, (56, 56)),
                                                     (None, 40, (48, 72)), (24, 40, (56, 72))])
def test_one_max_len_rule_covers_the_stage_and_evaluation_budgets(tmp_path, eval_new, stage2, want):
  """Prompt (32) + the larger of the stage's response budget (16, then ``stage2`` from step 3) and evaluation's."""
  schedule = [{"start_step": 3, "max_new_tokens": stage2}] if stage2 else []
  cfg = make_config(tmp_path, **{"eval.max_new_tokens": eval_new, "rollout.context_schedule": schedule, "steps": 4,
                                 "micro_batch": {"token_budget": 768}})
  assert (rollout_max_len(cfg, 1), rollout_max_len(cfg, 3)) == want
  # over steps 1 .. last (the asynchronous engine, built once): the largest stage within them
  assert (rollout_max_len(cfg, 1, last=2), rollout_max_len(cfg, 1, last=4), rollout_max_len(cfg, 3, last=4)) == \
      (want[0], max(want), want[1])


def test_the_three_sources_implement_the_protocol():
  names = {"rollout", "set_weights", "close"}
  for cls in (rl.EngineRollout, EpisodeRollout, AsyncRollout):
    assert names <= set(vars(cls)), cls.__name__
  assert not {"_generate", "collect"} & set(vars(AgenticTrainer))  # it passes a source instead


def test_monitor_metrics_average_each_key_over_the_samples_that_report_it():
  """``info["monitor"]`` values: each key's mean over its reporters (absent keys and missing infos do not count),
  through the gather's key encoding (non-ASCII keys survive)."""
  from jaxrl.rl._source import monitor_metrics
  infos = [{"monitor": {"words": 3, "self_praise": 1.0}}, {"monitor": {"words": 6}}, {}, {"reason": "x"},
           {"monitor": {"words": 12.5, "länge": 2}}]
  assert monitor_metrics(infos, "eval") == {"eval/monitor/words": (3 + 6 + 12.5) / 3,
                                            "eval/monitor/self_praise": 1.0, "eval/monitor/länge": 2.0}
  assert monitor_metrics([{}, {"monitor": {}}]) == {}
