"""How long a checkpoint save blocks the training loop: async (default) vs synchronous saves.

    .venv/bin/python scripts/checkpoint_stall.py --mib 256 --saves 5

Builds a train state of about ``--mib`` MiB of float32 parameters (plus Adam's two moments: 3× that
on disk) sharded over 8 CPU devices (fsdp), runs a jitted update between saves, and prints the median
wall time of ``Checkpointer.save`` (what the loop waits for), of the whole write (save + wait), and of
one update, for ``checkpoint.async_save`` true and false.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxrl import sharding, train  # noqa: E402


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mib", type=int, default=256, help="float32 parameter MiB")
  p.add_argument("--saves", type=int, default=5)
  ns = p.parse_args()
  mesh = sharding.make_mesh({"fsdp": 8})
  rows = ns.mib * 2**20 // 4 // 1024
  rows -= rows % 8
  spec = NamedSharding(mesh, P("fsdp", None))
  fresh = lambda: {f"w{i}": jax.device_put(jnp.full((rows // 4, 1024), 0.01 * i, jnp.float32), spec)
                   for i in range(4)}  # the step donates its state: new arrays for each round
  opt = optax.adam(1e-3)
  step_fn = train.make_train_step(lambda p, b: (sum(jnp.sum((w * b["x"]) ** 2) for w in p.values()), {}), opt,
                                  mesh=mesh)
  batch = {"x": jax.device_put(jnp.ones((1, 1024), jnp.float32), NamedSharding(mesh, P()))}
  print(f"state: {3 * ns.mib} MiB (params + Adam moments) on {jax.device_count()} devices")
  for async_save in (True, False):
    state = train.place_on_mesh(train.init_train_state(fresh(), opt), mesh)
    state, _ = step_fn(state, batch)  # compile
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d:
      ckpt = train.Checkpointer(d, every=1, keep=2, async_save=async_save)
      blocked, total, steps = [], [], []
      for k in range(1, ns.saves + 1):
        t0 = time.perf_counter()
        ckpt.save(k, state, {"step": k})
        t1 = time.perf_counter()
        state, _ = step_fn(state, batch)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        ckpt.wait()
        t3 = time.perf_counter()
        blocked.append(t1 - t0)
        steps.append(t2 - t1)
        total.append(t3 - t0 - (t2 - t1))
      ckpt.close()
    print(f"async_save={async_save}: save() blocks {statistics.median(blocked):.3f} s, whole write "
          f"{statistics.median(total):.3f} s, one update {statistics.median(steps):.3f} s (medians of {ns.saves})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
