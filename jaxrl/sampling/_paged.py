"""Host-side bookkeeping of the paged KV cache: a block pool per data shard with reference counts.

Block ids are global indices into the ``[L, NB, bs, K, H]`` pool. The pool's block axis is sharded
over the cache-batch mesh axes like the decode slots, so data shard ``d`` holds blocks
``[d·NB/dp, (d+1)·NB/dp)`` and a slot of shard ``d`` only ever gets blocks from that range: the
decode step's cache reads and writes stay on the shard (inside ``shard_map``, a table entry minus
the shard's first block is a local index).
"""

from __future__ import annotations

import numpy as np


def blocks_for(tokens: int, block_size: int) -> int:
  """Blocks that hold ``tokens`` cache slots."""
  return -(-max(int(tokens), 0) // block_size)


class BlockPool:
  """Free lists (one per data shard) and reference counts of the cache blocks.

  A block is free when its count is 0. Sharing (the n samples of a prompt reading its prefilled
  blocks) increments the count; :meth:`release` decrements and returns blocks to their shard's list.
  """

  def __init__(self, num_blocks: int, shards: int):
    if num_blocks % shards:
      raise ValueError(f"num_blocks={num_blocks} must be a multiple of the data shards ({shards})")
    self.num_blocks, self.shards = num_blocks, shards
    self.per_shard = num_blocks // shards
    self.refs = np.zeros((num_blocks,), np.int32)
    # Lowest ids first (pop from the end of a reversed list).
    self._free = [list(range((d + 1) * self.per_shard - 1, d * self.per_shard - 1, -1)) for d in range(shards)]

  def free_count(self, shard: int) -> int:
    return len(self._free[shard])

  @property
  def used(self) -> int:
    return self.num_blocks - sum(len(f) for f in self._free)

  def allocate(self, shard: int, count: int) -> list[int] | None:
    """``count`` fresh blocks of ``shard`` (count 1 each), or None when the shard has too few."""
    free = self._free[shard]
    if count > len(free):
      return None
    out = [free.pop() for _ in range(count)]
    self.refs[out] = 1
    return out

  def share(self, blocks) -> None:
    for b in blocks:
      if self.refs[b] <= 0:
        raise RuntimeError(f"block {b} is shared while free")
      self.refs[b] += 1

  def release(self, blocks) -> None:
    for b in blocks:
      if self.refs[b] <= 0:
        raise RuntimeError(f"block {b} released twice")
      self.refs[b] -= 1
      if self.refs[b] == 0:
        self._free[b // self.per_shard].append(b)

  def shard_of(self, block: int) -> int:
    return block // self.per_shard
