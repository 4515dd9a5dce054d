"""``jaxrl bench rl-async``: wall-clock per RL step, synchronous vs AReaL-style asynchronous vs DeepCoder
one-off pipelining, in the same run (docs/async.md, docs/benchmarks.md).

The workload: the tiny GRPO recipe's model shape (random init) on the built-in arithmetic prompts,
``--prompts`` × ``--n`` samples per step, temperature 1 and up to ``--max-new`` tokens (a random model
ends a row at a random point, so lengths spread from 1 to the budget, many rows at the budget), and
a slow reward: every sample sleeps ``--reward-delay`` seconds (a simulated code test) in a pool of
``--reward-workers`` threads. The synchronous trainer runs on all devices; the asynchronous modes on
``--rollout-devices`` rollout + the rest trainer devices. Reported per mode: the median step time
and mean step time over the steps after ``--warmup`` (compilation is in the first steps; the engine
also compiles a recompute program for each new (rows, length) bucket of interrupted rows, so early
asynchronous steps can still hold a compilation), the speed-ups over sync, and
for the asynchronous modes the mean staleness, busy fractions and weight-transfer time.

Prints a table and writes JSON. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from jaxrl import config as config_lib
from jaxrl.rl import AsyncRLTrainer, RLConfig, RLTrainer

MODES = ("sync", "areal", "one_off")


def slow_reward(prompt: str, completion: str, *, delay: float = 0.3, **_: Any) -> float:
  """Sleeps ``delay`` seconds (a code test in a sandbox), then the share of digits in the completion."""
  del prompt
  time.sleep(delay)
  return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def _config(mode: str, ns, out: Path):
  over = [
      f"steps={ns.steps}", "eval.every=0", "tensorboard=false", f"out_dir={out / mode}",
      f"rollout.prompts_per_step={ns.prompts}", f"rollout.n={ns.n}", f"rollout.max_new_tokens={ns.max_new}",
      f"rollout.engine.num_slots={ns.slots}", "data.builtin.n_train=512", "algorithm.kl_coef=0.0",
      "reward.fn=jaxrl.bench.rl_async:slow_reward", f"reward.kwargs={{delay: {ns.reward_delay}}}",
      f"reward.runner={{workers: {ns.reward_workers}}}", f"micro_batch.row_len={32 + ns.max_new}",
      f"micro_batch.token_budget={8 * (32 + ns.max_new)}",
  ]
  if mode == "sync":
    over.append("asynchronous=null")
  else:
    eta = 1 if mode == "one_off" else ns.eta
    over.append(f"asynchronous={{mode: {mode}, max_staleness: {eta}, rollout_devices: {ns.rollout_devices}}}")
  return config_lib.load(RLConfig, ns.config, over)


def run_mode(mode: str, ns, out: Path) -> dict[str, Any]:
  cfg = _config(mode, ns, out)
  trainer = RLTrainer(cfg) if mode == "sync" else AsyncRLTrainer(cfg)
  t0 = time.perf_counter()
  try:
    trainer.run()
  finally:
    trainer.close()
  total = time.perf_counter() - t0
  steps = [h["time_step"] for h in trainer.history][ns.warmup:]
  row: dict[str, Any] = {"mode": mode, "step_s_median": statistics.median(steps),
                         "step_s_mean": statistics.mean(steps), "step_s": steps,
                         "total_s": total, "tokens_per_step": statistics.mean(
                             h["response/length_mean"] * ns.prompts * ns.n for h in trainer.history)}
  if mode != "sync":
    h = trainer.history[ns.warmup:]
    for key in ("async/staleness_mean", "async/rollout_busy", "async/trainer_busy", "async/time_weight_transfer",
                "async/time_weight_apply", "async/versions_per_traj_mean"):
      row[key] = statistics.mean(x[key] for x in h)
  else:
    h = trainer.history[ns.warmup:]
    for key in ("time_generate", "time_reward", "time_train"):
      row[key] = statistics.mean(x[key] for x in h)
  return row


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench rl-async", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/areal_async_tiny.yaml")
  p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation)")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--n", type=int, default=4)
  p.add_argument("--max-new", type=int, default=64)
  p.add_argument("--slots", type=int, default=48)
  p.add_argument("--eta", type=int, default=2, help="max_staleness of the areal mode")
  p.add_argument("--rollout-devices", type=int, default=6)
  p.add_argument("--reward-delay", type=float, default=0.3)
  p.add_argument("--reward-workers", type=int, default=8)
  p.add_argument("--json", default="runs/bench_rl_async.json")
  ns = p.parse_args(argv)
  modes = [m for m in ns.modes.split(",") if m]
  bad = [m for m in modes if m not in MODES]
  if bad or ns.warmup >= ns.steps:
    p.error(f"--modes: unknown {bad}; known {MODES}" if bad else "--warmup must be < --steps")
  import jax
  out = Path(ns.json).parent / "bench_rl_async"
  results: dict[str, Any] = {
      "date": datetime.date.today().isoformat(),
      "machine": f"{platform.machine()} {jax.device_count()} {jax.devices()[0].device_kind} devices, "
                 f"jax {jax.__version__}",
      "args": vars(ns), "modes": []}
  for mode in modes:
    row = run_mode(mode, ns, out)
    results["modes"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
  base = next((r["step_s_median"] for r in results["modes"] if r["mode"] == "sync"), None)
  base_mean = next((r["step_s_mean"] for r in results["modes"] if r["mode"] == "sync"), None)
  print(f"\n{'mode':<8} {'step s (median)':>16} {'speed-up':>9} {'step s (mean)':>14} {'speed-up':>9} "
        f"{'staleness':>10} {'rollout busy':>13} {'trainer busy':>13} {'transfer ms':>12}")
  for r in results["modes"]:
    r["speedup_vs_sync"] = base / r["step_s_median"] if base else None
    r["speedup_vs_sync_mean"] = base_mean / r["step_s_mean"] if base_mean else None
    print(f"{r['mode']:<8} {r['step_s_median']:>16.2f} {r['speedup_vs_sync'] or 0:>8.2f}x "
          f"{r['step_s_mean']:>14.2f} {r['speedup_vs_sync_mean'] or 0:>8.2f}x "
          f"{r.get('async/staleness_mean', 0):>10.2f} {r.get('async/rollout_busy', 0):>13.2f} "
          f"{r.get('async/trainer_busy', 0):>13.2f} {1e3 * r.get('async/time_weight_transfer', 0):>12.1f}")
  Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
  Path(ns.json).write_text(json.dumps(results, indent=2))
  print(f"wrote {ns.json}")
  return 0
