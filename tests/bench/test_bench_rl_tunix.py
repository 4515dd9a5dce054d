"""The Tunix peer worker's pure helpers (the worker itself needs the Tunix virtualenv, which CI lacks)."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxrl.bench import rl as bench_rl


def _worker_module():
  path = bench_rl.PEERS["tunix"][0]
  spec = importlib.util.spec_from_file_location("_rl_tunix", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)  # stdlib imports only at module level
  return mod


# Qwen2.5-0.5B's HF config.json (the fields that matter) and, independently, the values Tunix's
# `qwen2.ModelConfig.qwen2p5_0p5b()` hard-codes for it.
QWEN2P5_0P5B_HF = {"num_hidden_layers": 24, "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
                   "rope_theta": 1000000.0, "tie_word_embeddings": True, "model_type": "qwen2"}
TUNIX_QWEN2P5_0P5B = dict(num_layers=24, vocab_size=151936, embed_dim=896, hidden_dim=4864, num_heads=14, head_dim=64,
                          num_kv_heads=2, norm_eps=1e-06, rope_theta=1_000_000, use_tied_embedding=True)


def test_qwen2_config_from_hf_matches_tunix_preset():
  got = _worker_module().qwen2_config_kwargs(json.loads(json.dumps(QWEN2P5_0P5B_HF)))
  assert got == TUNIX_QWEN2P5_0P5B
  assert isinstance(got["rope_theta"], int)


def test_qwen2_config_explicit_head_dim_and_missing_key():
  mod = _worker_module()
  assert mod.qwen2_config_kwargs({**QWEN2P5_0P5B_HF, "head_dim": 32})["head_dim"] == 32
  hf = dict(QWEN2P5_0P5B_HF)
  del hf["intermediate_size"]
  with pytest.raises(ValueError, match="config.json: missing intermediate_size"):
    mod.qwen2_config_kwargs(hf)


def test_bench_reward_matches_jaxrl():
  mod = _worker_module()
  texts = ["w2 w3 w4", "w5", ""]
  assert mod.bench_reward(["p"] * 3, texts) == [bench_rl.bench_reward("p", t) for t in texts]


def test_tunix_is_a_registered_peer_with_pinned_requirements():
  worker, reqs = bench_rl.PEERS["tunix"]
  assert (Path(bench_rl.__file__).parent / worker).exists()
  assert "google-tunix==0.1.7" in reqs and all("==" in r for r in reqs)


def test_missing_peer_venv_is_skipped_with_a_reason(tmp_path, monkeypatch):
  class FakePeer:  # stands in for the jaxrl worker subprocess
    def __init__(self, name, argv):
      self.name = name

    def ask(self, cmd, **kw):
      if cmd == "setup":
        return {"wall_s": 0.0, "settings": kw["settings"]}
      return {"step_s": 2.0, "generate_s": 1.0, "train_s": 1.0, "tokens": bench_rl.PROMPTS * bench_rl.SAMPLES
              * bench_rl.NEW_TOKENS}

    def close(self):
      pass

  monkeypatch.setenv(bench_rl.VENV_ROOT_ENV, str(tmp_path / "venvs"))
  monkeypatch.setattr(bench_rl, "Peer", FakePeer)
  monkeypatch.setattr(bench_rl, "write_workload", lambda work, **kw: {})
  logged = []
  res = bench_rl.run(tmp_path / "work", steps=2, peers=["tunix"], sampling=False, log=logged.append)
  assert list(res["frameworks"]) == ["jaxrl"]
  assert any(line.startswith("tunix: no virtualenv at") and "--setup tunix" in line and line.endswith("skipped")
             for line in logged), logged
