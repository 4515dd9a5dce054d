"""Launching the multi-process tests' workers: the environment they start in, a free coordinator port,
waiting for every process's JSON result, and comparing two runs' logged metrics. Imports no JAX (workers call
:func:`configure_process` first)."""

import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env(**extra) -> dict:
  """The parent's environment minus its device flags, with the test helpers importable and the suite's
  persistent compilation cache shared."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "rl"), str(ROOT), env.get("PYTHONPATH", "")])
  env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "jaxrl-test-xla-cache")
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
  env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)  # a cap: JAX locks the shared directory (tests/conftest.py)
  env.update(extra)
  return env


def wait_json(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
  """Every process's last stdout line, as JSON; a process that fails fails the test with its stderr's end."""
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, f"process failed (exit {p.returncode}):\n{err[-4000:]}"
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      p.kill()
  return outs


def step_metrics(out_dir) -> dict[int, dict[str, float]]:
  """A run's ``metrics.jsonl`` merged per step (train and eval rows of one step are separate lines)."""
  merged: dict[int, dict[str, float]] = {}
  for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    merged.setdefault(row.pop("step"), {}).update(row)
  return merged


def assert_same_metrics(got_dir, want_dir, *, skip: tuple[str, ...]) -> dict[int, dict[str, float]]:
  """Both runs log the same steps and keys, and equal values (rtol 1e-4), the keys starting with a ``skip``
  prefix (timings, throughput, packing) aside; returns ``want_dir``'s metrics."""
  got, want = step_metrics(got_dir), step_metrics(want_dir)
  assert got.keys() == want.keys(), (got.keys(), want.keys())
  for step in want:
    keys = sorted(k for k in want[step] if not k.startswith(skip))
    assert keys == sorted(k for k in got[step] if not k.startswith(skip)), step
    for k in keys:
      np.testing.assert_allclose(got[step][k], want[step][k], rtol=1e-4, atol=1e-6, err_msg=f"step {step}: {k}")
  return want


def configure_process(num_processes: int, process_id: int, local_devices: int, port: int) -> None:
  """In a worker, before JAX is imported: this many fake CPU devices, compiled for compile speed rather
  than run speed (both sides of every comparison are compiled alike), and the coordinator's address."""
  os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={local_devices} "
                             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
  os.environ["JAX_PLATFORMS"] = "cpu"
  if num_processes > 1:
    os.environ.update(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES=str(num_processes),
                      JAXRL_PROCESS_ID=str(process_id))
