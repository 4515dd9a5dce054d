"""Multi-host start-up, a liveness watchdog, process-local → global arrays and host reads."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

_ENV_KEYS = ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID")
HEARTBEAT_ENV = "JAXRL_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
"""Seconds without a heartbeat from another process before every survivor exits (``JAXRL_HEARTBEAT_TIMEOUT``)."""


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
  timeout = _heartbeat_timeout(env)
  # The runtime's own heartbeat check is the backstop; the watchdog (shorter) names the lost process.
  runtime_timeouts = dict(heartbeat_timeout_seconds=max(int(2 * timeout), 10))
  if coordinator_address is None and num_processes is None and process_id is None:
    if env.get("JAXRL_AUTO_DISTRIBUTED") == "1":
      jax.distributed.initialize(**runtime_timeouts)
      start_watchdog(timeout)
      return True
    return False
  missing = [k for k, v in zip(_ENV_KEYS, (coordinator_address, num_processes, process_id)) if v is None]
  if missing:
    raise ValueError(f"multi-host start-up needs coordinator, process count and process id; missing {missing}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, local_device_ids=local_device_ids, **runtime_timeouts)
  start_watchdog(timeout)
  return True


def _heartbeat_timeout(env: Mapping[str, str]) -> float:
  raw = env.get(HEARTBEAT_ENV)
  if not raw:
    return DEFAULT_HEARTBEAT_TIMEOUT
  try:
    value = float(raw)
  except ValueError:
    raise ValueError(f"environment variable {HEARTBEAT_ENV}={raw!r} is not a number of seconds") from None
  if value <= 0:
    raise ValueError(f"environment variable {HEARTBEAT_ENV}={raw!r} must be > 0 seconds")
  return value


_WATCHDOG: threading.Thread | None = None
_WATCHDOG_STOP = threading.Event()
_EXITING = threading.Event()


def start_watchdog(timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> None:
  """Every process publishes a counter in the coordinator's key-value store every ``timeout / 5`` s
  and watches everyone else's. When another process's counter has not moved for ``timeout`` seconds,
  or the coordinator (process 0) cannot be reached, this prints ``jaxrl: lost process K ...`` to
  stderr and ends the process with exit status 1, even while it waits inside a collective: a dead
  host makes the others stop within about ``timeout`` seconds instead of hanging.

  At interpreter exit (:func:`_shutdown_then_stop`) the watchdog keeps watching while JAX's shutdown
  barrier waits for every process, so a peer that died makes this one exit with ``lost process K``
  instead of waiting for the runtime's own time-out; once exiting, an unreachable coordinator is the
  service going away after the barrier, not a loss. The thread is then stopped and joined before the
  interpreter finalizes: a daemon thread still inside a coordination-service call at finalization
  aborts the process (``terminate called ... FATAL: exception not rethrown``)."""
  global _WATCHDOG
  if _WATCHDOG is not None or jax.process_count() == 1:
    return
  from jax._src import distributed as _dist
  client = _dist.global_state.client
  if client is None:
    return
  me, n = jax.process_index(), jax.process_count()
  interval = max(timeout / 5, 0.05)

  def lost(msg: str) -> None:
    if _WATCHDOG_STOP.is_set():
      return
    print(f"jaxrl: {msg}; process {me} exits (heartbeat timeout {timeout:g} s, {HEARTBEAT_ENV})",
          file=sys.stderr, flush=True)
    os._exit(1)

  def loop() -> None:
    count = 0
    seen = {p: (None, time.monotonic()) for p in range(n) if p != me}
    while not _WATCHDOG_STOP.is_set():
      count += 1
      try:
        client.key_value_set(f"jaxrl/heartbeat/{me}", str(count), allow_overwrite=True)
        values = {}
        for p in seen:
          try:
            values[p] = client.key_value_try_get(f"jaxrl/heartbeat/{p}")
          except Exception:  # noqa: BLE001 - not published yet (start-up) reads as "no change"
            values[p] = None
      except Exception as e:  # noqa: BLE001 - the coordination service itself is gone
        if not _EXITING.is_set():  # exiting: the service shuts down after the barrier; nothing is lost
          lost(f"lost process 0 (the coordinator): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return
      now = time.monotonic()
      for p, v in values.items():
        old, since = seen[p]
        if v != old:
          seen[p] = (v, now)
        elif now - since > timeout:
          lost(f"lost process {p}: no heartbeat for {now - since:.0f} s")
          return
      _WATCHDOG_STOP.wait(interval)

  _WATCHDOG_STOP.clear()
  _EXITING.clear()
  _WATCHDOG = threading.Thread(target=loop, name="jaxrl-heartbeat", daemon=True)
  _WATCHDOG.start()
  # atexit runs handlers last-registered first: this one runs before JAX's own exit handler.
  atexit.register(_shutdown_then_stop, interval + 5.0)


def _shutdown_then_stop(join_timeout: float) -> None:
  """At exit: JAX's exit clean-up (backends, then the distributed shutdown barrier) with the watchdog
  still watching, then the watchdog stopped and joined. JAX's own handler runs later and finds nothing
  left to do."""
  _EXITING.set()
  try:
    from jax._src import api as _api
    _api.clean_up()
  finally:
    stop_watchdog(join_timeout)


def stop_watchdog(join_timeout: float = 10.0) -> None:
  """Stops the heartbeat thread and waits for it to leave any coordination-service call."""
  global _WATCHDOG
  thread, _WATCHDOG = _WATCHDOG, None
  if thread is None:
    return
  _WATCHDOG_STOP.set()
  thread.join(join_timeout)


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


def to_host(tree: Any) -> Any:
  """``numpy`` copies of a pytree of arrays, readable on every process.

  Fully addressable and fully replicated arrays are read from this process's own shards; an array
  whose rows live on other processes is all-gathered explicitly (every process must call this).
  """
  from jax.experimental import multihost_utils

  def read(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(read, tree)


def allgather_rows(local: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Concatenates every process's rows (axis 0, process 0 first); rows may differ per process.

  Returns the global arrays and the ``[process_count]`` row counts. One process: the input itself.
  """
  local = {k: np.asarray(v) for k, v in local.items()}
  sizes = {len(v) for v in local.values()}
  if len(sizes) > 1:
    raise ValueError(f"allgather_rows: arrays have different row counts {sorted(sizes)}")
  rows = sizes.pop() if sizes else 0
  if jax.process_count() == 1:
    return dict(local), np.asarray([rows])
  from jax.experimental import multihost_utils
  counts = np.asarray(multihost_utils.process_allgather(np.asarray(rows, np.int64))).reshape(-1)
  most = int(counts.max())
  padded = {k: np.concatenate([v, np.zeros((most - rows, *v.shape[1:]), v.dtype)]) for k, v in local.items()}
  got = multihost_utils.process_allgather(padded)  # [P, most, ...]
  out = {k: np.concatenate([np.asarray(got[k])[p, :c] for p, c in enumerate(counts)]) for k in local}
  return out, counts


def allgather_scalar(value: float | int) -> np.ndarray:
  """``[process_count]`` values of a per-process scalar (one process: ``[value]``)."""
  if jax.process_count() == 1:
    return np.asarray([value])
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(value))).reshape(-1)


_BARRIERS: dict[str, int] = {}


def barrier(name: str, *, timeout_s: float = 3600.0) -> None:
  """Waits until every process reaches this point (the coordination service's barrier; no-op on one
  process). Used before programs whose collectives would otherwise start far apart: CPU (Gloo)
  collectives give up when a peer arrives more than 30 s late, e.g. still compiling on a loaded host."""
  if jax.process_count() == 1:
    return
  from jax._src import distributed as _dist
  client = _dist.global_state.client
  if client is None:
    return
  _BARRIERS[name] = _BARRIERS.get(name, 0) + 1
  client.wait_at_barrier(f"jaxrl/{name}/{_BARRIERS[name]}", int(timeout_s * 1000))
