"""The KV caches: their layouts, every write into them, and the mesh axes they are split over.

Two layouts hold the keys and values of every layer:

- dense, :class:`KVCache` (``k, v [L, B, S, K, H]``, one row of ``S`` slots per sequence, with the
  segment id and position of every slot): the model's forward pass with a cache, the sampler and latent
  decoding. Written by :func:`write_rows`.
- paged (``k, v [L, NB, bs, K, H]``, :data:`PAGE_AXES`): one pool of ``NB`` blocks of ``bs`` slots,
  shared by the rows of :class:`jaxrl.sampling.Engine` through block tables ``[rows, MB]``. Written one
  token per row by a decode step (:func:`write_page_tokens`) and whole blocks by a prefill chunk
  (:func:`write_page_blocks`).

Either way the rows (dense) or blocks (paged) are split over the ``cache_batch`` mesh axes and the kv
heads over the ``cache_kv_heads`` axes, where they divide: :func:`cache_axes` says which, for every
program that shards a cache (the model, the sampler's decode kernel, the engine's programs and budget).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.models._config import ModelConfig
from jaxrl.sharding import LogicalRules

PAGE_AXES = ("layers", "cache_batch", None, "cache_kv_heads", "head_dim")
"""Logical axes of a paged pool ``[L, NB, bs, K, H]``: blocks split like rows, kv heads like the model's."""


class KVCache(NamedTuple):
  """Per-layer keys/values plus the segment ids and positions of every cache slot.

  A slot with segment id 0 is empty. Attention of new queries runs over all ``S`` slots, masked by
  segment (same non-zero id) and position (causal), so rows may hold packed or ragged sequences.
  """

  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array  # [L, B, S, K, H]
  segment_ids: jax.Array  # [B, S] int32
  positions: jax.Array  # [B, S] int32

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache (all segment ids 0) of ``max_len`` slots per row, in ``dtype`` (default cfg.dtype)."""
    dtype = jnp.dtype(cfg.dtype if dtype is None else dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               segment_ids=jnp.zeros((batch, max_len), jnp.int32), positions=jnp.zeros((batch, max_len), jnp.int32))

  @staticmethod
  def logical_axes() -> KVCache:
    """Logical axis names of each field (map them with ``jaxrl.sharding.LogicalRules``)."""
    kv = ("layers", "cache_batch", "cache_seq", "cache_kv_heads", "head_dim")
    return KVCache(k=kv, v=kv, segment_ids=("cache_batch", "cache_seq"), positions=("cache_batch", "cache_seq"))

  def shardings(self, mesh, rules=None) -> KVCache:
    """A ``NamedSharding`` per field for this cache's shapes (works on ``jax.eval_shape`` output too)."""
    rules = rules or LogicalRules.default()
    return KVCache(*(rules.sharding(names, mesh, x.shape) for names, x in zip(KVCache.logical_axes(), self)))


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """``buf[b, start[b] + t] = new[b, t]`` for every row (``buf [B, S, ...]``, ``new [B, T, ...]``, cast to
  ``buf``'s dtype): the one write into a dense cache (keys, values, segment ids, positions).

  The caller keeps ``start[b] + T <= S``; ``lax.dynamic_update_slice`` would clamp otherwise.
  """
  def one(row, upd, s):
    return jax.lax.dynamic_update_slice(row, upd, (s,) + (0,) * (row.ndim - 1))
  return jax.vmap(one)(buf, new.astype(buf.dtype), start.astype(jnp.int32))


def write_page_tokens(
    pool: jax.Array,  # [NB, bs, K, H] one layer's blocks (this shard's)
    new: jax.Array,  # [B, K, H] one token per row
    tables: jax.Array,  # [B, MB] int32 block ids in ``pool``
    pos: jax.Array,  # [B] int32 the token's slot in its row's sequence
    active: jax.Array,  # [B] bool
) -> jax.Array:  # [NB, bs, K, H]
  """A decode step's write: ``pool[tables[b, pos[b] // bs], pos[b] % bs] = new[b]`` for every active row.

  A table entry outside ``[0, NB)`` (no block, or another shard's) drops the write.
  """
  nb, bs = pool.shape[:2]
  page = jnp.take_along_axis(tables, (pos // bs)[:, None], axis=1)[:, 0]  # [B]
  page = jnp.where(active & (page >= 0) & (page < nb), page, nb)
  return pool.at[page, pos % bs].set(new.astype(pool.dtype), mode="drop")


def write_page_blocks(
    pool: jax.Array,  # [NB, bs, K, H] one layer's blocks (this shard's)
    new: jax.Array,  # [U, T, K, H] a prefill chunk of T tokens per row (T a multiple of bs)
    tables: jax.Array,  # [U, MB] int32 block ids in ``pool``
    start: jax.Array,  # [U] int32 the chunk's first slot (a multiple of bs)
    n_cache: jax.Array,  # [U] int32 the row's cached tokens
) -> jax.Array:  # [NB, bs, K, H]
  """A prefill chunk's write, whole blocks: block ``j`` of the chunk goes to ``tables[u, start[u] // bs + j]``
  when it holds cached positions (``< n_cache``); earlier blocks (possibly shared with other rows) are never
  written. A table entry outside ``[0, NB)`` (another shard's block) drops the write.
  """
  nb, bs = pool.shape[:2]
  u, t = new.shape[:2]
  blk = start[:, None] // bs + jnp.arange(t // bs, dtype=jnp.int32)[None, :]  # [U, T / bs]
  ok = (jnp.take_along_axis((tables >= 0) & (tables < nb), blk, axis=1)
        & (blk < (n_cache[:, None] + bs - 1) // bs))
  ids = jnp.where(ok, jnp.take_along_axis(tables, blk, axis=1), nb)
  return pool.at[ids].set(new.reshape(u, t // bs, bs, *new.shape[2:]).astype(pool.dtype), mode="drop")


def cache_block_bytes(cfg: ModelConfig, block_size: int, dtype) -> int:
  """Bytes of one cache block (keys and values of every layer), over all devices."""
  return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def mesh_axes(mesh: Mesh, rules: LogicalRules, name: str) -> tuple[str, ...]:
  """Mesh axes (of size > 1) that logical axis ``name`` maps to."""
  return tuple(a for a in rules.mesh_axes(name) if mesh.shape[a] > 1)


class CacheAxes(NamedTuple):
  """The mesh axes a cache is split over (``()``: that dimension is whole on every device)."""

  batch: tuple[str, ...]  # the rows (dense) or blocks (paged): the cache-batch axes
  heads: tuple[str, ...]  # the kv heads (and the query heads of attention over them): the cache-kv-head axes
  shards: int  # how many pieces ``batch`` cuts the rows or blocks into
  head_shards: int  # how many pieces ``heads`` cuts the kv heads into


def cache_axes(cfg: ModelConfig, mesh: Mesh | None, rules: LogicalRules | None, *counts: int) -> CacheAxes:
  """Where a cache of ``cfg``'s model lives on ``mesh``: its rows/blocks over the ``cache_batch`` axes when
  their size divides each of ``counts`` (the rows, the pool's blocks), its kv heads over the
  ``cache_kv_heads`` axes when their size divides the kv and the query heads."""
  if mesh is None:
    return CacheAxes((), (), 1, 1)
  rules = rules or LogicalRules.default()
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  batch, heads = mesh_axes(mesh, rules, "cache_batch"), mesh_axes(mesh, rules, "cache_kv_heads")
  if any(c % size(batch) for c in counts):
    batch = ()
  if cfg.num_kv_heads % size(heads) or cfg.num_heads % size(heads):
    heads = ()
  return CacheAxes(batch, heads, size(batch), size(heads))


def cache_shards(cfg: ModelConfig, mesh: Mesh | None, rules: LogicalRules) -> tuple[int, int]:
  """``(dp, tp)``: the pool's blocks split over the cache-batch axes (``dp`` shards), each block's kv
  heads over the cache-kv-head axes when they divide the kv heads (``tp``, else 1)."""
  axes = cache_axes(cfg, mesh, rules)
  return axes.shards, axes.head_shards
