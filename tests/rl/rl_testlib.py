"""Shared pieces of the RL tests: a tiny model section, config builder, rewards loadable by import path."""

import json

from jaxrl import config as config_lib
from jaxrl import rl

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def make_config(tmp_path, **over) -> rl.RLConfig:
  """A tiny RL config (8 fake devices: 8 rows of 48 tokens per micro-batch) with ``key=value`` overrides."""
  base = {
      "model": TINY,
      "data": {"builtin": {"n_train": 64, "n_heldout": 8, "difficulty": 2}, "max_prompt_tokens": 32},
      "rollout": {"prompts_per_step": 4, "n": 4, "max_new_tokens": 16},
      "reward": {"fn": "rl_testlib:digit_fraction"},
      "algorithm": {"mini_batches": 2},
      "micro_batch": {"token_budget": 384, "row_len": 48},
      "optim": {"lr": 1e-3},
      "steps": 2,
      "eval": {"every": 0},
      "out_dir": str(tmp_path / "run"),
      "tensorboard": False,
  }
  data = config_lib.apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in over.items()])
  return config_lib.from_dict(rl.RLConfig, data)


def digit_fraction(prompt, completion, **_):
  """Dense, learnable from scratch: the share of digit characters in the completion."""
  del prompt
  return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def starts_with_digit(prompt, completion, **_):
  """Sparse 0/1: many groups of a random policy get all-equal rewards (dynamic sampling drops them)."""
  del prompt
  return float(bool(completion) and completion[0].isdigit())


REWARD_STARTS: list[float] = []
"""``time.monotonic()`` at the start of every :func:`timed_digit_fraction` call (thread executor)."""


def timed_digit_fraction(prompt, completion, **fields):
  """:func:`digit_fraction`, recording when each call starts."""
  import time
  REWARD_STARTS.append(time.monotonic())
  return digit_fraction(prompt, completion, **fields)
