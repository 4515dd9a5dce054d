"""One process of the multi-process asynchronous RL tests: ``AsyncRLTrainer`` on a few fake CPU devices.

Run as ``python async_worker.py NUM_PROCESSES PROCESS_ID LOCAL_DEVICES PORT OVERRIDES_JSON`` (the overrides of
``rl_testlib.make_config``, ``out_dir`` among them). Writes the final parameters (every process reads them
whole) to ``out_dir/params_<process>.npz``; the last stdout line is JSON with the trainer's per-step records
of the samples it trained (``AsyncRLTrainer.trained``, gathered over the processes) and its metrics.
"""

import json
import sys
from pathlib import Path

from multihost_testlib import configure_process

num_processes, process_id, local_devices, port = (int(a) for a in sys.argv[1:5])
overrides = json.loads(sys.argv[5])
configure_process(num_processes, process_id, local_devices, port)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from rl_testlib import make_config  # noqa: E402

from jaxrl import sharding  # noqa: E402
from jaxrl.rl._async import AsyncRLTrainer  # noqa: E402

sharding.initialize()
out_dir = Path(overrides.pop("out_dir"))
cfg = make_config(out_dir, **overrides)
trainer = AsyncRLTrainer(cfg)
try:
  trainer.run()
finally:
  trainer.close()
leaves = sharding.to_host(jax.tree.leaves(trainer.state.params))  # a collective: every process
np.savez(out_dir / f"params_{jax.process_index()}.npz", *leaves)
trained = {k: np.concatenate([t[k] for t in trainer.trained]).tolist() for k in trainer.trained[0]}
print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                  "rollout_devices": [d.id for d in trainer.rollout_devices],
                  "trainer_devices": [d.id for d in trainer.mesh.devices.flat], "trained": trained,
                  "history": trainer.history}), flush=True)
