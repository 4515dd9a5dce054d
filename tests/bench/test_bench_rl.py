"""``jaxrl bench rl``'s jaxrl side: the shared workload and one worker subprocess over the JSON protocol."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl.bench import rl as bench_rl

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
             head_dim=16)


def test_tokenizer_gives_every_framework_the_same_prompt_ids(tmp_path):
  from transformers import AutoTokenizer
  bench_rl.write_tokenizer(tmp_path, 256)
  tok = AutoTokenizer.from_pretrained(tmp_path)
  ids = np.random.default_rng(0).integers(2, 256, size=bench_rl.PROMPT_TOKENS)
  text = " ".join(f"w{i}" for i in ids)
  plain = tok(text, add_special_tokens=True)["input_ids"]  # what TRL does with a plain-text prompt
  templated = tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False)["input_ids"]
  assert plain == templated == ids.tolist()
  assert tok.decode(plain) == text
  assert len(tok) == 256 and tok.eos_token_id == 1 and tok.pad_token_id == 0


def test_bench_reward_is_the_even_word_fraction():
  assert bench_rl.bench_reward("p", "w2 w3 w4 w5") == 0.5
  assert bench_rl.bench_reward("p", "") == 0.0


def test_jaxrl_worker_runs_steps_over_the_protocol(tmp_path):
  res = bench_rl.run(tmp_path, steps=2, peers=[], sampling=False, model=SMALL, log=lambda s: None)
  r = res["frameworks"]["jaxrl"]
  for key in ("first_step_s", "step_s", "generate_s", "train_s", "gen_tok_s", "step_tok_s", "versions"):
    assert key in r, key
  assert [s["tokens"] for s in r["steps_raw"]] == [bench_rl.PROMPTS * bench_rl.SAMPLES * bench_rl.NEW_TOKENS] * 2
  assert all(np.isfinite(s["reward"]) for s in r["steps_raw"])
  # per-layer block weights (scan_layers: false) in float32: the sampler decodes from the trainer's arrays
  assert [s["sampler_copied_bytes"] for s in r["steps_raw"]] == [0, 0]
  assert "| jaxrl |" in bench_rl.format_table(res)


class _RecordingPeer:
  """Stands in for a worker subprocess; records (framework, command) in a shared log."""
  log: list = []
  setups: dict = {}  # framework -> its setup message

  def __init__(self, name, argv, env=None):
    self.name = name
    self.log.append((name, "start"))
    self.env = env
    if env:
      self.log.append((name, "env", tuple(sorted(env.items()))))

  def ask(self, cmd, **kw):
    self.log.append((self.name, cmd))
    if cmd == "setup":  # echoes the settings as applied; generates the workload's exact token count
      self.setups[self.name] = kw
      self.tokens = kw["n_prompts"] * kw["samples"] * kw["new_tokens"]
      return {"wall_s": 0.0, "settings": kw["settings"]}
    return {"step_s": 2.0, "generate_s": 1.0, "train_s": 1.0, "tokens": self.tokens}

  def close(self):
    self.log.append((self.name, "close"))


@pytest.mark.parametrize("workload", ["tiny", "0.5b"])
def test_workload_schedule_interleaved_or_one_framework_at_a_time(tmp_path, monkeypatch, workload):
  venvs = tmp_path / "venvs"
  (venvs / "trl" / "bin").mkdir(parents=True)
  (venvs / "trl" / "bin" / "python").touch()
  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(venvs))
  monkeypatch.setattr(bench_rl, "Peer", _RecordingPeer)
  _RecordingPeer.log = []
  seen = {}
  monkeypatch.setattr(bench_rl, "write_workload", lambda work, **kw: seen.update(kw) or {})
  res = bench_rl.run(tmp_path / "w", steps=2, peers=["trl"], sampling=False, workload=workload, log=lambda s: None,
                     xla_cache="CACHE" if workload == "0.5b" else None)
  assert seen["workload"] is bench_rl.WORKLOADS[workload]
  if workload == "0.5b":  # --xla-cache reaches the jaxrl worker only
    assert _RecordingPeer.log.pop(1) == ("jaxrl", "env", ((bench_rl.XLA_CACHE_ENV, "CACHE"),))
  assert [r["steps"] for r in res["frameworks"].values()] == [2, 2]
  # jaxrl's per-layer block weights on both workloads; the option never reaches a peer's setup
  assert _RecordingPeer.setups["jaxrl"]["per_layer_weights"] is True
  assert "per_layer_weights" not in _RecordingPeer.setups["trl"]
  if workload == "tiny":  # both alive, steps alternate
    assert _RecordingPeer.log == [("jaxrl", "start"), ("jaxrl", "setup"), ("trl", "start"), ("trl", "setup"),
                                  ("jaxrl", "step"), ("trl", "step"), ("jaxrl", "step"), ("trl", "step"),
                                  ("jaxrl", "close"), ("trl", "close")]
  else:  # one 0.5B model in memory at a time
    assert _RecordingPeer.log == [("jaxrl", "start"), ("jaxrl", "setup"), ("jaxrl", "step"), ("jaxrl", "step"),
                                  ("jaxrl", "close"), ("trl", "start"), ("trl", "setup"), ("trl", "step"),
                                  ("trl", "step"), ("trl", "close")]


def test_shared_workload_model_is_written_once_under_the_venv_root(tmp_path, monkeypatch):
  from jaxrl import models
  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(tmp_path / "venvs"))
  wl = bench_rl.Workload(2, 2, 4, 4, SMALL, steps=2, interleave=False, shared_model=True)
  saved = []  # the weights themselves are not the point here: a stand-in model and writer
  monkeypatch.setattr(models, "init_model", lambda cfg, seed: ("model", cfg.vocab_size, seed))
  monkeypatch.setattr(models, "save_pretrained",
                      lambda m, d: saved.append(m) or (Path(d).mkdir(parents=True), (Path(d) / "config.json").touch()))
  a = bench_rl.write_workload(tmp_path / "a", workload=wl)
  b = bench_rl.write_workload(tmp_path / "b", workload=wl)
  assert a["hf_dir"] == b["hf_dir"] and saved == [("model", 256, 0)]
  hf_dir = Path(a["hf_dir"])
  assert hf_dir.parent == tmp_path / "venvs" / "models" and (hf_dir / bench_rl.MODEL_MARKER).exists()
  assert [len(json.loads(x)["prompt"].split()) for x in open(a["prompts"])] == [4, 4]  # 2 prompts of 4 words


def test_default_half_billion_workload_has_qwen2p5_0p5b_shapes():
  from jaxrl import models
  wl = bench_rl.WORKLOADS["0.5b"]
  cfg = models.ModelConfig.qwen2p5_0p5b(**wl.model)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (151936, 896, 24, 4864)
  assert 0.49e9 < cfg.num_params() < 0.5e9 and not wl.interleave and wl.shared_model


def test_hf_long_tail_is_skipped_without_the_trl_venv(tmp_path, monkeypatch):
  from jaxrl.bench import sample
  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(tmp_path / "none"))
  got = sample.hf_long_tail(None, [[3, 4]], [2], 1)
  assert got == {"skipped": f"no TRL virtualenv at {tmp_path / 'none' / 'trl'} (create it with "
                            "`jaxrl bench rl --setup trl`)"}


def test_one_at_a_time_a_failing_peer_costs_only_its_column(tmp_path, monkeypatch):
  class Failing(_RecordingPeer):
    def ask(self, cmd, **kw):
      if self.name == "trl" and cmd == "step":
        raise RuntimeError("bench rl: trl step: out of memory")
      return super().ask(cmd, **kw)

  for name in ("trl", "tunix"):
    (tmp_path / "venvs" / name / "bin").mkdir(parents=True)
    (tmp_path / "venvs" / name / "bin" / "python").touch()
  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(tmp_path / "venvs"))
  monkeypatch.setattr(bench_rl, "Peer", Failing)
  monkeypatch.setattr(bench_rl, "write_workload", lambda work, **kw: {})
  Failing.log = []
  res = bench_rl.run(tmp_path / "w", steps=2, peers=["trl", "tunix"], sampling=False, workload="0.5b",
                     log=lambda s: None)
  fw = res["frameworks"]
  assert fw["trl"]["error"] == "bench rl: trl step: out of memory" and "step_s" not in fw["trl"]
  assert fw["jaxrl"]["steps"] == fw["tunix"]["steps"] == 2 and ("trl", "close") in Failing.log
  assert "| trl | failed: bench rl: trl step: out of memory |" in bench_rl.format_table(res)


def test_run_refuses_a_worker_with_other_settings_or_token_count(tmp_path, monkeypatch):
  class Drifting(_RecordingPeer):
    def ask(self, cmd, **kw):
      ans = super().ask(cmd, **kw)
      if self.name == "trl" and cmd == "setup" and drift == "remat":
        ans["settings"] = dict(ans["settings"], remat=True)  # TRL's default gradient checkpointing
      if self.name == "trl" and cmd == "step" and drift == "tokens":
        ans["tokens"] -= 1  # one sample stopped early
      return ans

  (tmp_path / "venvs" / "trl" / "bin").mkdir(parents=True)
  (tmp_path / "venvs" / "trl" / "bin" / "python").touch()
  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(tmp_path / "venvs"))
  monkeypatch.setattr(bench_rl, "Peer", Drifting)
  monkeypatch.setattr(bench_rl, "write_workload", lambda work, **kw: {})
  settings = bench_rl.RLBenchSettings(threads=1)
  for drift, match in (("remat", r"the trl worker runs with other settings: remat=True \(sent False\)"),
                       ("tokens", r"trl generated 4095 tokens at step 1, not 4096")):
    with pytest.raises(ValueError, match=match):
      bench_rl.run(tmp_path / "w", steps=2, peers=["trl"], sampling=False, settings=settings, log=lambda s: None)
  drift = None
  res = bench_rl.run(tmp_path / "w", steps=2, peers=["trl"], sampling=False, settings=settings, log=lambda s: None)
  assert res["settings"] == settings.to_message()
  assert "equal settings: remat off, 1 CPU threads" in bench_rl.format_table(res)
  assert "jaxrl only" not in bench_rl.format_table(res)
  res["workload"] = {"n_prompts": 8, "samples": 8, "new_tokens": 64, "per_layer_weights": True}  # as the workloads
  assert "jaxrl only: one weight array per block (model scan_layers: false)" in bench_rl.format_table(res)
