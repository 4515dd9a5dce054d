"""``jaxrl bench dpo``: the jaxrl worker's step on the bench workload, and the summary / table code.

The TRL side runs only in its own virtualenv (``jaxrl bench dpo``); it is not needed here.
"""

from __future__ import annotations

import math

import pytest

from jaxrl.bench import dpo as bench_dpo

PAIRS, PROMPT, COMPLETION = 8, 4, 3  # pairs: a multiple of the 8 test devices


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
  root = tmp_path_factory.mktemp("bench_dpo")
  spec = bench_dpo.write_workload(root, pairs=PAIRS, prompt_tokens=PROMPT, completion_tokens=COMPLETION,
                                  model=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                             num_heads=2, num_kv_heads=1, head_dim=16))
  w = bench_dpo.JaxrlWorker()
  ans = w.setup(**spec, pairs=PAIRS, seq_len=PROMPT + COMPLETION, steps=2, out_dir=str(root / "out"), lr=1e-2,
                beta=0.1)
  assert ans["ok"]
  return w


def test_jaxrl_worker_steps(worker):
  """Every token of the 2·P sequences is counted, no padding (one sequence per row), the pairs' words are one
  token each, and step 1's loss is log 2: the policy is its frozen reference, every margin 0."""
  first = worker.step()
  assert first["tokens"] == 2 * PAIRS * (PROMPT + COMPLETION)
  assert first["padding"] == 0.0
  assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
  pair = worker.trainer.train_pairs[0]
  assert pair.chosen["tokens"].shape == (PROMPT + COMPLETION,)
  assert int(pair.chosen["loss_mask"].sum()) == COMPLETION  # the answer's words are scored, the prompt's not
  second = worker.step()  # lr 1e-2 on the same pairs: the margin grows, the loss falls below log 2
  assert second["loss"] < math.log(2) - 1e-3


def test_summary_and_table():
  """Medians exclude the first (compiling) step; the speed-up is the peer's median step over jaxrl's; the
  loss gap is the largest per-step difference."""
  steps = lambda ts, losses: [{"step_s": t, "tokens": 100, "loss": l, "cpu_s": t} for t, l in zip(ts, losses)]
  results = {"settings": {"loss": "sigmoid (DPO)", "beta": 0.1},
             "frameworks": {"jaxrl": bench_dpo.summarise(steps([9.0, 1.0, 3.0, 2.0], [0.69, 0.5, 0.4, 0.3])),
                            "trl": bench_dpo.summarise(steps([5.0, 4.0, 6.0, 8.0], [0.69, 0.5, 0.41, 0.3]))}}
  j, t = results["frameworks"]["jaxrl"], results["frameworks"]["trl"]
  assert (j["first_step_s"], j["step_s"], j["tok_s"]) == (9.0, 2.0, 50.0)
  assert (t["step_s"], t["tok_s"], t["step_cpu_s"]) == (6.0, pytest.approx(100 / 6), 6.0)
  table = bench_dpo.format_table(results)
  assert "- beta: 0.1" in table
  assert "| trl | 5.00 | 6.000 | 100 | 17 | 3.00× |" in table
  assert "max |difference| 1.00e-02" in table
