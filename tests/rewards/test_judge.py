"""The judge client against a scripted fake server on 127.0.0.1: retries, degrade, cache, accounting, scores."""

import math

import pytest
from judge_testlib import start_fake

from jaxrl import rewards
from jaxrl.rewards import Judge, JudgeConfig, JudgeError, JudgeScoreError


@pytest.fixture(scope="module")
def fake():
  srv = start_fake()
  yield srv
  srv.stop()


def _judge(srv, **kw):
  kw = {"base_url": srv.url, "backoff_s": 0.01, "backoff_max_s": 0.02, "max_retries": 2, "timeout_s": 5.0, **kw}
  return Judge(JudgeConfig(**kw))


def _ask(tag):
  return [{"role": "user", "content": f"grade this {tag}"}]


def test_parse_score_forms():
  assert rewards.parse_score("blah Score: 7/10", hi=10) == 7.0
  assert rewards.parse_score("Score: 4/5", hi=10) == 8.0
  assert rewards.parse_score('thinking {"reason": "fine", "score": 3}') == 3.0
  assert rewards.parse_score("Rating = 2.5") == 2.5
  assert rewards.parse_score(" 6. ") == 6.0
  assert rewards.parse_score("no number here") is None
  assert rewards.parse_choice("I think [[B]]") == "B"
  assert rewards.parse_choice("Verdict: A") == "A"
  assert rewards.parse_choice("both") is None


def test_expected_score_is_the_renormalised_mean():
  top = [{"x": 0.0}, {"3": math.log(0.2), "5": math.log(0.6), "z": math.log(0.2)}]
  assert rewards.expected_score(top, lo=0, hi=9) == pytest.approx((3 * 0.2 + 5 * 0.6) / 0.8, abs=1e-12)
  assert rewards.expected_score([{"a": 0.0}], lo=0, hi=9) is None


def test_429_then_success_is_retried(fake):
  j = _judge(fake)
  s, info = j.score(_ask("[[429x2:Score: 6]]"), mode="text")
  assert (s, info["source"]) == (6.0, "text")
  assert fake.server.config.app.state.calls["[[429x2:Score: 6]]"] == 3
  assert (j.stats["retries"], j.stats["http_calls"], j.stats["errors"]) == (2, 3, 0)


def test_500s_exhaust_the_retries(fake):
  j = _judge(fake, max_retries=2)
  with pytest.raises(JudgeError) as e:
    j.chat(_ask("[[500]]"))
  assert e.value.reason == "http_500"
  assert fake.server.config.app.state.calls["[[500]]"] == 3 and j.stats["errors"] == 1


def test_timeout_is_retried_then_an_error(fake):
  j = _judge(fake, timeout_s=0.2, max_retries=1)
  with pytest.raises(JudgeError) as e:
    j.chat(_ask("[[slow:1.0:Score: 1]]"))
  assert e.value.reason == "timeout"
  assert fake.server.config.app.state.calls["[[slow:1.0:Score: 1]]"] == 2


def test_malformed_score_raises(fake):
  with pytest.raises(JudgeScoreError):
    _judge(fake).score(_ask("[[ok:I like it]]"), mode="text")


def test_logprob_scoring_is_the_expected_score(fake):
  s, info = _judge(fake).score(_ask("[[lp:7]]"), mode="logprobs")
  assert info["source"] == "logprobs" and s == pytest.approx((7 * 0.5 + 8 * 0.25) / 0.75)


def test_refused_logprobs_degrade_to_text():
  srv = start_fake(refuse_logprobs=True)
  try:
    j = _judge(srv)
    s, info = j.score(_ask("[[lp:7]]"))
    assert (s, info["source"], j.logprobs_ok, j.stats["degraded"]) == (7.0, "text", False, 1)
    j.score(_ask("[[ok:Score: 2]]"))
    bodies = srv.server.config.app.state.bodies
    assert [("logprobs" in b) for b in bodies] == [True, False, False]
  finally:
    srv.stop()


def test_longcat_profile_never_asks_for_logprobs(fake):
  j = _judge(fake, provider="longcat")
  before = len(fake.server.config.app.state.bodies)
  assert j.score(_ask("[[ok:Score: 3]]"))[0] == 3.0
  assert "logprobs" not in fake.server.config.app.state.bodies[before]
  assert JudgeConfig(provider="qwen").resolved_base_url() == "https://dashscope.aliyuncs.com/compatible-mode/v1"


def test_persistent_cache_and_secret_key(fake, tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRL_JUDGE_API_KEY", "sk-secret-123")
  path = str(tmp_path / "cache.sqlite")
  j1 = _judge(fake, cache_path=path)
  a = j1.chat(_ask("[[ok:Score: 4]] cache"))
  b = j1.chat(_ask("[[ok:Score: 4]] cache"))
  assert (a.text, b.cached, j1.stats["http_calls"], j1.stats["cache_hits"]) == ("Score: 4", True, 1, 1)
  j2 = _judge(fake, cache_path=path)  # a restarted run
  assert j2.chat(_ask("[[ok:Score: 4]] cache")).cached and j2.stats["http_calls"] == 0
  assert j1.stats["prompt_tokens"] == 10 and j1.stats["completion_tokens"] == 3
  assert "sk-secret" not in repr(j1) and b"sk-secret" not in open(path, "rb").read()


def test_runner_counts_every_sample_once(fake):
  """A batch mixing good, 429-then-good, 500 and no-score answers: all samples come back, failures counted."""
  judge = {"base_url": fake.url, "backoff_s": 0.01, "backoff_max_s": 0.02, "max_retries": 1, "max_concurrency": 3}
  fn = rewards.load_reward("judge", judge=judge, mode="text", template="{completion}")
  tags = ["[[ok:Score: 9]] r1", "[[429x1:Score: 0]] r2", "[[500]] r3", "[[ok:meh]] r4", "[[ok:Score: 3]] r5"]
  calls = fake.server.config.app.state.calls
  before = {t.rsplit(" ", 1)[0]: calls[t.rsplit(" ", 1)[0]] for t in tags}
  runner = rewards.RewardRunner(fn, config=rewards.RewardRunnerConfig(workers=4, max_errors=2, error_value=-1.0))
  try:
    batch = runner.score(["p"] * len(tags), tags)
  finally:
    runner.close()
  assert batch.rewards.tolist() == pytest.approx([1.0, 0.0, -1.0, -1.0, 3 / 9])
  assert [calls[t.rsplit(" ", 1)[0]] - before[t.rsplit(" ", 1)[0]] for t in tags] == [1, 2, 2, 1, 1]
  assert sorted(e.index for e in batch.errors) == [2, 3]
