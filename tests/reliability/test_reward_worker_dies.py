"""A reward worker process that dies (os._exit, as a kill or a segfault would end it): the pool starts
again and the lost samples are scored again, each counted once; a reward that kills its worker every
time stops the run with a message naming the limit."""

import pytest

from jaxrl.rewards import RewardRunner, RewardRunnerConfig, RewardWorkersDied

COMPLETIONS = ["a", "bb", "die", "dddd", "eeeee", "ffffff"]


def _runner(tmp_path, restarts):
  return RewardRunner("reward_crash:crash", reward_kwargs={"marker_dir": str(tmp_path)},
                      config=RewardRunnerConfig(workers=2, executor="process", max_errors=0,
                                                max_worker_restarts=restarts))


def test_a_dead_worker_is_replaced_and_its_samples_scored_once(tmp_path):
  with _runner(tmp_path, restarts=1) as runner:
    batch = runner.score(["p"] * len(COMPLETIONS), COMPLETIONS)
    assert (tmp_path / "died").exists() and runner.restarts == 1
    assert batch.indices == tuple(range(len(COMPLETIONS))) and not batch.errors
    assert batch.rewards.tolist() == [float(len(c)) for c in COMPLETIONS]
    # The new pool keeps serving asynchronous submissions.
    runner.submit("p", "xyz", index=10)
    assert runner.collect().rewards.tolist() == [3.0]


def test_a_reward_that_always_kills_its_worker_stops_with_a_message(tmp_path):
  with _runner(tmp_path, restarts=1) as runner:
    with pytest.raises(RewardWorkersDied, match=r"reward_crash:crash.*died again after 1 restart.*"
                                                 r"max_worker_restarts=1"):
      runner.score(["p"] * 3, ["a", "kill", "b"])
