"""One decode step through the model's layers with ragged decode attention over the KV cache.

The model's own cache path runs :func:`jaxrl.kernels.attention` over every cache slot with segment
and position masks. Here each row's keys are a contiguous prefix ``[0, pos + 1)`` (the sampler's
layout), so attention goes through :func:`jaxrl.kernels.decode_attention`, whose Pallas kernels read
only the valid part of each row. Norms, RoPE and the MLP are the model's own modules and functions;
the q/k/v projection mirrors ``Attention.__call__`` (tests hold both paths to the HF reference); the
output projections contract flattened axes so XLA CPU makes no per-step transposed weight copy. On
a mesh the kernel runs under ``shard_map`` (rows over the cache-batch axes, heads over the tensor
axis), so no cache is gathered.
"""

from __future__ import annotations

import math

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


def _project(attn, x: jax.Array, positions: jax.Array):  # [B, 1, D] -> q [B, 1, N, H], k/v [B, 1, K, H]
  """The model's q/k/v projections, bias, Qwen3 q/k norm and RoPE (as in ``Attention.__call__``)."""
  cfg = attn.cfg
  dt = cfg.jnp_dtype
  q = models.add_lora(attn, "q_proj", x, jnp.einsum("btd,dnh->btnh", x, attn.q_proj[...].astype(dt)))
  k = models.add_lora(attn, "k_proj", x, jnp.einsum("btd,dkh->btkh", x, attn.k_proj[...].astype(dt)))
  v = models.add_lora(attn, "v_proj", x, jnp.einsum("btd,dkh->btkh", x, attn.v_proj[...].astype(dt)))
  if attn.q_bias is not None:
    q = q + attn.q_bias[...].astype(dt)
    k = k + attn.k_bias[...].astype(dt)
    v = v + attn.v_bias[...].astype(dt)
  if attn.q_norm is not None:
    q = attn.q_norm(q)
    k = attn.k_norm(k)
  inv_freq = models.rope_frequencies(cfg)
  return models.apply_rope(q, positions, inv_freq), models.apply_rope(k, positions, inv_freq), v


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
  attend = _attention_fn(cfg, mesh, rules)
  positions = pos[:, None]  # [B, 1]
  lengths = pos + 1
  x = jnp.take(model.embed[...], token[:, None], axis=0).astype(dt)  # [B, 1, D]

  def block_fn(block, x, k_l, v_l):
    attn = block.attn
    q, k, v = _project(attn, block.attn_norm(x), positions)
    k_l = _write(k_l, k[:, 0], pos)  # [B, S, K, H]
    v_l = _write(v_l, v[:, 0], pos)
    out = attend(q[:, 0], k_l.astype(dt), v_l.astype(dt), lengths)  # [B, N, H]
    n, h, d = attn.o_proj.shape  # contract over (n, h) as one flat axis: no per-step transposed copy
    y = (out.reshape(-1, n * h) @ attn.o_proj[...].astype(dt).reshape(n * h, d))[:, None]  # [B, 1, D]
    x = x + models.add_lora(attn, "o_proj", out[:, None], y)  # unmerged adapters: y + s·(out·A)·B
    x = x + block.mlp(block.mlp_norm(x))
    return x, k_l, v_l

  if cfg.scan_layers:
    def body(x, block, k_l, v_l):
      x, k_l, v_l = block_fn(block, x, k_l, v_l)
      return x, (k_l, v_l)
    scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0),
                    transform_metadata={nnx.PARTITION_NAME: "layers"})
    x, (new_k, new_v) = scan(x, model.layers, cache.k, cache.v)
  else:
    ks, vs = [], []
    for i, block in enumerate(model.layers):
      x, k_l, v_l = block_fn(block, x, cache.k[i], cache.v[i])
      ks.append(k_l)
      vs.append(v_l)
    new_k, new_v = jnp.stack(ks), jnp.stack(vs)
  h = model.final_norm(x)
  if model.lm_head is None:  # tied: contract with the embedding directly (no per-step transposed copy)
    logits = jnp.einsum("btd,vd->btv", h, model.embed[...].astype(dt), preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", h, model.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
  seg = _write(cache.segment_ids, jnp.ones_like(pos), pos)
  kv_pos = _write(cache.positions, pos, pos)
  return logits[:, 0], models.KVCache(k=new_k, v=new_v, segment_ids=seg, positions=kv_pos)
