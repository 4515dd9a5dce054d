"""``jaxrl sample`` prints completions and, on request, per-token log-probs."""

import numpy as np
from sampling_testlib import HF_FIXTURES

from jaxrl.cli import sample as _cli


def test_cli_prints_greedy_completions_with_logprobs(capsys, qwen3_sampler):
  prompts = ["The quick brown", "What is"]
  rc = _cli.main(["--model", str(HF_FIXTURES / "qwen3"), "--prompt", prompts[0], "--prompt", prompts[1],
                  "--temperature", "0", "--max-new-tokens", "16", "--logprobs"])
  assert rc == 0
  printed = capsys.readouterr().out
  out = qwen3_sampler.generate(prompts, max_new_tokens=16, temperature=0.0)
  for i in range(2):
    assert f"=== prompt {i} sample 0" in printed
  first = f"{int(out.tokens[0, 0]):7d}"
  assert first in printed and f"{out.logprobs[0, 0]:9.4f}" in printed
  assert printed.count("sum logprob") == 2
  assert np.isfinite(out.logprobs).all()


def test_cli_reports_missing_model_dir(capsys, tmp_path):
  rc = _cli.main(["--model", str(tmp_path / "nope"), "--prompt", "hi"])
  assert rc == 2
  assert "does not exist" in capsys.readouterr().err
