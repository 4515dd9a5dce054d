"""Two local processes × 4 CPU devices compute what one process × 8 devices computes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes: int, local_devices: int) -> list[dict]:
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(num_processes), str(i), str(local_devices), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(num_processes)]
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=300)
    finally:
      p.kill()
    assert p.returncode == 0, f"worker failed:\n{err[-3000:]}"
    outs.append(json.loads(out.strip().splitlines()[-1]))
  return outs


def test_two_processes_match_one_process():
  (single,) = _run(1, 8)
  pair = _run(2, 4)
  assert single["devices"] == 8 and all(r["devices"] == 8 and r["processes"] == 2 for r in pair)
  for r in pair:
    np.testing.assert_allclose(r["loss"], single["loss"], rtol=1e-6)
    np.testing.assert_allclose(r["grad_norm"], single["grad_norm"], rtol=1e-5)
