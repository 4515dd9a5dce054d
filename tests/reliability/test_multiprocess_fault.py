"""SIGTERM to one process, then kill -9 of the other while it commits a checkpoint, in a two-process SFT
run (2 × 4 CPU devices, ``jax.distributed`` with a local coordinator), resumed on both processes from the
newest valid checkpoint: the metric curve and the exported weights equal an uninterrupted two-process run
exactly (CPU, float32), and no committed checkpoint ever fails its integrity check.

A process whose peer died does not hang in the next collective (docs/reliability.md): when process 0,
the coordinator, dies, JAX's distributed runtime aborts the others at once (SIGABRT, ``Terminating
process because the JAX distributed service detected fatal errors``), or the heartbeat watchdog of
``jaxrl.sharding.initialize`` sees it first (exit 1, ``jaxrl: lost process 0 (the coordinator)``); when
another process dies, the watchdog ends the rest within ``JAXRL_HEARTBEAT_TIMEOUT`` (3 s here, 60 s by
default) naming it (``tests/multihost/test_multihost_trainers.py``).
"""

import json

import faultlib
import pytest

pytestmark = pytest.mark.slow
HEARTBEAT = 3.0
RUNTIME_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


def _check(launches, want):
  got = [x.returncode for x in launches]
  assert got == want, "\n".join(f"process {i} ({x.fault}): exit {x.returncode}\n{x.stderr[-3000:]}"
                                for i, x in enumerate(launches))


def test_two_process_sft_preempted_then_coordinator_killed_in_a_commit_resumes_exactly(tmp_path):
  config = faultlib.sft_config(2)
  _check(faultlib.launch_processes("sft", config, tmp_path / "straight", ["none", "none"], heartbeat=HEARTBEAT), [0, 0])
  chain = tmp_path / "chain"

  # SIGTERM reaches process 1 alone after step 1: the stop flag is all-gathered, so both processes write
  # step 1's checkpoint and exit 143 after the same step.
  first = faultlib.launch_processes("sft", config, chain, ["none", "sigterm:1"], heartbeat=HEARTBEAT)
  _check(first, [143, 143])
  assert all("stopped by SIGTERM after step 1" in x.stderr for x in first), first[0].stderr[-3000:]
  assert faultlib.checkpoint_problems(chain) == []

  # kill -9 of process 0 (the coordinator, which commits checkpoints) once every file of step 2's
  # checkpoint is written, before the commit: process 1 does not outlive it.
  second = faultlib.launch_processes("sft", config, chain, ["in_commit:2", "none"], heartbeat=HEARTBEAT)
  assert second[0].returncode == -9, second[0].stderr[-3000:]
  survivor = second[1]
  assert ((survivor.returncode == -6 and RUNTIME_ABORT in survivor.stderr)
          or (survivor.returncode == 1 and "jaxrl: lost process 0 (the coordinator)" in survivor.stderr)), (
              f"exit {survivor.returncode}\n{survivor.stderr[-3000:]}")
  assert faultlib.checkpoint_problems(chain) == []

  # Both ignore the partial step 2, resume from step 1 and finish.
  last = faultlib.launch_processes("sft", config, chain, ["none", "none"], heartbeat=HEARTBEAT)
  _check(last, [0, 0])
  assert "partial checkpoint of step 2" in last[0].stderr, last[0].stderr[-3000:]
  assert faultlib.checkpoint_problems(chain) == []
  assert not any("skipping unusable checkpoint" in x.stderr for x in last), last[0].stderr[-3000:]
  assert faultlib.compare(tmp_path / "straight", chain) == []

  # Each process's data-iterator state and data files are saved (process 1 reads its own copy of the
  # built-in data); the states agree, since every process reads the same global stream.
  host = json.loads((chain / "checkpoints" / "2" / "host" / "metadata").read_text())
  assert [list(files) for files in host["data_files"]] == [[str(chain / "data" / "train.jsonl")],
                                                           [str(chain / "processes" / "1" / "data" / "train.jsonl")]]
  assert len(host["data"]) == 2 and host["data"][0] == host["data"][1], host["data"]
