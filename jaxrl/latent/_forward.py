"""The latent forward pass: continuous thoughts in ``N + 1`` passes that share one KV cache.

On column-aligned rows (:func:`jaxrl.latent.make_rows`, prefix width ``P``, ``N`` thought columns
``[P, P + N)``) the input of thought column ``j`` is the final normed hidden state of column
``j - 1`` (Coconut, Hao et al. 2024, §3: ``E_t = [e(x_1), ..., e(x_i), h_i, ..., h_{t-1}]``). Pass 0
runs columns ``[0, P)``; passes ``1 .. N-1`` run one column each, ``P, ..., P + N - 2``; pass ``N``
runs ``[P + N - 1, T)``. Every pass writes its keys/values into the model's :class:`KVCache` and
attends over it, so no column is computed twice, and the whole loop is one differentiable program
(the thought passes are a ``lax.scan``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import models


def latent_hidden(
    model,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32
    segment_ids: jax.Array,  # [B, T] int32
    thought_mask: jax.Array,  # [B, T] bool: continuous-thought columns, inside [P, P + N)
    *,
    prefix: int,
    thoughts: int,
) -> jax.Array:  # [B, T, D] final normed hidden states
  """Final hidden states of column-aligned rows whose thought columns take the previous hidden state.

  Args:
    model: a :class:`jaxrl.models.Transformer`.
    tokens, positions, segment_ids: the rows (thought columns' tokens are ignored).
    thought_mask: where the input embedding is the previous column's hidden state.
    prefix: ``P``, static; no thought before column ``P``.
    thoughts: ``N``, static; no thought at or after column ``P + N``.

  Returns:
    ``[B, T, D]`` hidden states in the compute dtype (project with ``model.unembed_matrix()``).
  """
  b, t = tokens.shape
  p, n = prefix, thoughts
  if n == 0:
    return model(tokens, positions=positions, segment_ids=segment_ids, return_hidden=True)
  if p < 1 or p + n > t:
    raise ValueError(f"prefix={p} and thoughts={n} must satisfy 1 <= P and P + N <= T={t}")
  d = model.cfg.hidden_size
  cache = models.KVCache.init(model.cfg, b, t)

  graphdef, state = nnx.split(model)

  def run(model, cache, a, width, prev):  # columns [a, a + width); prev [B, D]: hidden of column a - 1
    cols = lambda x: jax.lax.dynamic_slice_in_dim(x, a, width, axis=1)
    kwargs = {}
    if prev is not None:
      embeds = jnp.zeros((b, width, d), prev.dtype).at[:, 0].set(prev)
      mask = jnp.zeros((b, width), bool).at[:, 0].set(cols(thought_mask)[:, 0])
      kwargs = dict(embeds=embeds, embeds_mask=mask)
    return model(cols(tokens), positions=cols(positions), segment_ids=cols(segment_ids), cache=cache,
                 cache_start=jnp.full((b,), a, jnp.int32), return_hidden=True, **kwargs)

  h0, cache = run(model, cache, 0, p, None)  # [B, P, D]

  def step(carry, a):
    cache, prev, state = carry  # the weights ride in the carry: NNX variables cannot be closed over
    h, cache = run(nnx.merge(graphdef, state), cache, a, 1, prev)
    return (cache, h[:, 0], state), h[:, 0]

  (cache, prev, _), mid = jax.lax.scan(step, (cache, h0[:, -1], state), jnp.arange(p, p + n - 1))  # [N-1, B, D]
  last, _ = run(model, cache, p + n - 1, t - (p + n - 1), prev)  # [B, T - P - N + 1, D]
  return jnp.concatenate([h0, jnp.swapaxes(mid, 0, 1).astype(h0.dtype), last], axis=1)


PACKED_KEYS = ("first_idx", "mid_idx", "last_idx", "bot_slot", "last_thought_slot", "order")
"""Index arrays of packed rows (:func:`jaxrl.latent.pack_rows`) that :func:`packed_latent_hidden` reads."""


def packed_latent_hidden(model, batch, *, thoughts: int, examples: int) -> jax.Array:  # [B, T, D]
  """Final hidden states of packed rows (several examples per row, each its own segment).

  The ``N + 1`` passes of :func:`latent_hidden`, each over the columns the row lists for it
  (:func:`jaxrl.latent.pack_rows`): pass 0 gathers every example's prompt up to ``<bot>``; thought
  pass ``m`` (``1 .. N-1``) one thought per example slot, fed the hidden state the same slot produced
  in the pass before (``<bot>``'s after pass 0); the final pass every example's last thought (fed
  likewise) and its suffix. The passes write their keys/values into one :class:`KVCache` in
  processing order; attention masks by segment and position, not by slot, so the order is free.
  Pass widths are the row's static budgets; unused slots carry segment 0 and stay invisible.

  Args:
    model: a :class:`jaxrl.models.Transformer`.
    batch: ``tokens``, ``positions``, ``segment_ids`` ``[B, T]`` (natural packed order) and the index
      arrays :data:`PACKED_KEYS`.
    thoughts: ``N``, static (0: one plain packed pass).
    examples: ``E``, example slots per row, static.

  Returns:
    ``[B, T, D]`` hidden states in natural column order, compute dtype.
  """
  tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
  if thoughts == 0:
    return model(tokens, positions=positions, segment_ids=segment_ids, return_hidden=True)
  b, t = tokens.shape
  n, e = thoughts, examples
  d = model.cfg.hidden_size
  first, mid, last = batch["first_idx"], batch["mid_idx"], batch["last_idx"]
  if mid.shape[1] != (n - 1) * e or first.shape[1] + mid.shape[1] + last.shape[1] != t:
    raise ValueError(f"packed index widths {first.shape[1]}/{mid.shape[1]}/{last.shape[1]} do not fit T={t}, "
                     f"thoughts={n}, examples={e}")
  take = lambda x, idx: jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=1)
  cache = models.KVCache.init(model.cfg, b, t)
  graphdef, state = nnx.split(model)

  def run(model, cache, idx, start, embeds=None, mask=None):  # idx [B, W] natural columns, -1 = unused
    seg = jnp.where(idx >= 0, take(segment_ids, idx), 0)
    kwargs = {} if embeds is None else dict(embeds=embeds, embeds_mask=mask)
    return model(take(tokens, idx), positions=take(positions, idx), segment_ids=seg, cache=cache,
                 cache_start=jnp.full((b,), start, jnp.int32), return_hidden=True, **kwargs)

  h0, cache = run(model, cache, first, 0)  # [B, W0, D]
  prev = jnp.take_along_axis(h0, batch["bot_slot"][..., None], axis=1)  # [B, E, D]: each example's <bot>

  def step(carry, m):
    cache, prev, state = carry  # the weights ride in the carry: NNX variables cannot be closed over
    idx = jax.lax.dynamic_slice_in_dim(mid, m * e, e, axis=1)  # [B, E]
    active = idx >= 0
    h, cache = run(nnx.merge(graphdef, state), cache, idx, first.shape[1] + m * e, prev, active)
    return (cache, jnp.where(active[..., None], h, prev), state), h

  if n > 1:
    (cache, prev, _), hm = jax.lax.scan(step, (cache, prev, state), jnp.arange(n - 1))  # hm [N-1, B, E, D]
  else:
    hm = jnp.zeros((0, b, e, d), h0.dtype)
  slot = batch["last_thought_slot"]  # [B, E]
  w_last = last.shape[1]
  rows = jnp.arange(b)[:, None]
  safe = jnp.where(slot >= 0, slot, w_last)  # out of range: dropped
  embeds = jnp.zeros((b, w_last, d), prev.dtype).at[rows, safe].set(prev, mode="drop")
  mask = jnp.zeros((b, w_last), bool).at[rows, safe].set(True, mode="drop")
  hl, _ = run(model, cache, last, t - w_last, embeds, mask)  # [B, W_N, D]
  processed = jnp.concatenate([h0, jnp.swapaxes(hm, 0, 1).reshape(b, (n - 1) * e, d).astype(h0.dtype), hl], axis=1)
  return jnp.take_along_axis(processed, batch["order"][..., None], axis=1)
