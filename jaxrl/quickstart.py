"""``jaxrl quickstart``: SFT warm start on the built-in arithmetic task, then GRPO, on a laptop CPU.

1. A tiny model is fine-tuned briefly on worked arithmetic answers (``jaxrl.sft.SFTTrainer``), short
   enough that its held-out accuracy is mediocre.
2. GRPO (``jaxrl.rl.RLTrainer``) trains it on train-split prompts with the verifiable reward
   ``jaxrl.rl:arithmetic_reward`` (exact match of the ``Answer:``), evaluating greedy completions of
   held-out questions before, during and after.
3. A before/after table of held-out accuracy is printed; ``out_dir/rl/curves.png`` holds the plot.

``configs/grpo_tiny.yaml`` is the RL half as a config file (with a random-init model section); the
settings below are the same.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

TINY_MODEL = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
                                              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}
DIFFICULTY = 2

SFT = {
    "model": TINY_MODEL,
    "data": {"builtin": {"n_train": 4000, "n_heldout": 16, "difficulty": DIFFICULTY, "seed": 0}},
    "packing": {"seq_len": 256, "global_rows": 8, "method": "best_fit", "buffer_size": 64},
    "loss": {"mode": "global_token_mean", "chunk_size": 128},
    "optim": {"lr": 3.0e-3, "warmup_steps": 10, "schedule": "cosine", "final_lr_ratio": 0.1},
    "steps": 120,
    "eval": {"every": 0, "exact_match": 0},
    "export_hf": True,
}
"""The SFT warm start (``configs/sft_tiny.yaml``, shortened)."""

RL = {
    "data": {"builtin": {"n_train": 2000, "n_heldout": 64, "difficulty": DIFFICULTY, "seed": 0},
             "max_prompt_tokens": 32},
    "rollout": {"prompts_per_step": 16, "n": 8, "max_new_tokens": 32, "temperature": 1.0},
    "reward": {"fn": "jaxrl.rl:arithmetic_reward", "correct_threshold": 0.5},
    "algorithm": {"advantage": "grpo", "objective": "ppo_clip", "aggregation": "token_mean",
                  "old_logprobs": "recompute", "ppo_epochs": 1, "mini_batches": 2},
    "micro_batch": {"token_budget": 4096, "row_len": 64},
    "optim": {"lr": 1.0e-3, "warmup_steps": 2, "schedule": "constant", "clip_norm": 1.0},
    "steps": 40,
    "eval": {"every": 10, "prompts": 64},
}
"""The GRPO half (``configs/grpo_tiny.yaml`` minus its ``model:`` section)."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
  out = dict(base)
  for k, v in over.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def run_quickstart(out_dir: str | Path, *, seed: int = 0, sft: dict[str, Any] | None = None,
                   rl: dict[str, Any] | None = None, tensorboard: bool = True) -> dict[str, Any]:
  """SFT then GRPO; returns ``{"sft_accuracy", "rl_accuracy", "rl": results, "seconds": ...}``.

  ``sft`` / ``rl`` are nested overrides of :data:`SFT` / :data:`RL`; ``seed`` seeds the model
  initialisation, the SFT data order, the prompt shuffle and the sampler.
  """
  from jaxrl import config as config_lib
  from jaxrl import rl as rl_lib
  from jaxrl import sft as sft_lib
  out_dir = Path(out_dir)
  t0 = time.perf_counter()
  sft_dict = _merge(SFT, {"model": {"seed": seed}, "data": {"shuffle_seed": seed}, "out_dir": str(out_dir / "sft"),
                          "tensorboard": tensorboard})
  sft_dict = _merge(sft_dict, sft or {})
  sft_out = sft_lib.SFTTrainer(config_lib.from_dict(sft_lib.SFTConfig, sft_dict)).run()
  t1 = time.perf_counter()
  rl_dict = _merge(RL, {"data": {"shuffle_seed": seed}, "seed": seed, "out_dir": str(out_dir / "rl"),
                        "tensorboard": tensorboard})
  rl_dict = _merge(rl_dict, rl or {})
  rl_dict["model"] = {"hf_dir": sft_out["hf_dir"]}
  trainer = rl_lib.RLTrainer(config_lib.from_dict(rl_lib.RLConfig, rl_dict))
  try:
    rl_out = trainer.run()
  finally:
    trainer.close()
  t2 = time.perf_counter()
  result = {
      "seed": seed,
      "sft_accuracy": rl_out["eval_before"]["eval/accuracy"],
      "rl_accuracy": rl_out["eval_after"]["eval/accuracy"],
      "eval_curve": [(h["step"], h["eval/accuracy"]) for h in trainer.history if "eval/accuracy" in h],
      "reward_first": rl_out["rewards"][0], "reward_last": rl_out["rewards"][-1],
      "seconds_sft": t1 - t0, "seconds_rl": t2 - t1, "plot": rl_out["plot"],
  }
  (out_dir / "quickstart.json").write_text(json.dumps(result, indent=2))
  return result


def _table(results: list[dict[str, Any]]) -> str:
  from rich.console import Console
  from rich.table import Table
  table = Table(title="held-out accuracy (greedy, exact match of the Answer:)")
  for col in ("seed", "SFT only", "SFT + GRPO", "gain", "SFT s", "GRPO s"):
    table.add_column(col, justify="right")
  for r in results:
    table.add_row(str(r["seed"]), f"{r['sft_accuracy']:.1%}", f"{r['rl_accuracy']:.1%}",
                  f"{r['rl_accuracy'] - r['sft_accuracy']:+.1%}", f"{r['seconds_sft']:.0f}", f"{r['seconds_rl']:.0f}")
  console = Console(record=True)
  console.print(table)
  return console.export_text()


def main(argv: list[str] | None = None) -> int:
  """``jaxrl quickstart [--out-dir DIR] [--seeds 0 1 2]``; returns the exit status."""
  parser = argparse.ArgumentParser(prog="jaxrl quickstart", description=__doc__.splitlines()[0])
  parser.add_argument("--out-dir", default="runs/quickstart", help="where runs, plots and quickstart.json go")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
  parser.add_argument("--sft-steps", type=int, default=None, help=f"SFT steps (default {SFT['steps']})")
  parser.add_argument("--rl-steps", type=int, default=None, help=f"GRPO steps (default {RL['steps']})")
  parser.add_argument("--no-tensorboard", action="store_true")
  ns = parser.parse_args(argv)
  sft_over = {} if ns.sft_steps is None else {"steps": ns.sft_steps}
  rl_over = {} if ns.rl_steps is None else {"steps": ns.rl_steps}
  results = []
  for seed in ns.seeds:
    out = Path(ns.out_dir) if len(ns.seeds) == 1 else Path(ns.out_dir) / f"seed{seed}"
    results.append(run_quickstart(out, seed=seed, sft=sft_over, rl=rl_over, tensorboard=not ns.no_tensorboard))
  _table(results)
  for r in results:
    print(f"plot: {r['plot']}")
  return 0
