"""``jaxrl rl`` and ``jaxrl sft`` on two local processes × 4 CPU devices equal one process × 8 devices.

Each test starts the processes itself (free port, a timeout on every subprocess). Covered: parameters
and logged metrics after 3 steps, checkpoints written by 2 processes resumed by 1 and the other way
round, prompt accounting across processes, and a killed process stopping the survivor with a message
that names it. Fresh compilations dominate the runtime; they go to JAX's persistent cache.
"""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from multihost_testlib import ROOT, assert_same_metrics, free_port, wait_json, worker_env
from safetensors.numpy import load_file

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("trainer_worker.py")
TIMEOUT = 1200  # seconds for any one run (compilation on a loaded 2-core machine dominates)
HEARTBEAT = 5  # JAXRL_HEARTBEAT_TIMEOUT of the kill test, in seconds

RL = ["steps=3", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
      "data.builtin.n_train=8", "data.builtin.n_heldout=8", "micro_batch.token_budget=384", "micro_batch.row_len=48",
      "reward.fn=rl_testlib:monitored_digit_fraction", "eval.every=3", "eval.prompts=5", "export_hf=true",
      "tensorboard=false", "checkpoint.every=1"]
"""configs/grpo_tiny.yaml shortened: 8 prompts (the prompt stream starts its second epoch at step 3), a dense
reward (a random policy gets non-zero advantages) with monitors (``reward/monitor/*`` and ``eval/monitor/*``: means
over every process's samples), 5 held-out prompts (an uneven split over 2 processes), and
rollouts on the recipe's continuous-batching engine (jaxrl.sampling.Engine, run by every process over all
processes' prompts)."""
SFT = ["steps=3", "data.builtin.n_train=64", "data.builtin.n_heldout=8", "packing.seq_len=64", "packing.global_rows=8",
       "packing.buffer_size=16", "eval.every=3", "eval.batches=1", "eval.exact_match=3", "eval.max_new_tokens=4",
       "checkpoint.every=1", "export_hf=true", "tensorboard=false"]
NOT_COMPARED = ("time_", "tok_s/", "tok/s", "mfu", "train/micro_batches", "train/pack_efficiency", "padding")
"""Metrics that legitimately differ: wall time, and the packing layout (each process packs its own rows)."""


def _start(kind, processes, out_dir, overrides, *, until=0, **env):
  port, local = free_port(), 8 // processes
  config = str(ROOT / "configs" / f"{'grpo' if kind == 'rl' else 'sft'}_tiny.yaml")
  return [subprocess.Popen([sys.executable, str(WORKER), kind, str(processes), str(i), str(local), str(port),
                            str(until), config, *overrides, f"out_dir={out_dir}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(**env), cwd=ROOT)
          for i in range(processes)]


def _run(kind, processes, out_dir, overrides=(), *, until=0) -> list[dict]:
  procs = _start(kind, processes, out_dir, [*(RL if kind == "rl" else SFT), *overrides], until=until)
  return wait_json(procs, TIMEOUT)


def _weights(out_dir) -> dict[str, np.ndarray]:
  files = sorted((Path(out_dir) / "hf").glob("*.safetensors"))
  assert files, f"no exported weights in {out_dir}/hf"
  return {k: v for f in files for k, v in load_file(str(f)).items()}


def _assert_same_weights(got_dir, want_dir):
  got, want = _weights(got_dir), _weights(want_dir)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_rl_two_processes_train_like_one_and_checkpoints_move_between_process_counts(tmp_path):
  """One test, so that its four launches share runs whatever worker pytest-xdist sends a test to: the
  2-process run's step-1 checkpoint is the one the resume chain starts from."""
  single_dir, pair_dir, chain_dir = tmp_path / "single", tmp_path / "pair", tmp_path / "chain"
  (single,) = _run("rl", 1, single_dir)
  pair = _run("rl", 2, pair_dir, ["checkpoint.keep_every=1"])  # keeps step 1's checkpoint
  assert all(r["processes"] == 2 and r["devices"] == 8 for r in pair)
  _assert_same_weights(pair_dir, single_dir)
  assert_same_metrics(pair_dir, single_dir, skip=NOT_COMPARED)
  # Every prompt of every round is generated exactly once, by exactly one process: the same prompts as
  # one process draws, split into equal contiguous shares; the engine, scheduling every process's rows on
  # every process, gives each process the tokens and log-probs one process gets for those rows.
  for k, want in enumerate(single["rounds"]):
    shares = [r["rounds"][k] for r in pair]
    assert [len(s) for s in shares] == [len(want) // 2] * 2
    assert shares[0] + shares[1] == want, (k, shares, want)
    want_out = single["rollouts"][k]
    got_out = [r["rollouts"][k] for r in pair]
    assert got_out[0]["tokens"] + got_out[1]["tokens"] == want_out["tokens"], k
    np.testing.assert_allclose(got_out[0]["logprobs"] + got_out[1]["logprobs"], want_out["logprobs"], rtol=0,
                               atol=1e-6, err_msg=f"round {k}")

  # Checkpoints move between process counts: step 1 as 2 processes wrote it, resumed by 1 process, whose
  # step 2 (the prompt stream's epoch boundary) 2 processes resume and finish, like the single run.
  shutil.copytree(pair_dir / "checkpoints" / "1", chain_dir / "checkpoints" / "1")
  _run("rl", 1, chain_dir, until=2)
  assert sorted(p.name for p in (chain_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
  _run("rl", 2, chain_dir)
  _assert_same_weights(chain_dir, single_dir)


def test_sft_two_processes_train_like_one(tmp_path):
  _run("sft", 1, tmp_path / "single")
  pair = _run("sft", 2, tmp_path / "pair")
  assert all(r["processes"] == 2 for r in pair)
  _assert_same_weights(tmp_path / "pair", tmp_path / "single")
  assert_same_metrics(tmp_path / "pair", tmp_path / "single", skip=NOT_COMPARED)


def test_killing_one_process_stops_the_other_naming_it(tmp_path):
  procs = _start("rl", 2, tmp_path, [*RL, "steps=50", "eval.every=0"], JAXRL_HEARTBEAT_TIMEOUT=str(HEARTBEAT))
  try:
    marker = tmp_path / "processes" / "1" / "metrics.jsonl"  # process 1 has finished a step
    deadline = time.monotonic() + TIMEOUT
    while not (marker.exists() and marker.read_text().strip()):
      assert time.monotonic() < deadline and procs[1].poll() is None, procs[1].communicate()[1][-3000:]
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    # The survivor must exit within a few heartbeat timeouts, not hang in a collective.
    _, err = procs[0].communicate(timeout=6 * HEARTBEAT)
    assert procs[0].returncode not in (0, None)
    assert "lost process 1" in err, err[-3000:]
  finally:
    for p in procs:
      p.kill()
      p.communicate()
