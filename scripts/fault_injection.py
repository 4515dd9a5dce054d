"""The full fault-injection run of docs/reliability.md: seeded random kill points over a tiny SFT run, a
tiny RL run and a tiny asynchronous RL run (``max_staleness: 0``), each resumed and compared exactly with an
uninterrupted run.

    .venv/bin/python scripts/fault_injection.py --sft 20 --rl 10 --async 7 --seed 0 --out runs/fault_injection

Kill points are drawn at increasing steps (so every one is reached) with a phase each
(tests/reliability/fault_worker.py lists them; ``in_reward`` is RL's only); every phase appears at least
once when there are enough points (7 for SFT and asynchronous RL, 8 for RL). Prints one line per launch and a summary, and
writes ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
import faultlib  # noqa: E402

KILL_PHASES = ("in_step", "before_save", "after_save", "in_commit", "in_manifest")
RL_KILL_PHASES = ("in_reward",)
"""SIGKILL phases of the RL run only (while the step's rewards are being scored)."""
OTHER_PHASES = ("sigterm", "enospc")


LEAPS = {"after_save": 2, "in_manifest": 2, "sigterm": 2}
"""Steps to the next fault: after these the resumed run may start past the fault's step (the checkpoint
may have committed), so the next fault is drawn one step further to be sure it is reached."""


def draw_faults(n: int, rng: np.random.Generator, kind: str = "sft") -> tuple[list[str], int]:
  """``n`` faults at increasing steps from 2 and the run length; every phase of ``kind`` once (when n
  allows), the rest SIGKILL phases drawn at random."""
  kill = KILL_PHASES + (RL_KILL_PHASES if kind == "rl" else ())
  phases = list(kill + OTHER_PHASES)[:n]
  phases += [str(p) for p in rng.choice(kill, size=n - len(phases))]
  rng.shuffle(phases)
  faults, step = [], 2
  for p in phases:
    faults.append(f"{p}:{step}")
    step += LEAPS.get(p, 1)
  return faults, step + 1


CONFIGS = {"sft": faultlib.sft_config, "rl": faultlib.rl_config, "async": faultlib.async_config}


def run(kind: str, n: int, seed: int, out: Path) -> dict:
  faults, steps = draw_faults(n, np.random.default_rng([seed, ("sft", "rl", "async").index(kind)]), kind)
  config = CONFIGS[kind](steps)
  ref = faultlib.launch(kind, config, out / f"{kind}_reference")
  assert ref.returncode == 0, ref.stderr[-3000:]
  print(f"{kind} reference: {ref.seconds:.0f} s", flush=True)
  launches = faultlib.run_chain(kind, config, out / f"{kind}_chain", faults, log=lambda s: print(s, flush=True))
  diffs = faultlib.compare(out / f"{kind}_reference", out / f"{kind}_chain")
  print(f"{kind}: {len(faults)} faults, {len(launches)} launches, "
        f"{'identical to the uninterrupted run' if not diffs else diffs[:10]}", flush=True)
  return {"faults": faults, "launches": [[x.fault, x.returncode, round(x.seconds, 1)] for x in launches],
          "steps": steps, "identical": not diffs, "differences": diffs[:50]}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sft", type=int, default=20, help="kill points over the SFT run")
  p.add_argument("--rl", type=int, default=10, help="kill points over the RL run")
  p.add_argument("--async", dest="async_", type=int, default=7, help="kill points over the asynchronous RL run")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/fault_injection")
  ns = p.parse_args()
  out = Path(ns.out)
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  summary = {}
  for kind, n in (("sft", ns.sft), ("rl", ns.rl), ("async", ns.async_)):
    if n:
      summary[kind] = run(kind, n, ns.seed, out)
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  print(f"\n{'run':<6} {'faults':>6} {'launches':>8} {'exit statuses':<40} outcome")
  for kind, v in summary.items():
    codes = collections.Counter(str(code) for _, code, _ in v["launches"])
    print(f"{kind:<6} {len(v['faults']):>6} {len(v['launches']):>8} "
          f"{', '.join(f'{c}: {k}' for c, k in sorted(codes.items())):<40} "
          f"{'identical' if v['identical'] else 'DIFFERENT'}")
  return 0 if all(v["identical"] for v in summary.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
