"""``jaxrl quickstart``: SFT warm start on the built-in arithmetic task, then GRPO, on a laptop CPU.

1. A tiny model is fine-tuned briefly (``jaxrl.sft.SFTTrainer``) on built-in arithmetic problems with
   worked answers whose last line is inconsistent, as in data pooled from several sources: a share
   ``ALT_FORMAT_FRACTION`` of the demonstrations end ``... 3+8=11. The answer is 11.`` instead of the
   canonical ``... 3+8=11. Answer: 11``. The SFT model imitates both endings, and greedy decoding
   picks the majority one.
2. GRPO (``jaxrl.rl.RLTrainer``) trains it on freshly drawn train-split problems with the verifiable
   reward ``jaxrl.rl:arithmetic_reward``: exact match of the ``Answer:`` line, so a right number in
   the wrong format earns nothing (DeepSeek-R1's rule rewards check format and answer the same way).
3. Held-out accuracy (problems of the held-out split: never trained on) is measured greedily before,
   during and after GRPO, and before and after as pass@1 at the sampling temperature (the mean over
   ``SAMPLES`` samples per problem). The held-out problems are written to ``out_dir/rl_data/heldout.jsonl`` and
   both models exported (``out_dir/sft/hf``, ``out_dir/rl/hf``), so ``jaxrl eval`` reproduces these numbers
   (docs/eval.md). A before/after table is printed; ``out_dir/rl/curves.png`` holds the plot and
   ``out_dir/quickstart.json`` the numbers.

GRPO's gain here is the canonical answer format (a behaviour shared by every problem); the
arithmetic itself does not improve in a few minutes on a 2-layer model (the table's "any format"
columns accept either ending and so measure the arithmetic alone). A k3 KL term to the SFT model
(``kl_coef: 0.1``) keeps GRPO from trading held-out arithmetic for train-split memorisation, which
it does without one. Numbers: ``docs/benchmarks.md``.

``configs/grpo_tiny.yaml`` is the RL half as a config file (with a random-init model section); the
settings below are the same.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import rl as rl_lib
from jaxrl import sft as sft_lib

TINY_MODEL = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
                                              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                              "dtype": "float32", "param_dtype": "float32"}}
DIFFICULTY = 2
ALT_FORMAT_FRACTION = 0.7
"""Share of SFT demonstrations ending ``The answer is v.`` rather than ``Answer: v``."""
SFT_RECORDS = 4000
SAMPLES = 8

SFT = {
    "model": TINY_MODEL,
    "packing": {"seq_len": 256, "global_rows": 8, "method": "best_fit", "buffer_size": 64},
    "loss": {"mode": "global_token_mean", "chunk_size": 128},
    "optim": {"lr": 3.0e-3, "warmup_steps": 10, "schedule": "cosine", "final_lr_ratio": 0.1},
    "steps": 350,
    "eval": {"every": 0, "exact_match": 0},
    "export_hf": True,
}
"""The SFT warm start (``configs/sft_tiny.yaml``, shortened); its data come from :func:`sft_records`."""

RL = {
    "data": {"builtin": {"n_train": 2000, "n_heldout": 128, "difficulty": DIFFICULTY, "seed": 1},
             "max_prompt_tokens": 32},
    "rollout": {"prompts_per_step": 16, "n": 8, "max_new_tokens": 32, "temperature": 1.0,
                "engine": {"num_slots": 64, "kv_cache_bytes": 4194304, "block_size": 16}},
    "reward": {"fn": "jaxrl.rl:arithmetic_reward", "correct_threshold": 0.5},
    "algorithm": {"advantage": "grpo", "objective": "ppo_clip", "aggregation": "token_mean",
                  "old_logprobs": "recompute", "ppo_epochs": 1, "mini_batches": 2, "kl_coef": 0.1},
    "micro_batch": {"token_budget": 3840, "row_len": 96},
    "optim": {"lr": 2.0e-4, "warmup_steps": 4, "schedule": "constant", "clip_norm": 1.0},
    "steps": 100,
    "eval": {"every": 25, "prompts": 128},
}
"""The GRPO half (``configs/grpo_tiny.yaml`` minus its ``model:`` section)."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
  out = dict(base)
  for k, v in over.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def sft_records(n: int, *, seed: int, alt_fraction: float | None = None) -> list[dict[str, Any]]:
  """Built-in train-split problems; a seeded ``alt_fraction`` (default :data:`ALT_FORMAT_FRACTION`)
  of them end ``The answer is v.``."""
  alt_fraction = ALT_FORMAT_FRACTION if alt_fraction is None else alt_fraction
  records = data_lib.generate_arithmetic(n, seed=seed, split="train",
                                         config=data_lib.ArithmeticConfig.level(DIFFICULTY))
  alt = np.random.default_rng([seed, 1]).random(n) < alt_fraction
  for record, flip in zip(records, alt):
    if flip:
      reply = record["messages"][-1]
      reply["content"] = reply["content"].replace(f"Answer: {record['answer']}", f"The answer is {record['answer']}.")
  return records


_ANY_FORMAT = re.compile(r"(?:Answer:|The answer is)\s*(-?\d+)")


def any_format_accuracy(trainer, step: int) -> float:
  """Greedy held-out accuracy counting a right number in *either* ending: the arithmetic alone.

  The reward (and ``eval/accuracy``) accepts only ``Answer: v``; the gap between the two is the
  format GRPO learned."""
  idx, out, _ = trainer.eval_completions(step, temperature=0.0, samples=1)
  records = trainer.heldout_prompts.records
  hits = [(m := _ANY_FORMAT.search(text)) is not None and m.group(1) == records[i]["answer"]
          for i, text in zip(idx, out.texts)]
  return sum(hits) / max(len(hits), 1)


def run_quickstart(out_dir: str | Path, *, seed: int = 0, sft: dict[str, Any] | None = None,
                   rl: dict[str, Any] | None = None, tensorboard: bool = True) -> dict[str, Any]:
  """SFT then GRPO; returns held-out accuracies before/after, the eval curve and timings.

  ``sft`` / ``rl`` are nested overrides of :data:`SFT` / :data:`RL`. ``seed`` seeds the model
  initialisation, the SFT data order, the RL prompts (``builtin.seed = 1 + seed``), their shuffle
  and the sampler.
  """
  out_dir = Path(out_dir)
  t0 = time.perf_counter()
  train_file = data_lib.write_jsonl(sft_records(SFT_RECORDS, seed=seed), out_dir / "sft_data" / "train.jsonl")
  sft_dict = _merge(SFT, {"model": {"seed": seed},
                          "data": {"train": [str(train_file)], "builtin": None, "shuffle_seed": seed},
                          "out_dir": str(out_dir / "sft"), "tensorboard": tensorboard})
  sft_out = sft_lib.SFTTrainer(config_lib.from_dict(sft_lib.SFTConfig, _merge(sft_dict, sft or {}))).run()
  t1 = time.perf_counter()
  rl_dict = _merge(RL, {"data": {"builtin": {"seed": 1 + seed}, "shuffle_seed": seed}, "seed": seed,
                        "out_dir": str(out_dir / "rl"), "tensorboard": tensorboard,
                        "export_hf": True})  # out_dir/rl/hf, for jaxrl eval (docs/eval.md)
  rl_dict = _merge(rl_dict, rl or {})
  builtin = config_lib.from_dict(rl_lib.BuiltinPrompts, rl_dict["data"]["builtin"], prefix="data.builtin")
  heldout_file = data_lib.write_jsonl(builtin.records("heldout"), out_dir / "rl_data" / "heldout.jsonl")
  rl_dict = _merge(rl_dict, {"data": {"heldout": [str(heldout_file)]}})  # the file jaxrl eval reads too
  rl_dict["model"] = {"hf_dir": sft_out["hf_dir"]}
  trainer = rl_lib.RLTrainer(config_lib.from_dict(rl_lib.RLConfig, rl_dict))
  try:
    sampled_before = trainer.evaluate(1, temperature=1.0, samples=SAMPLES, prefix="sampled")
    lenient_before = any_format_accuracy(trainer, 1)
    rl_out = trainer.run()
    sampled_after = trainer.evaluate(trainer.cfg.steps, temperature=1.0, samples=SAMPLES, prefix="sampled")
    lenient_after = any_format_accuracy(trainer, trainer.cfg.steps)
  finally:
    trainer.close()
  t2 = time.perf_counter()
  result = {
      "seed": seed,
      "sft_accuracy": rl_out["eval_before"]["eval/accuracy"],
      "rl_accuracy": rl_out["eval_after"]["eval/accuracy"],
      "sft_sampled": sampled_before["sampled/accuracy"],
      "rl_sampled": sampled_after["sampled/accuracy"],
      "sft_any_format": lenient_before, "rl_any_format": lenient_after,
      "eval_curve": [(0, rl_out["eval_before"]["eval/accuracy"])] + [
          (int(h["step"]), h["eval/accuracy"]) for h in trainer.history if "eval/accuracy" in h],
      "reward_first10": sum(rl_out["rewards"][:10]) / 10, "reward_last10": sum(rl_out["rewards"][-10:]) / 10,
      "seconds_sft": t1 - t0, "seconds_rl": t2 - t1, "plot": rl_out["plot"],
      "metrics": {"sft": rl_out["eval_before"], "rl": rl_out["eval_after"], "sft_sampled": sampled_before,
                  "rl_sampled": sampled_after},
      "sft_hf_dir": sft_out["hf_dir"], "rl_hf_dir": rl_out.get("hf_dir"), "heldout_file": str(heldout_file),
  }
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "quickstart.json").write_text(json.dumps(result, indent=2))
  return result


def _table(results: list[dict[str, Any]]) -> None:
  from rich.console import Console
  from rich.table import Table
  console = Console()
  if not console.is_terminal:
    console = Console(width=120)  # logs: do not squeeze the table into 80 columns
  table = Table(title=f"held-out accuracy, {RL['eval']['prompts']} problems never trained on",
                caption=f"greedy / pass@1 (T=1, mean of {SAMPLES} samples): exact match of the 'Answer: v' line, "
                        "the reward's rule; any format: greedy, the right number after 'Answer:' or "
                        "'The answer is' (the arithmetic alone)")
  for col in ("seed", "SFT greedy", "GRPO greedy", "gain", "SFT pass@1", "GRPO pass@1", "SFT any fmt",
              "GRPO any fmt", "SFT s", "GRPO s"):
    table.add_column(col, justify="right")
  rows = list(results)
  if len(results) > 1:
    rows.append({k: (sum(r[k] for r in results) / len(results)) if k != "seed" else "mean"
                 for k in ("seed", "sft_accuracy", "rl_accuracy", "sft_sampled", "rl_sampled", "sft_any_format",
                           "rl_any_format", "seconds_sft", "seconds_rl")})
  for r in rows:
    table.add_row(str(r["seed"]), f"{r['sft_accuracy']:.1%}", f"{r['rl_accuracy']:.1%}",
                  f"{r['rl_accuracy'] - r['sft_accuracy']:+.1%}", f"{r['sft_sampled']:.1%}", f"{r['rl_sampled']:.1%}",
                  f"{r['sft_any_format']:.1%}", f"{r['rl_any_format']:.1%}",
                  f"{r['seconds_sft']:.0f}", f"{r['seconds_rl']:.0f}")
  console.print(table)


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
