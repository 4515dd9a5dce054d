"""Checkpoints: save/restore round trip, keep-last-K, host state."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import sharding, train


def test_round_trip_keeps_values_sharding_and_host_state(tmp_path):
  mesh = sharding.make_mesh({"fsdp": 8})
  spec = NamedSharding(mesh, P("fsdp"))
  state = {"w": jax.device_put(jnp.arange(16, dtype=jnp.float32), spec), "step": jnp.asarray(3, jnp.int32)}
  ckpt = train.Checkpointer(tmp_path / "ckpt", every=1, keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, jax.tree.map(lambda x: x + step, state), {"data": {"pos": step}})
  ckpt.wait()
  assert ckpt.latest_step() == 3
  assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [2, 3]
  step, restored, host = ckpt.restore(state)
  ckpt.close()
  assert step == 3 and host == {"data": {"pos": 3}}
  np.testing.assert_array_equal(restored["w"], np.arange(16) + 3)
  assert restored["w"].sharding.spec == P("fsdp")
