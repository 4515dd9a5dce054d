"""RewardRunner: order, error accounting, budget abort, async feeding, process workers."""

import pytest

from jaxrl.rewards import RewardBudgetExceeded, RewardRunner, RewardRunnerConfig

FNS = "_rewards_fns"


def test_results_keep_index_order_when_workers_finish_out_of_order():
  n = 24
  delays = [0.02 * ((7 * i) % 5) for i in range(n)]  # deterministic, non-monotone
  with RewardRunner(f"{FNS}:echo_index", config=RewardRunnerConfig(workers=6)) as r:
    batch = r.score(["p"] * n, ["c"] * n, idx=list(range(n)), delay=delays)
  assert batch.indices == tuple(range(n))
  assert batch.rewards.tolist() == [float(i) for i in range(n)]
  assert [info["idx"] for info in batch.infos] == list(range(n))


@pytest.mark.parametrize("kind, reason", [
  ("raise", "exception"), ("nan", "non_finite"), ("inf", "non_finite"), ("str", "wrong_type"),
  ("none", "wrong_type"), ("vector", "wrong_shape"), ("bool", "wrong_type"),
])
def test_failing_sample_gets_error_value_and_counted_reason(kind, reason):
  cfg = RewardRunnerConfig(workers=2, max_errors=1, error_value=-1.0)
  with RewardRunner(f"{FNS}:misbehaving", config=cfg) as r:
    batch = r.score(["p"] * 3, ["c"] * 3, kind=["ok", kind, "ok"])
  assert batch.rewards.tolist() == [1.0, -1.0, 1.0]
  assert [(e.index, e.reason) for e in batch.errors] == [(1, reason)]
  assert batch.infos[1]["reason"] == "reward_error"
  assert batch.metrics()["reward/errors"] == 1.0


def test_exception_message_names_error_and_location():
  with RewardRunner(f"{FNS}:misbehaving", config=RewardRunnerConfig(max_errors=1)) as r:
    err = r.score(["p"], ["c"], kind=["raise"]).errors[0]
  assert "ZeroDivisionError: boom" in err.message and "_rewards_fns.py" in err.message


def test_error_count_budget_aborts_naming_function_and_first_errors():
  cfg = RewardRunnerConfig(workers=2, max_errors=1)
  with RewardRunner(f"{FNS}:misbehaving", config=cfg) as r:
    with pytest.raises(RewardBudgetExceeded) as e:
      r.score(["p"] * 4, ["c"] * 4, kind=["raise", "ok", "nan", "ok"])
  msg = str(e.value)
  assert "_rewards_fns:misbehaving" in msg and "2/4" in msg
  assert "[sample 0] exception: ZeroDivisionError" in msg and "[sample 2] non_finite" in msg


def test_error_fraction_budget():
  kinds = ["raise"] + ["ok"] * 9
  with RewardRunner(f"{FNS}:misbehaving", config=RewardRunnerConfig(max_errors=0.1)) as r:
    assert len(r.score(["p"] * 10, ["c"] * 10, kind=kinds).errors) == 1
  with RewardRunner(f"{FNS}:misbehaving", config=RewardRunnerConfig(max_errors=0.05)) as r:
    with pytest.raises(RewardBudgetExceeded):
      r.score(["p"] * 10, ["c"] * 10, kind=kinds)


def test_max_errors_zero_aborts_on_first_error():
  with RewardRunner(f"{FNS}:misbehaving", config=RewardRunnerConfig(max_errors=0)) as r:
    with pytest.raises(RewardBudgetExceeded):
      r.score(["p"], ["c"], kind=["nan"])


def test_async_submit_then_collect_scores_each_sample_once():
  with RewardRunner(f"{FNS}:echo_index", config=RewardRunnerConfig(workers=3)) as r:
    for i in (5, 2, 9, 0):
      r.submit("p", "c", index=i, idx=i, delay=0.01 * i)
    assert r.pending == 4
    first = r.collect([9, 2])
    assert first.indices == (2, 9) and first.rewards.tolist() == [2.0, 9.0]
    auto = r.submit("p", "c", idx=10)  # next free index
    rest = r.collect()
    assert auto == 10 and rest.indices == (0, 5, 10) and r.pending == 0
    with pytest.raises(KeyError):
      r.collect([2])  # already collected


def test_submit_rejects_duplicate_pending_index():
  with RewardRunner(f"{FNS}:length_reward") as r:
    r.submit("p", "abc", index=3)
    with pytest.raises(ValueError, match="already pending"):
      r.submit("p", "abcd", index=3)
    assert r.collect().rewards.tolist() == [3.0]


def test_per_sample_timeout_is_a_counted_error():
  cfg = RewardRunnerConfig(workers=2, timeout_s=0.2, max_errors=1)
  with RewardRunner(f"{FNS}:sleepy", config=cfg) as r:
    batch = r.score(["p", "p"], ["c", "c"], seconds=[0.0, 1.0])
  assert batch.rewards.tolist() == [1.0, 0.0]
  assert [(e.index, e.reason) for e in batch.errors] == [(1, "timeout")]


def test_process_executor_with_import_path_and_bound_kwargs():
  cfg = RewardRunnerConfig(workers=2, executor="process")
  with RewardRunner(f"{FNS}:scaled", config=cfg, reward_kwargs={"scale": 2.0}) as r:
    batch = r.score(["p"] * 4, ["a", "bb", "ccc", ""])
  assert batch.rewards.tolist() == [2.0, 4.0, 6.0, 0.0]


def test_process_executor_refuses_unpicklable_reward():
  with pytest.raises(TypeError, match="import path"):
    RewardRunner(lambda p, c: 1.0, config=RewardRunnerConfig(executor="process"))


def test_score_checks_column_lengths():
  with RewardRunner(f"{FNS}:length_reward") as r:
    with pytest.raises(ValueError, match="field 'answer'"):
      r.score(["a", "b"], ["c", "d"], answer=["x"])


@pytest.mark.parametrize("field, value", [
  ("workers", 0), ("executor", "gpu"), ("max_errors", -1), ("max_errors", 1.5), ("max_errors", True),
  ("timeout_s", 0.0), ("error_value", float("nan")),
])
def test_config_validation_names_field(field, value):
  with pytest.raises(ValueError, match=field):
    RewardRunnerConfig(**{field: value})
