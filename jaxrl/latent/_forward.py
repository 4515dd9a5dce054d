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
