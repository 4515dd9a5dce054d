"""The size of the engine's KV-cache pool: the blocks a budget buys, and the layouts the engine refuses.

:class:`jaxrl.sampling.Engine` takes its budget one of three ways: ``kv_cache_bytes`` per device,
``num_blocks`` over all devices, or ``kv_cache_fraction`` of the free device memory.
:func:`pool_blocks` turns it into the pool's block count (a multiple of the cache-batch shards,
:func:`budget_blocks`) and refuses, through :func:`check_pool`, a layout that cannot hold one row;
:mod:`jaxrl.plan` sizes a pool ahead of time with the same two functions. The pool's host-side
bookkeeping (free lists and reference counts) is :class:`jaxrl.sampling._paged.BlockPool`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxrl.sampling._paged import blocks_for
from jaxrl.sharding import allgather_scalar


def budget_blocks(bytes_per_device: int, block_bytes: int, dp: int, tp: int) -> int:
  """Blocks of the whole pool that ``bytes_per_device`` buys on every device (a multiple of ``dp``)."""
  num_blocks = int(bytes_per_device // (block_bytes // tp)) * dp
  return num_blocks - num_blocks % dp


def check_pool(num_slots: int, shards: int, num_blocks: int, max_len: int, block_size: int, *,
               budget: str = "") -> str | None:
  """The engine's refusal of a pool layout, or None: ``num_slots`` not a multiple of the cache-batch
  ``shards``, or a pool shard (``num_blocks // shards`` blocks) that cannot hold one row of ``max_len``
  plus one block of look-ahead. ``budget`` says where ``num_blocks`` came from (for the message)."""
  if num_slots % shards:
    return f"num_slots: {num_slots} is not a multiple of the cache-batch shards ({shards})"
  need = blocks_for(max_len, block_size) + 1
  if num_blocks // shards < need:
    return (f"kv cache: {num_blocks // shards} blocks per shard{f' ({budget})' if budget else ''} cannot hold one "
            f"row of max_len={max_len} ({need} blocks of {block_size}); raise the budget or lower max_len")
  return None


def pool_blocks(*, kv_cache_bytes: int | None, num_blocks: int | None, kv_cache_fraction: float | None,
                mesh: Mesh | None, procs: int, block_bytes: int, dp: int, tp: int, num_slots: int, max_len: int,
                block_size: int) -> int:
  """The engine pool's block count (all devices) for the one budget given, rounded down to a multiple of
  the ``dp`` cache-batch shards; raises ValueError naming the budget when it is invalid or too small.

  ``kv_cache_fraction`` is of the least free memory of the mesh's local devices (of all processes'
  devices when the mesh spans ``procs > 1`` processes: the pool's shape must be the same everywhere).
  """
  if kv_cache_fraction is not None:
    kv_cache_bytes = _fraction_bytes(kv_cache_fraction, mesh, procs)
  if kv_cache_bytes is not None:
    if kv_cache_bytes <= 0:
      raise ValueError(f"kv_cache_bytes: must be positive, got {kv_cache_bytes!r}")
    num_blocks = budget_blocks(kv_cache_bytes, block_bytes, dp, tp)
  elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
    raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
  num_blocks -= num_blocks % dp
  bad = check_pool(num_slots, dp, num_blocks, max_len, block_size, budget=(
      f"budget {kv_cache_bytes or num_blocks} {'bytes per device' if kv_cache_bytes else 'blocks'}"))
  if bad:
    raise ValueError(bad)
  return num_blocks


def _fraction_bytes(kv_cache_fraction: float, mesh: Mesh | None, procs: int) -> int:
  """``kv_cache_fraction`` of the least free memory of this process's devices (of the mesh's, or all
  devices without one), the least over all processes when ``procs > 1``."""
  if not 0 < kv_cache_fraction <= 1:
    raise ValueError(f"kv_cache_fraction: must be in (0, 1], got {kv_cache_fraction!r}")
  local = [d for d in (mesh.devices.flat if mesh is not None else jax.devices())
           if d.process_index == jax.process_index()]
  stats = [d.memory_stats() or {} for d in local]
  if not stats or any("bytes_limit" not in st for st in stats):
    raise ValueError("kv_cache_fraction: this backend reports no device memory; give kv_cache_bytes")
  free = min(st["bytes_limit"] - st.get("bytes_in_use", 0) for st in stats)
  kv_cache_bytes = int(kv_cache_fraction * free)
  if procs > 1:  # the pool's shape must be the same on every process: the least free memory
    kv_cache_bytes = int(allgather_scalar(kv_cache_bytes).min())
  return kv_cache_bytes
