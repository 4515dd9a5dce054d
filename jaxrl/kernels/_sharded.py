"""Attention on a device mesh: the kernels run per shard inside ``jax.shard_map``.

XLA cannot partition a ``pallas_call`` (Mosaic says so: "Mosaic kernels cannot be automatically
partitioned. Please wrap the call in a shard_map"), so a sharded program reaches the kernels through
:func:`sharded_attention`: rows are split over the batch mesh axes and heads over the head axes,
each device runs the kernel on its own ``[B/b, T, N/n, H]`` block, and no collective is needed
(attention is independent per row and per kv-head group). Mesh axis names are arguments: this
module knows nothing of the model's logical axes.

Heads: query heads ``N`` and kv heads ``K`` must both divide the head axes' size ``n`` to be split
as they are. When only ``N`` does (2 kv heads on a 4-way tensor axis), the kv heads are repeated to
``N`` (each query head gets its own copy of its group's keys, as multi-head attention) and split
with the queries; when ``N`` does not divide, heads stay whole on every device. Rows likewise stay
whole when ``B`` does not divide the batch axes. A sharded sequence (the keys of a row spread over
devices) is refused: it needs ring or all-gathered attention, which is not built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl.kernels._common import normalise_ids
from jaxrl.kernels._dispatch import attention


def _live(mesh, axes: Sequence[str]) -> tuple[str, ...]:
  """The named axes that exist on ``mesh`` with more than one device."""
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"sharded_attention: mesh has no axis {a!r}; its axes are {tuple(mesh.shape)}")
  return tuple(a for a in axes if mesh.shape[a] > 1)


def _dividing(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
  """The longest prefix of ``axes`` whose device count divides ``size``."""
  kept = []
  for a in axes:
    if size % math.prod(mesh.shape[x] for x in (*kept, a)):
      break
    kept.append(a)
  return tuple(kept)


def _spec_entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def sharded_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids,
    positions=None,
    mesh,
    batch_axes: Sequence[str] = (),
    head_axes: Sequence[str] = (),
    sequence_axes: Sequence[str] = (),
    **kwargs,
) -> jax.Array:  # [B, T, N, H]
  """:func:`jaxrl.kernels.attention` run shard by shard under ``jax.shard_map`` on ``mesh``.

  The result equals ``attention(q, k, v, ...)`` on one device (same kernel, same tiles per row and
  head); only the placement differs. Usable inside ``jit`` and under ``jax.grad``.

  Args:
    q, k, v: as in :func:`jaxrl.kernels.attention`.
    segment_ids, positions: ``[B, T]`` arrays or ``(q_ids [B, T], kv_ids [B, S])`` pairs.
    mesh: a ``jax.sharding.Mesh`` (or ``AbstractMesh``).
    batch_axes: mesh axes the rows are split over (e.g. ``("data", "fsdp")``); axes of size 1 are
      ignored, and rows stay whole on the trailing axes whose product does not divide ``B``.
    head_axes: mesh axes the heads are split over (e.g. ``("tensor",)``); see the module docstring
      for kv heads that do not divide.
    sequence_axes: mesh axes the sequence dimension is split over; any of size > 1 raises.
    **kwargs: passed to :func:`jaxrl.kernels.attention` (``causal``, ``sm_scale``, ``softcap``,
      ``window``, ``block_sizes``, ``impl``, ``interpret``).

  Returns:
    ``[B, T, N, H]`` in ``q.dtype``, split like ``q``'s in-spec ``(batch, None, heads, None)``.
  """
  seq = _live(mesh, sequence_axes)
  if seq:
    raise NotImplementedError(
        f"sharded_attention: the sequence is split over mesh axes {seq}; the attention kernels need every "
        "key of a row on one device (ring attention is not built). Use a mesh with sequence=1 or map the "
        "'seq' logical axis to null.")
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  q_seg, kv_seg, q_pos, kv_pos = normalise_ids(segment_ids, positions, b, t, s)
  rows = _dividing(mesh, _live(mesh, batch_axes), b)
  heads = _live(mesh, head_axes)
  size = math.prod(mesh.shape[a] for a in heads)
  if heads and n % size:
    heads = ()  # query heads do not divide: every device keeps them all
  elif heads and kh % size:
    k, v = (jnp.repeat(x, n // kh, axis=2) for x in (k, v))  # kv heads -> one per query head
  if not rows and not heads and math.prod(mesh.shape.values()) == 1:
    return attention(q, k, v, segment_ids=(q_seg, kv_seg), positions=(q_pos, kv_pos), **kwargs)
  # Rows no batch axis divides (4 prefill rows on 32 chips) still go through shard_map, whole on every
  # device: a Pallas kernel cannot be left to the partitioner.
  r, hd = _spec_entry(rows), _spec_entry(heads)
  x_spec = PartitionSpec(r, None, hd, None)
  ids_spec = PartitionSpec(r, None)

  def local(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    return attention(q, k, v, segment_ids=(q_seg, kv_seg), positions=(q_pos, kv_pos), **kwargs)

  return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec) + (ids_spec,) * 4,
                       out_specs=x_spec, check_vma=False)(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
