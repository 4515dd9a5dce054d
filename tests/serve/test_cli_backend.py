"""`jaxrl serve --backend engine ...`: the CLI builds a continuous-batching engine with the given knobs, and
the app it serves answers like the sampler (greedy tokens and log-probs, echo scoring)."""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from jaxrl import sampling
from jaxrl.cli import serve as _cli


def test_engine_backend_from_the_cli(tiny_dir, tiny_sampler):
  app, args = _cli.build_app(["--model", str(tiny_dir), "--backend", "engine", "--num-slots", "2",
                              "--block-size", "8", "--num-blocks", "40", "--max-len", "64", "--max-top-logprobs", "3",
                              "--dtype", "float32", "--served-model-name", "x"])
  engine = app.state.batcher.backend
  assert isinstance(engine, sampling.Engine) and args.backend == "engine"
  assert (engine.num_slots, engine.block_size, engine.num_blocks, engine.max_len, engine.max_top_logprobs) == \
      (2, 8, 40, 64, 3)
  prompt = "9-4="
  ids = tiny_sampler.tokenizer.encode(prompt)
  ref = tiny_sampler.generate([ids], n=1, max_new_tokens=6, temperature=0.0, return_top_logprobs=2)
  n = int(ref.lengths[0])
  with TestClient(app) as http:
    r = http.post("/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                           "logprobs": 2}).json()
    c = r["choices"][0]
    assert c["text"] == ref.texts[0]
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"], ref.logprobs[0, :n], rtol=0, atol=1e-5)
    e = http.post("/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": 0, "echo": True,
                                           "logprobs": 0}).json()
    assert e["choices"][0]["text"] == prompt and e["choices"][0]["logprobs"]["token_logprobs"][0] is None
    bad = http.post("/v1/completions", json={"model": "x", "prompt": prompt, "logprobs": 4})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"  # capped by the engine's 3


def test_cli_rejects_two_cache_budgets_and_bad_knobs(tiny_dir, capsys):
  with pytest.raises(SystemExit):
    _cli.build_parser().parse_args(["--model", "m", "--kv-cache-bytes", "1000", "--num-blocks", "4"])
  assert "not allowed with" in capsys.readouterr().err
  assert _cli.main(["--model", str(tiny_dir), "--backend", "engine", "--num-slots", "0", "--port", "0"]) == 2
  assert "--num-slots" in capsys.readouterr().err
