"""One process of the multi-process scoring test: :class:`jaxrl.pref.RewardModel` and :class:`jaxrl.pref.ImplicitPRM`
on a global mesh, each process scoring its own share of :data:`PROMPTS` / :data:`COMPLETIONS`.

Run as ``python scoring_worker.py NUM_PROCESSES PROCESS_ID LOCAL_DEVICES PORT MODEL_DIR``. One process scores
every sample; with two, process 0 scores the first :data:`SPLIT` samples and process 1 the rest (a different
number of packed batches each). The last stdout line is JSON with the scores of this process's samples.
"""

import json
import sys

from multihost_testlib import configure_process

num_processes, process_id, local_devices, port = (int(a) for a in sys.argv[1:5])
model_dir = sys.argv[5]
configure_process(num_processes, process_id, local_devices, port)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from jaxrl import pref, sharding  # noqa: E402
from jaxrl.pref._data import packed_batches  # noqa: E402
from jaxrl.pref._scoring import ProcessBatches  # noqa: E402

PROMPTS = ["What is 3+4?", "Add 12 and 5.", "Compute 6*7, step by step.", "2+2?", "Say 9.", "1+1?", "9-3?"] * 2
COMPLETIONS = ["3+4=7\nAnswer: 7", "12+5=17\n\nso 17\nAnswer: 17", "6*7=42\nAnswer: 42\n", "4", "9\n9\n9\n9", "2",
               "9-3 is 6\nAnswer: 6", "7", "17", "6*7 = 6*5 + 6*2 = 30 + 12 = 42", "four", "nine", "11", "6\n"]
SPLIT = 3  # process 0 scores 3 samples, process 1 the other 11
ROWS, SEQ_LEN = 8, 80  # 4 rows a batch per process on two processes: 1 batch for 3 samples, 2 for 11

sharding.initialize()
# Weights sharded over every device (fsdp across both processes): each forward all-gathers them, so a process
# that ran fewer forwards than the other would leave it waiting in a collective
mesh = sharding.MeshConfig(shape={"fsdp": -1}).build()
if jax.process_count() == 1:
  mine = slice(0, len(PROMPTS))
else:
  mine = slice(0, SPLIT) if jax.process_index() == 0 else slice(SPLIT, len(PROMPTS))
prompts, completions = PROMPTS[mine], COMPLETIONS[mine]
root = Path(model_dir)
out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count()}

rm = pref.RewardModel.load(root / "rm", rows=ROWS, seq_len=SEQ_LEN, mesh=mesh)
out["local_rows"] = rm._batches.local_rows
seqs = [rm.encode(p, c) for p, c in zip(prompts, completions)]
out["rm_batches"] = len(list(packed_batches(seqs, rows=rm._batches.local_rows, seq_len=SEQ_LEN)))  # its own
out["rm_last"] = rm.score(prompts, completions).tolist()
rm_mean = pref.RewardModel.load(root / "rm", rows=ROWS, seq_len=SEQ_LEN, pooling="mean", mesh=mesh)
out["rm_mean"] = rm_mean.score(prompts, completions).tolist()
# None on process 0, all on process 1: process 0 runs only padding batches
first = jax.process_index() == 0 and jax.process_count() > 1
out["rm_none_or_all"] = rm.score([] if first else PROMPTS, [] if first else COMPLETIONS).tolist()

prm = pref.ImplicitPRM.load(root / "policy", root / "reference", beta=0.3, rows=ROWS, seq_len=SEQ_LEN, mesh=mesh)
out["prm_tokens"] = [q.tolist() for q in prm.token_rewards(prompts, completions)]
out["prm_steps"] = [r.tolist() for r in prm.step_rewards(prompts, completions)]

# A sample that does not fit on process 1 only: both processes raise (none waits in a collective), and the
# scorer still works after
try:
  rm.score(prompts, ["x" * 200] * len(completions) if jax.process_index() == 1 else completions)
  out["error"] = None
except ValueError as e:
  out["error"] = str(e)
out["rm_after_error"] = rm.score(prompts, completions).tolist()

# A batch whose rows do not split over the processes (replicated on every device) is refused
replicated = jax.sharding.NamedSharding(rm.mesh, jax.sharding.PartitionSpec())
try:
  ProcessBatches(replicated, rows=ROWS, seq_len=SEQ_LEN, key="reward.model")
  out["refused"] = None
except ValueError as e:
  out["refused"] = str(e)
print(json.dumps(out), flush=True)
