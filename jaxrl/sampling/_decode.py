"""One decode step through the model's layers with ragged decode attention over the KV cache.

The model's own cache path runs :func:`jaxrl.kernels.attention` over every cache slot with segment
and position masks. Here each row's keys are a contiguous prefix ``[0, pos + 1)`` (the sampler's
layout), so attention goes through :func:`jaxrl.kernels.decode_attention`, whose Pallas kernels read
only the valid part of each row. Everything else is the model's own block code: each layer is
``block(x, positions=..., attend=...)`` (:class:`jaxrl.models.Block`), where ``attend`` only writes
the new key/value into the cache and runs the decode kernel; projections, bias, q/k norm, RoPE, the
output projection, LoRA terms, the MLP and the residual stream are the model's methods. On
a mesh the kernel runs under ``shard_map`` (rows over the cache-batch axes, heads over the tensor
axis), so no cache is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxrl import kernels, models
from jaxrl.sharding import LogicalRules

_DECODE_IMPL = {"auto": "auto", "reference": "reference", "pallas_triton": "pallas_triton",
                "pallas_tpu": "pallas_tpu"}


def _write(buf: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
  """``buf[b, slot[b]] = new[b]`` (``buf [B, S, ...]``, ``new [B, ...]``)."""
  def one(row, upd, s):
    return jax.lax.dynamic_update_slice(row, upd[None], (s,) + (0,) * (row.ndim - 1))
  return jax.vmap(one)(buf, new.astype(buf.dtype), slot)


def _attention_fn(cfg, mesh: Mesh | None, rules: LogicalRules | None):
  impl = _DECODE_IMPL.get(cfg.attention_impl, "auto")

  def attend(q, k_cache, v_cache, lengths):  # [B, N, H], [B, S, K, H] x2, [B] -> [B, N, H]
    return kernels.decode_attention(q, k_cache, v_cache, lengths, impl=impl)

  if mesh is None:
    return attend
  rules = rules or LogicalRules.default()
  batch = tuple(a for a in rules.mesh_axes("cache_batch") if mesh.shape[a] > 1)
  heads = tuple(a for a in rules.mesh_axes("cache_kv_heads") if mesh.shape[a] > 1)

  def wrapped(q, k_cache, v_cache, lengths):
    b, n, _ = q.shape
    kh = k_cache.shape[2]
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    b_axes = batch if batch and b % size(batch) == 0 else ()
    h_axes = heads if heads and kh % size(heads) == 0 and n % size(heads) == 0 else ()
    bs = b_axes or None
    hs = h_axes or None
    if not b_axes and not h_axes:
      return attend(q, k_cache, v_cache, lengths)
    q_spec = PartitionSpec(bs, hs, None)
    kv_spec = PartitionSpec(bs, None, hs, None)
    return jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(bs)),
                         out_specs=q_spec, check_vma=False)(q, k_cache, v_cache, lengths)

  return wrapped


def decode_step(
    model,
    token: jax.Array,  # [B] int32: the pending token of each row
    pos: jax.Array,  # [B] int32: its position = cache slot; the row's valid cache becomes [0, pos + 1)
    cache: models.KVCache,  # k, v [L, B, S, K, H]
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
) -> tuple[jax.Array, models.KVCache]:  # [B, V] float32 logits, updated cache
  """Feeds one token per row, writes its keys/values at slot ``pos`` and returns next-token logits.

  Equivalent to ``model(token[:, None], positions=pos[:, None], segment_ids=1, cache=cache,
  cache_start=pos)`` when every row's cache holds its sequence in slots ``[0, pos)``.

  Args:
    model: a merged :class:`jaxrl.models.Transformer` (``nnx.merge``d, not a graph): with LoRA
      adapters unmerged, their ``s·(x·A)·B`` terms are added as in the model's forward pass.
    token: ``[B]`` token ids.
    pos: ``[B]`` positions (= slots).
    cache: the KV cache.
    mesh, rules: shard the decode kernel over rows and kv heads (see module docstring).

  Returns:
    ``([B, V] float32 logits, new cache)``.
  """
  cfg = model.cfg
  dt = cfg.jnp_dtype
  kernel = _attention_fn(cfg, mesh, rules)
  lengths = pos + 1

  def attend(k_l, v_l):  # the layer's cache write and ragged attention, for Attention.__call__
    def fn(q, k, v):  # [B, 1, N, H], [B, 1, K, H] x2
      k_new, v_new = _write(k_l, k[:, 0], pos), _write(v_l, v[:, 0], pos)  # [B, S, K, H]
      return kernel(q[:, 0], k_new.astype(dt), v_new.astype(dt), lengths)[:, None], (k_new, v_new)
    return fn

  logits, (new_k, new_v) = run_blocks(model, token, pos, (cache.k, cache.v), attend)
  seg = _write(cache.segment_ids, jnp.ones_like(pos), pos)
  kv_pos = _write(cache.positions, pos, pos)
  return logits, models.KVCache(k=new_k, v=new_v, segment_ids=seg, positions=kv_pos)


def run_blocks(
    model,
    token: jax.Array,  # [B] int32
    pos: jax.Array,  # [B] int32
    cache: tuple[jax.Array, jax.Array],  # per-layer cache arrays, stacked on a leading [L] axis
    attend: Callable,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:  # [B, V] float32 logits, new cache arrays
  """One token per row through the model's own blocks (:class:`jaxrl.models.Block`), with a custom
  attention step: ``attend(k_l, v_l)`` returns the ``(q, k, v) -> (out, (k_l', v_l'))`` function that
  :meth:`jaxrl.models.Attention.__call__` runs in place of its contiguous-cache attention.

  Shared by :func:`decode_step` (ragged cache) and the engine (paged cache); norms, projections,
  RoPE, the MLP and the residual stream are the model's code.
  """
  cfg = model.cfg
  dt = cfg.jnp_dtype
  x = jnp.take(model.embed[...], token[:, None], axis=0).astype(dt)  # [B, 1, D]
  x, (new_k, new_v) = run_layers(model, x, pos[:, None], cache, attend)
  h = model.final_norm(x)
  if model.lm_head is None:  # tied: contract with the embedding directly (no per-step transposed copy)
    logits = jnp.einsum("btd,vd->btv", h, model.embed[...].astype(dt), preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", h, model.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
  return logits[:, 0], (new_k, new_v)


def run_layers(
    model,
    x: jax.Array,  # [B, T, D] embedded inputs (compute dtype)
    positions: jax.Array,  # [B, T] int32
    cache: tuple[jax.Array, jax.Array],  # per-layer cache arrays, stacked on a leading [L] axis
    attend: Callable,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:  # [B, T, D] last block's output (not normed), new cache
  """The model's blocks over ``x`` with a custom attention step ``attend(k_l, v_l)`` (see
  :func:`run_blocks`); the engine's paged prefill runs its chunks through it (``T`` tokens per row)."""
  cfg = model.cfg

  def block_fn(block, x, k_l, v_l):
    return block(x, positions=positions, attend=attend(k_l, v_l))

  # The cache travels as the loop's carry and each layer's slab is written back with a dynamic update,
  # so with the cache donated XLA updates it in place; scanning it as an input and stacking the
  # outputs would make a second cache-sized buffer (the plan measured 1.1-2.6x the pool in temporaries).
  def write(buf, i, new):
    return jax.lax.dynamic_update_index_in_dim(buf, new.astype(buf.dtype), i, 0)

  k_all, v_all = cache
  if cfg.scan_layers:
    def body(carry, block, i):
      x, k_all, v_all = carry
      k_l = jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False)
      v_l = jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False)
      x, (k_l, v_l) = block_fn(block, x, k_l, v_l)
      return (x, write(k_all, i, k_l), write(v_all, i, v_l)), None
    scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
                    transform_metadata={nnx.PARTITION_NAME: "layers"})
    (x, new_k, new_v), _ = scan((x, k_all, v_all), model.layers, jnp.arange(cfg.num_layers))
  else:
    new_k, new_v = k_all, v_all
    for i, block in enumerate(model.layers):
      x, (k_l, v_l) = block_fn(block, x, new_k[i], new_v[i])
      new_k, new_v = write(new_k, i, k_l), write(new_v, i, v_l)
  return x, (new_k, new_v)
