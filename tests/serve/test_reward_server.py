"""``jaxrl serve --model <reward model dir>``: ``POST /v1/rewards`` returns the reward model's scores."""

import json
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np

from jaxrl import data as data_lib
from jaxrl import models, pref, serve
from jaxrl.cli.serve import build_app

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "dtype": "float32", "param_dtype": "float32"}}


def _post(url, body):
  req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_rewards_route_scores_like_a_direct_forward(tmp_path):
  vm = models.ValueModel(models.ModelSource(**TINY).build())
  vm.value_head[...] = jnp.asarray(np.random.default_rng(2).normal(0, 1.0, vm.value_head[...].shape), jnp.float32)
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  pref.export_reward_model(vm, tmp_path / "rm", tokenizer=tok)
  app, _ = build_app(["--model", str(tmp_path / "rm"), "--max-len", "64", "--max-batch-rows", "8",
                      "--served-model-name", "rm"])
  prompts = ["3+4=?", [{"role": "user", "content": "2*6=?"}], "9-1=?"]
  completions = ["3+4=7. Answer: 7", "2*6=13. Answer: 13", "8"]
  want = []
  for p, c in zip(prompts, completions):
    ids = jnp.asarray(data_lib.encode_chat(tok, pref.answer_messages(p, c))["tokens"], jnp.int32)[None]
    want.append(float(vm(ids, positions=jnp.arange(ids.shape[1])[None], segment_ids=jnp.ones_like(ids))[0, -1]))
  with serve.ServerThread(app, port=0) as srv:
    status, got = _post(f"{srv.url}/rewards", {"model": "rm", "prompt": prompts, "completion": completions})
    assert status == 200, got
    assert np.std(want) > 1e-3
    np.testing.assert_allclose(got["rewards"], want, rtol=1e-5, atol=1e-6)
    status, err = _post(f"{srv.url}/rewards", {"prompt": ["a"], "completion": []})
    assert status == 400 and "'prompt' has 1 entries, 'completion' 0" in err["error"]["message"]
    status, err = _post(f"{srv.url}/rewards", {"prompt": ["1+1=?"], "completion": ["2" * 80]})
    assert status == 400 and "longer than reward.model.seq_len=64" in err["error"]["message"]
