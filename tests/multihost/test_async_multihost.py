"""Asynchronous RL (``AsyncRLTrainer``) on two local processes × 4 CPU devices.

Each process rolls out on an engine over its own first 3 devices (a process-local sub-mesh: no rollout
decision needs the other process) and generates its contiguous share of every batch; the trainer mesh spans
both processes' last device. Checked: η = 0 trains like one process × 8 devices (the same samples, token for
token, with PTST's stages and the reward monitors of both processes' samples; parameters within float32
rounding, see below), and η = 1 keeps every trained token within the bound
and trains every prompt group exactly once, from the trainer's own per-sample records gathered over the
processes. Both launches of the first test run at once (the machine's cores are shared either way).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multihost_testlib import ROOT, free_port, wait_json, worker_env

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("async_worker.py")
TIMEOUT = 1200  # seconds for any one run (compilation on a loaded 2-core machine dominates)
B, N = 4, 4  # rollout.prompts_per_step, rollout.n
BASE = {"rollout.engine": {"num_slots": 12, "kv_cache_bytes": 1 << 20, "block_size": 8, "steps_per_call": 4},
        "algorithm.objective": "decoupled_ppo", "rollout.prompts_per_step": B, "rollout.n": N}
"""tests/rl/test_async_trainer.py's runs: rl_testlib's tiny model, 6 rollout devices (3 per process) + 2 trainer
devices, 12 engine slots (6 per process's engine), decoupled PPO, 2 mini-batches."""
RECORDS = ("step", "group", "sample", "request_id", "tokens_crc", "length", "version_min", "version_max")


def _start(processes: int, out_dir: Path, overrides: dict) -> list[subprocess.Popen]:
  over = json.dumps({**BASE, **overrides, "out_dir": str(out_dir)})
  port = free_port()
  return [subprocess.Popen([sys.executable, str(WORKER), str(processes), str(i), str(8 // processes), str(port), over],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(), cwd=ROOT)
          for i in range(processes)]


def _wait(procs: list[subprocess.Popen]) -> list[dict]:
  return wait_json(procs, TIMEOUT)


def _params(out_dir: Path, process: int) -> list[np.ndarray]:
  got = np.load(out_dir / f"params_{process}.npz")
  return [got[f"arr_{k}"] for k in range(len(got.files))]


def test_two_processes_at_eta0_train_the_same_samples_as_one(tmp_path):
  """With PTST (8 tokens x 4 samples, then 16 x 2 from step 2) and a reward that reports monitors."""
  over = {"steps": 2, "asynchronous": {"rollout_devices": 6, "max_staleness": 0}, "rollout.max_new_tokens": 8,
          "rollout.context_schedule": [{"start_step": 2, "max_new_tokens": 16, "n": N // 2}],
          "reward.fn": "rl_testlib:monitored_digit_fraction"}
  running = _start(1, tmp_path / "single", over), _start(2, tmp_path / "pair", over)
  (single,), pair = (_wait(p) for p in running)
  # Each process's engine is on its own 3 devices; the trainer mesh spans both processes.
  assert [len(r["rollout_devices"]) for r in pair] == [3, 3]
  assert not set(pair[0]["rollout_devices"]) & set(pair[1]["rollout_devices"])
  assert pair[0]["trainer_devices"] == pair[1]["trainer_devices"] and len(pair[0]["trainer_devices"]) == 2
  # The trainer's records (gathered over the processes) are the same on both, and they are one process's:
  # the same groups, prompts' request ids, samples, tokens (CRC), lengths and versions (all 0 ... η = 0).
  for k in RECORDS:
    assert pair[0]["trained"][k] == pair[1]["trained"][k] == single["trained"][k], k
  assert len(single["trained"]["group"]) == B * N + B * N // 2  # each step's stage's n
  assert max(single["trained"]["length"][:B * N]) <= 8 < max(single["trained"]["length"][B * N:]) <= 16
  assert [h["reward/mean"] for h in pair[0]["history"]] == [h["reward/mean"] for h in single["history"]]
  for hp, hs in zip(pair[0]["history"], single["history"], strict=True):  # means over both processes' samples
    monitors = {k: v for k, v in hs.items() if "/monitor/" in k}
    assert "reward/monitor/chars" in monitors
    assert {k: v for k, v in hp.items() if "/monitor/" in k} == pytest.approx(monitors, rel=1e-6)
  # Parameters: the same on both processes; against one process equal up to float32 rounding, not bit for
  # bit: each process packs its own groups into its half of each micro-batch's rows (rows / processes, as
  # the synchronous multi-process trainer does), so the loss's sums over rows run in another order. Adam
  # divides each gradient by its own running RMS, so a rounding difference in a near-zero gradient moves
  # a weight by a visible fraction of one step (lr = 1e-3): 4.3e-6 on one of 4096 entries on one CPU
  # (codegen differs between CPUs). atol 1e-5 is 1 % of a step; a wrong sample or row moves many entries
  # by ~lr.
  want, got, other = _params(tmp_path / "single", 0), _params(tmp_path / "pair", 0), _params(tmp_path / "pair", 1)
  assert len(want) == len(got) == len(other)
  for a, b, c in zip(want, got, other):
    np.testing.assert_array_equal(b, c)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_two_processes_at_eta1_stay_within_the_bound_and_train_every_group_once(tmp_path):
  steps, eta = 3, 1
  pair = _wait(_start(2, tmp_path, {"steps": steps, "asynchronous": {"rollout_devices": 6, "max_staleness": eta}}))
  assert pair[0]["trained"] == pair[1]["trained"]
  t = {k: np.asarray(v) for k, v in pair[0]["trained"].items()}
  # Every group of every batch trained exactly once, all n samples, in order: batch s is groups (s-1)B … sB-1,
  # half generated by each process; the first epoch's request ids are the group labels.
  assert sorted(zip(t["group"], t["sample"])) == [(g, s) for g in range(steps * B) for s in range(N)]
  np.testing.assert_array_equal(t["step"], t["group"] // B + 1)
  np.testing.assert_array_equal(t["request_id"], t["group"])
  # Every trained token's version is within η of the batch's training version (step - 1), and no token
  # comes from a version the trainer had not yet produced.
  assert (t["version_min"] >= t["step"] - 1 - eta).all() and (t["version_max"] <= t["step"] - 1).all()
  assert (t["version_min"] < t["step"] - 1).any()  # off-policy batches happened (batch 1 began under version 0)
  for h in pair[0]["history"]:
    assert h["async/staleness_max"] <= eta
