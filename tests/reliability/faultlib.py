"""The fault-injection driver shared by ``tests/reliability`` and ``scripts/fault_injection.py``.

A *chain* is one training run (tiny SFT or RL config, 8 fake CPU devices, a checkpoint every step)
launched again and again: each launch is killed at the next fault point (``fault_worker.py``), the next
launch resumes with ``checkpoint.resume=auto``, and the last launch finishes. The chain's metric curve
(``metrics.jsonl``: a re-run step's last record wins) and exported weights are compared exactly with an
uninterrupted run; after every launch each committed checkpoint must pass its integrity check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fault_worker.py")
TIMEOUT = 1200  # seconds for one launch (compilation on a loaded 2-core machine dominates)

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def sft_config(steps: int) -> dict:
  """12 records per epoch, 16 rows of 64 tokens per batch: every step crosses into a new epoch."""
  return {
      "model": TINY,
      "data": {"builtin": {"n_train": 12, "n_heldout": 4, "difficulty": 2, "seed": 0}},
      "packing": {"seq_len": 64, "global_rows": 16, "buffer_size": 4},
      "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine"},
      "micro_batches": 2,
      "steps": steps,
      "eval": {"every": 0, "exact_match": 0},
      "checkpoint": {"every": 1, "keep": 2},
      "export_hf": True,
      "tensorboard": False,
  }


def rl_config(steps: int, prompts: int = 8) -> dict:
  """``prompts`` prompts, 4 per step: with 8, the prompt stream starts a new epoch every second step."""
  return {
      "model": TINY,
      "data": {"builtin": {"n_train": prompts, "n_heldout": 8, "difficulty": 2}, "max_prompt_tokens": 32},
      "rollout": {"prompts_per_step": 4, "n": 4, "max_new_tokens": 8},
      "reward": {"fn": "rl_testlib:digit_fraction"},
      "algorithm": {"mini_batches": 2},
      "micro_batch": {"token_budget": 384, "row_len": 48},
      "optim": {"lr": 1e-3},
      "steps": steps,
      "eval": {"every": 0},
      "checkpoint": {"every": 1, "keep": 2},
      "export_hf": True,
      "tensorboard": False,
  }


NOT_COMPARED = ("time_", "tok_s/", "tok/s", "mfu")
"""Metrics that legitimately differ between runs: wall time."""


@dataclasses.dataclass
class Launch:
  fault: str
  returncode: int | None
  seconds: float
  stderr: str


def env() -> dict:
  out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  out["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "rl"), str(ROOT), out.get("PYTHONPATH", "")])
  out["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "jaxrl-test-xla-cache")
  out["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
  return out


def launch(kind: str, config: dict, out_dir: Path, fault: str = "none", overrides=()) -> Launch:
  """Runs one ``fault_worker.py`` process to its end (or its fault)."""
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir.parent / f"{out_dir.name}.yaml"
  path.write_text(yaml.safe_dump(dict(config, out_dir=str(out_dir))))
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, str(WORKER), kind, fault, str(path), *overrides], env=env(), cwd=ROOT,
                     capture_output=True, text=True, timeout=TIMEOUT)
  return Launch(fault, p.returncode, time.perf_counter() - t0, p.stderr)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_processes(kind: str, config: dict, out_dir: Path, faults: list[str], *, heartbeat: float,
                     grace: float = 120) -> list[Launch]:
  """Runs one ``fault_worker.py`` per entry of ``faults`` as the processes of one ``jax.distributed`` run
  (a local coordinator, ``8 / len(faults)`` CPU devices each); process ``i`` gets fault ``faults[i]``.

  ``heartbeat`` is ``JAXRL_HEARTBEAT_TIMEOUT``: a process whose peer died must end by itself (the
  watchdog of ``jaxrl.sharding.initialize``); one still running ``grace`` seconds after the first
  process ended is killed and reported with return code ``None`` (a hang)."""
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir.parent / f"{out_dir.name}.yaml"
  path.write_text(yaml.safe_dump(dict(config, out_dir=str(out_dir))))
  port, n = _free_port(), len(faults)
  t0 = time.perf_counter()
  procs = [subprocess.Popen([sys.executable, str(WORKER), kind, fault, str(path)], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(env(), JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES=str(n),
                                     JAXRL_PROCESS_ID=str(i), JAXRL_HEARTBEAT_TIMEOUT=str(heartbeat)))
           for i, fault in enumerate(faults)]
  errs: list[list[str]] = [[] for _ in procs]
  readers = [threading.Thread(target=lambda p=p, e=e: e.extend(p.stderr), daemon=True) for p, e in zip(procs, errs)]
  for r in readers:
    r.start()
  ended: dict[int, float] = {}  # process -> seconds from the start to its exit
  try:
    while len(ended) < n and time.perf_counter() - t0 < min([TIMEOUT, *(t + grace for t in ended.values())]):
      for i, p in enumerate(procs):
        if i not in ended and p.poll() is not None:
          ended[i] = time.perf_counter() - t0
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for r in readers:
      r.join(timeout=10)
  return [Launch(fault, p.returncode if i in ended else None, ended.get(i, time.perf_counter() - t0), "".join(e))
          for i, (fault, p, e) in enumerate(zip(faults, procs, errs))]


def curve(out_dir: Path) -> dict[int, dict[str, float]]:
  """Per step, the last logged metrics (a step re-run after a resume replaces the killed run's)."""
  out: dict[int, dict[str, float]] = {}
  for line in (out_dir / "metrics.jsonl").read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:  # a line cut by SIGKILL
      continue
    step = row.pop("step")
    if step == 0:
      continue
    out[step] = {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}
  return out


def weights(out_dir: Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  return {k: v for f in sorted((out_dir / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def checkpoint_problems(out_dir: Path) -> list[str]:
  """Every committed checkpoint's integrity-check failures (none expected after any crash)."""
  from jaxrl.train._checkpoint import verify_manifest
  ckpt = out_dir / "checkpoints"
  if not ckpt.is_dir():
    return []
  problems = []
  for d in sorted(ckpt.iterdir()):
    if d.name.isdigit():
      if not (d / "_CHECKPOINT_METADATA").exists():
        problems.append(f"{d}: committed without Orbax metadata")
      problem = verify_manifest(d, int(d.name))
      if problem:
        problems.append(problem)
  return problems


def compare(want_dir: Path, got_dir: Path) -> list[str]:
  """Differences between two finished runs: every step's metrics (exact) and the exported weights."""
  diffs = []
  want, got = curve(want_dir), curve(got_dir)
  if sorted(want) != sorted(got):
    diffs.append(f"steps {sorted(got)} != {sorted(want)}")
  for step in sorted(set(want) & set(got)):
    for k in sorted(set(want[step]) | set(got[step])):
      if want[step].get(k) != got[step].get(k):
        diffs.append(f"step {step} {k}: {got[step].get(k)!r} != {want[step].get(k)!r}")
  w, g = weights(want_dir), weights(got_dir)
  if w.keys() != g.keys():
    diffs.append("exported tensors differ in names")
  diffs += [f"weights {k} differ" for k in sorted(set(w) & set(g)) if not np.array_equal(w[k], g[k])]
  return diffs


def run_chain(kind: str, config: dict, out_dir: Path, faults: list[str], *, log=print) -> list[Launch]:
  """Launches the run once per fault, then once more to finish; returns the launches. Raises
  ``AssertionError`` when a fault was not reached, a launch failed unexpectedly, or a committed
  checkpoint fails its integrity check."""
  launches = []
  for fault in [*faults, "none"]:
    got = launch(kind, config, out_dir, fault)
    launches.append(got)
    phase = fault.split(":")[0]
    want = {"none": 0, "sigterm": 143, "enospc": None}.get(phase, -9)
    log(f"{kind} {fault}: exit {got.returncode} in {got.seconds:.0f} s")
    if want is None:
      assert got.returncode not in (0, -9), f"{fault}: a failed save must stop the run:\n{got.stderr[-3000:]}"
      assert "No space left on device" in got.stderr, got.stderr[-3000:]
    else:
      assert got.returncode == want, f"{fault}: exit {got.returncode}, expected {want}:\n{got.stderr[-3000:]}"
    problems = checkpoint_problems(out_dir)
    assert not problems, f"after {fault}: {problems}"
    assert "skipping unusable checkpoint" not in got.stderr, got.stderr[-3000:]
  return launches
