"""One decode step through the model's layers with ragged decode attention over the KV cache.

The model's own cache path runs :func:`jaxrl.kernels.attention` over every cache slot with segment
and position masks. Here each row's keys are a contiguous prefix ``[0, pos + 1)`` (the sampler's
layout), so attention goes through :func:`jaxrl.kernels.decode_attention`, whose Pallas kernels read
only the valid part of each row. Everything else is the model's path (:meth:`jaxrl.models.Transformer.run`:
embedding, layer loop, final norm, unembedding) with an ``attend`` step per layer that only writes the
new key/value into the cache (:func:`jaxrl.models.write_rows`) and runs the decode kernel. On a mesh
the kernel runs under ``shard_map`` (rows and heads over the cache's axes, :func:`jaxrl.models.cache_axes`),
so no cache is gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl import kernels, models
from jaxrl.sharding import LogicalRules

_DECODE_IMPL = {"auto": "auto", "reference": "reference", "pallas_triton": "pallas_triton",
                "pallas_tpu": "pallas_tpu"}


def _attention_fn(cfg, mesh: Mesh | None, rules: LogicalRules | None):
  impl = _DECODE_IMPL.get(cfg.attention_impl, "auto")

  def attend(q, k_cache, v_cache, lengths):  # [B, N, H], [B, S, K, H] x2, [B] -> [B, N, H]
    return kernels.decode_attention(q, k_cache, v_cache, lengths, impl=impl)

  if mesh is None:
    return attend

  def wrapped(q, k_cache, v_cache, lengths):
    axes = models.cache_axes(cfg, mesh, rules, q.shape[0])
    if not axes.batch and not axes.heads:
      return attend(q, k_cache, v_cache, lengths)
    bs, hs = axes.batch or None, axes.heads or None
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
    rope_delta: jax.Array | None = None,  # [B] int32 (M-RoPE)
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
    rope_delta: a VLM's per-row rotary offset: the token rotates by ``pos + rope_delta`` on the three
      M-RoPE axes (:func:`jaxrl.models.decode_rope_positions`); None: by ``pos``.

  Returns:
    ``([B, V] float32 logits, new cache)``.
  """
  dt = model.cfg.jnp_dtype
  kernel = _attention_fn(model.cfg, mesh, rules)
  lengths = pos + 1

  def attend(k_l, v_l):  # the layer's cache write and ragged attention, for Attention.__call__
    def fn(q, k, v):  # [B, 1, N, H], [B, 1, K, H] x2
      k_new, v_new = models.write_rows(k_l, k, pos), models.write_rows(v_l, v, pos)  # [B, S, K, H]
      return kernel(q[:, 0], k_new.astype(dt), v_new.astype(dt), lengths)[:, None], (k_new, v_new)
    return fn

  rope = None if rope_delta is None else models.decode_rope_positions(pos[:, None], rope_delta)
  logits, (new_k, new_v) = model.run(token[:, None], positions=pos[:, None], kv=(cache.k, cache.v), attend=attend,
                                     annotate=False, rope_positions=rope)
  seg = models.write_rows(cache.segment_ids, jnp.ones_like(pos)[:, None], pos)
  kv_pos = models.write_rows(cache.positions, pos[:, None], pos)
  return logits[:, 0], models.KVCache(k=new_k, v=new_v, segment_ids=seg, positions=kv_pos)
