"""Packed scoring batches on a mesh that may span several processes (the reward model and the implicit PRM).

Every process scores its own ``(prompt, completion)`` list, but each jitted forward on a global mesh is a
collective program: every process must run it the same number of times with the same shapes. So each process
packs its own sequences into ``rows / processes`` rows per batch (its block of the global ``[rows, seq_len]``
batch, the rows its devices hold), the processes agree on the number of batches (a host all-gather of the local
counts) and the ones with fewer batches run empty ones (all padding), and each process reads back its own rows
only. A process that cannot encode its samples says so in the same all-gather, so every process raises instead
of the others waiting in a collective. On one process this is exactly the single-process scorer: the whole
batch, no exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxrl import sharding
from jaxrl.pref._data import pack_sequences, packed_batches


def _row_slice(index: tuple[slice, ...], rows: int) -> tuple[int, int]:
  start, stop, _ = index[0].indices(rows)
  return start, stop


class ProcessBatches:
  """This process's rows of ``[rows, seq_len]`` batches with ``batch_sharding`` (module docstring).

  Attributes:
    local_rows: rows per batch this process packs (``rows / jax.process_count()``).
    first_row: the global index of this process's first row.

  Raises:
    ValueError: naming ``key`` when this process's devices do not hold one contiguous block of
      ``rows / processes`` rows (the batch axis is not split over the processes: each would need every row).
  """

  def __init__(self, batch_sharding, *, rows: int, seq_len: int, key: str):
    self.batch_sharding, self.rows, self.seq_len, self.key = batch_sharding, rows, seq_len, key
    procs = jax.process_count()
    spans = sorted({_row_slice(index, rows) for index in
                    batch_sharding.addressable_devices_indices_map((rows, seq_len)).values()})
    lo, hi = spans[0][0], spans[0][1]
    for start, stop in spans[1:]:
      if start > hi:
        lo = None  # a gap: this process's rows are not one block
        break
      hi = max(hi, stop)
    if lo is None or rows % procs or (hi - lo) * procs != rows:
      raise ValueError(f"{key}.rows={rows}: each of the {procs} processes must hold its own contiguous block of "
                       f"{rows}/{procs} rows of the batch; this process's devices hold rows {spans} (the batch axis "
                       "must be split over the processes by the mesh's data/fsdp axes)")
    self.first_row, self.local_rows = lo, hi - lo

  def batches(self, prepare: Callable[[], list[dict[str, np.ndarray]]], *, pad_id: int
              ) -> Iterator[dict[str, np.ndarray]]:
    """``[local_rows, seq_len]`` host arrays of the sequences ``prepare()`` returns (``tokens``, ``loss_mask``
    each; :func:`jaxrl.pref.pack_sequences` keys), packed best fit; with several processes as many as the
    process with the most has, the missing ones all padding (``seq_ids`` 0). ``prepare`` raising on one
    process raises on every process (its own error there, a ``ValueError`` naming it elsewhere)."""
    if jax.process_count() == 1:
      seqs = prepare()
      yield from packed_batches(seqs, rows=self.local_rows, seq_len=self.seq_len, pad_id=pad_id) if seqs else ()
      return
    error: Exception | None = None
    try:
      seqs = prepare()
      mine = list(packed_batches(seqs, rows=self.local_rows, seq_len=self.seq_len, pad_id=pad_id)) if seqs else []
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other processes know
      error, mine = e, []
    counts = sharding.allgather_scalar(-1 if error is not None else len(mine))
    if error is not None:
      raise error
    if (counts < 0).any():
      raise ValueError(f"{self.key}: process(es) {np.flatnonzero(counts < 0).tolist()} could not encode their "
                       "samples (their own error says why); every process stops here rather than wait in a "
                       "collective")
    yield from mine
    for _ in range(int(counts.max()) - len(mine)):
      yield pack_sequences([], [], rows=self.local_rows, seq_len=self.seq_len, pad_id=pad_id)

  def put(self, arrays: dict[str, np.ndarray], keys: tuple[str, ...]) -> dict[str, jax.Array]:
    """The global ``[rows, seq_len]`` arrays of ``keys``, each process's rows as its block."""
    return {k: sharding.global_batch(arrays[k], self.batch_sharding) for k in keys}

  def local(self, x: jax.Array) -> np.ndarray:  # [local_rows, T]
    """This process's rows of a batch-sharded result, read from its own devices (no exchange)."""
    out: Any = None
    for shard in x.addressable_shards:
      data = np.asarray(shard.data)
      if out is None:
        out = np.zeros((self.local_rows, *x.shape[1:]), data.dtype)
      start, stop = _row_slice(shard.index, x.shape[0])
      out[(slice(start - self.first_row, stop - self.first_row), *shard.index[1:])] = data
    return out
