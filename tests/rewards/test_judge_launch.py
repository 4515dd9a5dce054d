"""`judge.launch`: the judge config starts `jaxrl serve` of a local model in a subprocess (free port, readiness
wait, stopped by `close_judges` / `RLTrainer.close`), instead of pointing at a running server."""

import urllib.request

import pytest

from jaxrl import data, models, rewards

pytest.importorskip("openai")
pytest.importorskip("fastapi")


def _tiny_dir(path):
  cfg = models.ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                                head_dim=8, dtype="float32", param_dtype="float32")
  tok = models.load_tokenizer(data.tiny_tokenizer_dir())
  models.save_pretrained(models.init_model(cfg, seed=0), path, tokenizer=tok)
  return str(path)


@pytest.mark.slow
def test_launched_judge_serves_and_is_stopped(tmp_path):
  spec = {"model": "judge", "max_tokens": 3, "timeout_s": 120, "max_retries": 0,
          "launch": {"model": _tiny_dir(tmp_path / "judge"), "max_len": 256, "platform": "cpu",
                     "startup_timeout_s": 600}}
  judge = rewards.get_judge(spec)
  try:
    assert judge.server.proc.poll() is None and not judge.base_url.endswith(":0/v1")
    with urllib.request.urlopen(judge.base_url + "/models", timeout=60) as r:
      assert b'"judge"' in r.read()
    resp = judge.chat([{"role": "user", "content": "2+3=?"}])
    assert resp.completion_tokens >= 1 and judge.stats["http_calls"] == 1
    assert rewards.get_judge(spec) is judge  # one server per config and process
  finally:
    stopped = rewards.close_judges()
  assert stopped == 1 and judge.server.proc.poll() is not None
  assert rewards.close_judges() == 0


def test_a_judge_server_that_cannot_start_fails_once_naming_the_key(tmp_path):
  (tmp_path / "empty").mkdir()
  spec = {"launch": {"model": str(tmp_path / "empty"), "platform": "cpu", "startup_timeout_s": 600}}
  with pytest.raises(rewards.JudgeError, match=r"judge\.launch\.model: `jaxrl serve` of .* exited with status") as e:
    rewards.get_judge(spec)
  with pytest.raises(rewards.JudgeError) as again:  # not relaunched for every sample
    rewards.get_judge(spec)
  assert again.value is e.value
  slow = {"launch": {"model": str(tmp_path / "empty"), "platform": "cpu", "startup_timeout_s": 0.2}}
  with pytest.raises(rewards.JudgeError, match=r"judge\.launch\.startup_timeout_s: .* not listening after 0\.2 s"):
    rewards.get_judge(slow)
  rewards.close_judges()


def test_launch_config_is_checked(tmp_path):
  with pytest.raises(ValueError, match="judge.launch.model"):
    rewards.JudgeConfig(launch=rewards.JudgeLaunch(model=str(tmp_path / "missing")))
  with pytest.raises(ValueError, match="judge.base_url: leave it unset"):
    rewards.JudgeConfig(base_url="http://x/v1", launch=rewards.JudgeLaunch(model=str(tmp_path)))


def test_trainer_close_stops_launched_judges(monkeypatch):
  import types

  from jaxrl import rl
  stopped = []
  monkeypatch.setattr(rewards, "close_judges", lambda: stopped.append(True) or 0)
  stub = types.SimpleNamespace(preemption=types.SimpleNamespace(uninstall=lambda: None),
                               rewards=types.SimpleNamespace(close=lambda: None), teacher=None)
  rl.RLTrainer.close(stub)
  assert stopped == [True]
