"""One process of the multi-host test: loss and gradient norm of the tiny model on a global batch.

Run as ``python multihost_worker.py NUM_PROCESSES PROCESS_ID LOCAL_DEVICES PORT``; prints one JSON
line. Each process feeds only its own rows (``jaxrl.sharding.global_batch``).
"""

import json
import os
import sys

num_processes, process_id, local_devices, port = (int(a) for a in sys.argv[1:5])
# Tiny programs: compile fast rather than run fast (a third of the compile CPU time; both sides of every
# comparison are compiled alike).
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={local_devices} "
                           "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["JAX_PLATFORMS"] = "cpu"
if num_processes > 1:
  os.environ.update(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES=str(num_processes),
                    JAXRL_PROCESS_ID=str(process_id))

import jax  # noqa: E402

from jaxrl import sharding  # noqa: E402

assert sharding.initialize() == (num_processes > 1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl import losses, models  # noqa: E402

mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
cfg = models.ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                              num_kv_heads=2)
model = models.init_model(cfg, mesh=mesh, seed=0)
graphdef, params = nnx.split(model)

rng = np.random.default_rng(0)
rows, seq = 8, 16
tokens = rng.integers(1, 64, size=(rows, seq)).astype(np.int32)
segment_ids = np.repeat(np.array([[1] * 10 + [2] * 4 + [0] * 2]), rows, axis=0).astype(np.int32)
positions = np.concatenate([np.arange(10), np.arange(4), np.zeros(2)])[None].repeat(rows, 0).astype(np.int32)
mine = sharding.process_slice(rows)
batch_sharding = sharding.batch_sharding(mesh)
batch = {k: sharding.global_batch(v[mine], batch_sharding)
         for k, v in dict(tokens=tokens, segment_ids=segment_ids, positions=positions).items()}


@jax.jit
def loss_and_grad_norm(params, batch):
  def loss_fn(p):
    m = nnx.merge(graphdef, p)
    hidden = m(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"], return_hidden=True)
    targets = jnp.roll(batch["tokens"], -1, axis=1)
    mask = (batch["segment_ids"] > 0) & (jnp.roll(batch["segment_ids"], -1, axis=1) == batch["segment_ids"])
    lp = losses.token_logprobs(hidden, m.unembed_matrix(), targets, chunk_size=8)
    return -jnp.sum(jnp.where(mask, lp, 0.0)) / jnp.sum(mask)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return loss, optax.tree.norm(grads)


loss, gnorm = loss_and_grad_norm(params, batch)
print(json.dumps({"process": process_id, "processes": jax.process_count(), "devices": jax.device_count(),
                  "loss": float(loss), "grad_norm": float(gnorm)}), flush=True)
