"""Launching a judge server: `jaxrl serve` of a local model directory in a subprocess, up and listening.

`JudgeLaunch` is the config (``judge.launch``); `ServeProcess` starts the server on a free loopback port,
reads the URL from its start-up line, and stops it. Process-global state: each started server registers
its `ServeProcess.stop` with `atexit`, so no server outlives the interpreter even if nobody calls
`jaxrl.rewards.close_judges`.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time

from jaxrl.rewards._judge_parse import JudgeError

__all__ = ["JudgeLaunch", "ServeProcess"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeLaunch:
  """`jaxrl serve` of a local model directory, started by the run itself in a subprocess.

  The server listens on a free loopback port (``--port 0``; the port is read from its start-up line),
  the judge waits for it up to ``startup_timeout_s``, and it is terminated by `close_judges` (which
  ``RLTrainer.close`` calls) or at interpreter exit.
  """

  model: str
  "Local HF model directory to serve (config.json + safetensors)."
  tokenizer: str | None = None
  "Tokenizer directory; default ``model``."
  max_len: int = 2048
  "Most tokens per row (prompt + completion)."
  max_batch_rows: int = 64
  batch_wait_ms: float = 10.0
  max_top_logprobs: int = 20
  "``--max-top-logprobs``: the vocabulary size lets a judge read every score token."
  dtype: str | None = None
  "Compute dtype of the server (float32 or bfloat16); default the checkpoint's."
  platform: str | None = None
  "``JAX_PLATFORMS`` of the server process (e.g. ``cpu`` to keep the accelerator for training); default inherited."
  startup_timeout_s: float = 300.0
  "How long to wait for the server to listen before failing."

  def __post_init__(self):
    if not isinstance(self.model, str) or not os.path.isdir(self.model):
      raise ValueError(f"judge.launch.model: {self.model!r} is not a directory")
    if self.dtype not in (None, "float32", "bfloat16"):
      raise ValueError(f"judge.launch.dtype: {self.dtype!r} is not float32, bfloat16 or null")
    for key in ("max_len", "max_batch_rows", "max_top_logprobs"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        raise ValueError(f"judge.launch.{key}: must be a positive int, got {getattr(self, key)!r}")
    if not self.startup_timeout_s > 0 or self.batch_wait_ms < 0:
      raise ValueError("judge.launch: startup_timeout_s must be > 0 and batch_wait_ms >= 0")


class ServeProcess:
  """``python -m jaxrl.cli.serve --model DIR --port 0 ...`` in a subprocess, up and listening."""

  def __init__(self, launch: JudgeLaunch, *, served_name: str):
    cmd = [sys.executable, "-m", "jaxrl.cli.serve", "--model", launch.model, "--port", "0",
           "--served-model-name", served_name, "--max-len", str(launch.max_len),
           "--max-batch-rows", str(launch.max_batch_rows), "--batch-wait-ms", str(launch.batch_wait_ms),
           "--max-top-logprobs", str(launch.max_top_logprobs)]
    if launch.tokenizer:
      cmd += ["--tokenizer", launch.tokenizer]
    if launch.dtype:
      cmd += ["--dtype", launch.dtype]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if launch.platform:
      env["JAX_PLATFORMS"] = launch.platform
    self.model = launch.model
    self.lines: list[str] = []  # the server's output (the last 50 lines), for error messages
    self._ready, self._done = threading.Event(), threading.Event()  # URL seen / output closed
    self.url: str | None = None
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, env=env)
    threading.Thread(target=self._drain, name="jaxrl-judge-serve-log", daemon=True).start()
    atexit.register(self.stop)
    deadline = time.monotonic() + launch.startup_timeout_s
    while not (self._ready.wait(0.05) and self.url is not None):
      if self.proc.poll() is not None:
        self._done.wait(5.0)  # let the reader catch the last lines
        raise JudgeError("launch", f"judge.launch.model: `jaxrl serve` of {launch.model} exited with status "
                         f"{self.proc.returncode}: {self._tail()}")
      if time.monotonic() > deadline:
        self.stop()
        raise JudgeError("launch", f"judge.launch.startup_timeout_s: `jaxrl serve` of {launch.model} was not "
                         f"listening after {launch.startup_timeout_s} s: {self._tail()}")

  def _drain(self) -> None:
    # Reads the server's output for good (a full pipe would block the server) and spots the URL line.
    for line in self.proc.stdout:
      self.lines = (self.lines + [line.rstrip()])[-50:]
      m = re.search(r" at (http://\S+/v1)", line)
      if m and self.url is None:
        self.url = m.group(1)
        self._ready.set()
    self._done.set()

  def _tail(self) -> str:
    return " | ".join(self.lines[-5:]) or "(no output)"

  def stop(self) -> None:
    """Terminates the server (SIGTERM, then SIGKILL after 10 s)."""
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except Exception:  # noqa: BLE001 (subprocess.TimeoutExpired)
        self.proc.kill()
        self.proc.wait()

