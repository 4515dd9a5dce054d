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


def digit_monitor(completion: str) -> dict[str, float]:
  """Every sample reports ``chars``; only those with a digit report ``digits`` (a mean over the reporters)."""
  digits = sum(c.isdigit() for c in completion)
  return {"chars": float(len(completion)), **({"digits": float(digits)} if digits else {})}


def monitored_digit_fraction(prompt, completion, **fields):
  """:func:`digit_fraction` with :func:`digit_monitor` as ``info["monitor"]`` (logged as ``reward/monitor/*``)."""
  from jaxrl.rewards import RewardResult
  return RewardResult(value=digit_fraction(prompt, completion, **fields), info={"monitor": digit_monitor(completion)})


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


def first_micro_batch_ratios(trainer, rollout, step, *, shift: float, current_as_old: bool) -> tuple[float, float]:
  """``(ratio_min, ratio_max)`` the configured loss reports on the first micro-batch of ``rollout``, at
  the trainer's parameters, with π_old = the trainer's recomputed log-probs + ``shift`` on loss tokens.

  ``current_as_old=True`` is the trainer's first-mini-batch shortcut (π_old := the current log-probs);
  with ``False`` the ratio is computed against the given π_old, so ``shift=0`` checks that the π_old
  recompute equals the loss's own forward (what makes the shortcut valid) and ``shift=δ`` that the
  ratio reads π_old (``exp(-δ)``).
  """
  import jax.numpy as jnp

  from jaxrl import models
  from jaxrl.rl._loss import make_loss_fn, make_prepare
  cfg = trainer.cfg
  pb = trainer.pack(rollout, step)[0][0]
  mb = trainer._device(pb.micro_batch(0))
  old = trainer.logprob_fn(trainer.state.params, mb, *trainer.frozen)  # the π_old recompute program
  max_len = cfg.algorithm.aggregation_max_len or cfg.rollout.stage(step)[1]
  mb = make_prepare(cfg.algorithm, num_groups=cfg.rollout.prompts_per_step, max_len=max_len)(
      dict(mb, old_logprobs=old + shift * mb["loss_mask"], ref_logprobs=old))
  loss_fn = make_loss_fn(trainer.graphdef, cfg.algorithm, temperature=cfg.rollout.temperature,
                         num_micro=pb.shape[0])
  if cfg.lora is not None:
    loss_fn = models.lora_loss(loss_fn)
  _, metrics = loss_fn(trainer.state.params, mb, *trainer.frozen, jnp.asarray(current_as_old))
  return float(metrics["mb/ratio_min"].sum()), float(metrics["mb/ratio_max"].sum())
