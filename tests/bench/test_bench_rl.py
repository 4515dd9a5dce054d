"""``jaxrl bench rl``'s jaxrl side: the shared workload and one worker subprocess over the JSON protocol."""

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
  assert "| jaxrl |" in bench_rl.format_table(res)
