"""Multi-host start-up and process-local → global arrays."""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

_ENV_KEYS = ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:
  """Calls ``jax.distributed.initialize`` when the arguments or the environment ask for it.

  Arguments win over the environment variables ``JAXRL_COORDINATOR`` (``host:port``),
  ``JAXRL_NUM_PROCESSES`` and ``JAXRL_PROCESS_ID``. With none of them set this is a no-op
  (single process), except on managed clusters (TPU pods, SLURM) where ``JAXRL_AUTO_DISTRIBUTED=1``
  lets JAX discover everything itself. Returns whether distributed mode was initialised.
  """
  env = os.environ if env is None else env
  coordinator_address = coordinator_address or env.get("JAXRL_COORDINATOR")
  if num_processes is None and env.get("JAXRL_NUM_PROCESSES"):
    num_processes = _int_env(env, "JAXRL_NUM_PROCESSES")
  if process_id is None and env.get("JAXRL_PROCESS_ID"):
    process_id = _int_env(env, "JAXRL_PROCESS_ID")
  if coordinator_address is None and num_processes is None and process_id is None:
    if env.get("JAXRL_AUTO_DISTRIBUTED") == "1":
      jax.distributed.initialize()
      return True
    return False
  missing = [k for k, v in zip(_ENV_KEYS, (coordinator_address, num_processes, process_id)) if v is None]
  if missing:
    raise ValueError(f"multi-host start-up needs coordinator, process count and process id; missing {missing}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, local_device_ids=local_device_ids)
  return True


def _int_env(env: Mapping[str, str], key: str) -> int:
  try:
    return int(env[key])
  except ValueError:
    raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def global_batch(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Assembles a global array from each process's rows (data-parallel inputs).

  Every process passes its own contiguous slice of the global batch along axis 0; the result has
  ``process_count × local rows`` rows. On one process this is a plain sharded ``device_put``.
  """
  return jax.make_array_from_process_local_data(sharding, np.asarray(local))


def process_slice(global_rows: int, mesh: Mesh | None = None) -> slice:
  """Rows of a global batch that this process feeds (contiguous, equal shares)."""
  n, i = jax.process_count(), jax.process_index()
  if global_rows % n:
    raise ValueError(f"global batch of {global_rows} rows does not split over {n} processes")
  per = global_rows // n
  return slice(i * per, (i + 1) * per)
