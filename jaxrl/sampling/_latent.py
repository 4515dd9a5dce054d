"""Latent mode of the sampler: Coconut's continuous thoughts, then sampled token decoding.

The latent phase, :func:`think`, is shared with :func:`jaxrl.latent.latent_generate` (the same
prefill, thought loop and optional ``<eot>`` classifier; ``jaxrl.latent`` imports it from here, a
layer below): prompts ending with ``<bot>`` are left-padded and prefilled into a ``KVCache``,
``N`` continuous thoughts (each the final normed hidden state of the position before) are fed back
as input embeddings, then ``<eot>``. Token decoding then draws with
:func:`jaxrl.sampling.sample_logits` (per-row temperature, top-k, top-p, min-p, one PRNG key per row
and step), returning both log-prob conventions of the sampler. At temperature 0 the tokens are the
greedy decode of :func:`jaxrl.latent.latent_generate`.

Example::

    from jaxrl import latent, sampling
    ids, _ = latent.prompt_ids(tok, "6+5+2=?", marks, markers=True, kind="latent", n_thoughts=2)
    out = sampling.latent_sample(model, [ids], thoughts=2, eot=marks.eot, eos=marks.eos, pad=marks.pad,
                                 max_new_tokens=16, temperature=1.0, seed=0)
    out.tokens, out.logprobs, out.lengths, out.n_thoughts
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import models
from jaxrl.sampling._logits import sample_logits
from jaxrl.sampling._rows import decode_loop


class LatentSample(NamedTuple):
  tokens: np.ndarray  # [B, G] int32, pad after the end
  logprobs: np.ndarray  # [B, G] float32: log_softmax(logits / T)[token] (T = 1 when greedy), 0 after the end
  sampling_logprobs: np.ndarray  # [B, G] float32: under the truncated distribution sampled from, 0 after the end
  lengths: np.ndarray  # [B] int32: generated language tokens, end-of-turn included
  thoughts: np.ndarray  # [B, N, D] float32: the continuous thoughts fed back (0 after a row stopped)
  n_thoughts: np.ndarray  # [B] int32: thoughts each row took


def eot_logits(head, hidden: jax.Array) -> jax.Array:  # [..., D] -> [...] float32
  """The ``<eot>`` classifier's logit ``z = h · w + b`` in float32 (``head = {"w": [D], "b": []}``,
  :func:`jaxrl.latent.init_eot_head`); decoding stops a row's thinking when ``z > 0``."""
  return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), head["w"]) + head["b"]


def left_pad(prompts: Sequence[np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
  """``[B, P]`` tokens/positions/segment_ids with each prompt right-aligned at column ``P - 1``."""
  width = max(len(p) for p in prompts)
  out = {"tokens": np.full((len(prompts), width), pad_id, np.int32),
         "positions": np.zeros((len(prompts), width), np.int32),
         "segment_ids": np.zeros((len(prompts), width), np.int32)}
  for r, p in enumerate(prompts):
    out["tokens"][r, width - len(p):] = p
    out["positions"][r, width - len(p):] = np.arange(len(p))
    out["segment_ids"][r, width - len(p):] = 1
  return out


class Thought(NamedTuple):
  """The state after the latent phase: prompts prefilled, thoughts fed, ``<eot>`` fed (with markers)."""

  cache: models.KVCache
  first_logits: jax.Array  # [B, V] float32: logits of the first language token
  slot: int  # cache slot of the first language token (static)
  pos: jax.Array  # [B] int32: its position per row
  thought_inputs: jax.Array  # [B, N, D] float32: thoughts fed back (0 after a row stopped)
  count: jax.Array  # [B] int32: thoughts each row took


def feed_thoughts(graphdef, state, head, cache: models.KVCache, prev: jax.Array, *, slot: jax.Array,
                  pos: jax.Array, thoughts: int, limit: jax.Array | None = None):
  """The thought loop (call inside ``jit``): ``thoughts`` continuous thoughts fed one position at a time
  into ``cache``, each the final normed hidden state of the position before (``prev [B, D]`` first).

  Thought ``j`` of row ``b`` goes to cache slot ``slot[b] + j`` at position ``pos[b] + count[b]``
  (``count``: thoughts the row took so far). A row stops thinking when the ``<eot>`` head fires on its
  last hidden state or, with ``limit [B]``, after ``limit[b]`` thoughts; a stopped row writes an
  invisible slot (segment 0) instead, so rows take different counts in one fixed-shape loop.
  ``model = nnx.merge(graphdef, state)``; the weights ride in the scan carry (NNX variables cannot be
  closed over). Shared by :func:`think` and the latent mode of :class:`jaxrl.sampling.Sampler`.

  Returns:
    ``(cache, prev [B, D], count [B] int32, thought_inputs [N, B, D])``: the cache with the thoughts,
    each row's last hidden state (its last thought's output), the thoughts each row took, and the
    thoughts fed back (0 after a row stopped).
  """
  b = prev.shape[0]

  def step(carry, j):
    cache, prev, count, thinking, state = carry
    if head is not None:
      thinking = thinking & ~(eot_logits(head, prev) > 0)
    if limit is not None:
      thinking = thinking & (j < limit)
    h, cache = nnx.merge(graphdef, state)(
        jnp.zeros((b, 1), jnp.int32), positions=(pos + count)[:, None],
        segment_ids=thinking.astype(jnp.int32)[:, None], cache=cache, cache_start=slot + j,
        return_hidden=True, embeds=prev[:, None], embeds_mask=jnp.ones((b, 1), bool))
    fed = jnp.where(thinking[:, None], prev, 0)
    prev = jnp.where(thinking[:, None], h[:, 0], prev)
    return (cache, prev, count + thinking.astype(jnp.int32), thinking, state), fed

  init = (cache, prev, jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), state)
  (cache, prev, count, _, _), thought_inputs = jax.lax.scan(step, init, jnp.arange(thoughts))
  return cache, prev, count, thought_inputs


def think(model, graphdef, state, head, tokens, positions, segment_ids, *, thoughts: int, eot: int | None,
          extra: int) -> Thought:
  """The latent phase of decoding (call inside ``jit``): prefill the left-padded prompts into a
  ``KVCache`` of ``P + N + 1 + extra`` slots, feed ``N`` continuous thoughts one position at a time
  (:func:`feed_thoughts`: a row whose ``<eot>`` head fires stops, its later slots are invisible), then
  ``<eot>``.

  Shared by :func:`latent_sample` (sampled) and :func:`jaxrl.latent.latent_generate` (greedy).
  ``model`` is ``nnx.merge(graphdef, state)``.
  """
  b, p = tokens.shape
  n = thoughts
  cache = models.KVCache.init(model.cfg, b, p + n + 1 + extra)
  last_pos = positions[:, -1]  # [B]
  h, cache = model(tokens, positions=positions, segment_ids=segment_ids, cache=cache,
                   cache_start=jnp.zeros((b,), jnp.int32), return_hidden=True)
  cache, prev, count, thought_inputs = feed_thoughts(graphdef, state, head, cache, h[:, -1],
                                                     slot=jnp.full((b,), p, jnp.int32), pos=last_pos + 1,
                                                     thoughts=n)
  slot, pos = p + n, last_pos + 1 + count
  if eot is None:  # no markers: the last prompt (or thought) position predicts the first token
    first = model.unembed(prev[:, None])[:, 0]
  else:
    logits, cache = model(jnp.full((b, 1), eot, jnp.int32), positions=pos[:, None],
                          segment_ids=jnp.ones((b, 1), jnp.int32), cache=cache,
                          cache_start=jnp.full((b,), slot, jnp.int32))
    first = logits[:, 0].astype(jnp.float32)
    slot, pos = slot + 1, pos + 1
  return Thought(cache=cache, first_logits=first, slot=slot, pos=pos,
                 thought_inputs=jnp.swapaxes(thought_inputs, 0, 1).astype(jnp.float32), count=count)


class _TokenRows(NamedTuple):
  """The token phase's row state in :func:`decode_loop`: what it has drawn and the next logits."""
  out: jax.Array  # [B, G] int32 tokens (pad after eos)
  values: tuple  # each [B, G] float32 (0 after eos)
  logits: jax.Array  # [B, V] float32, the next token's
  done: jax.Array  # [B] bool, eos drawn
  step: jax.Array  # [] int32, the token index drawn next


def decode_tokens(graphdef, state, th: Thought, draw, *, eos: int, pad: int, max_new_tokens: int):
  """The token phase after :func:`think` (call inside ``jit``): ``G = max_new_tokens`` steps, each drawing
  a token per row from the logits (``draw(logits [B, V], i) -> (tokens [B], values)``, ``values`` a tuple
  of ``[B]`` float32 per token) and feeding it through the model's cache; ``pad`` (and 0 values) after a
  row's ``eos``.

  Shared by :func:`latent_sample` (sampled) and :func:`jaxrl.latent.latent_generate` (greedy).

  Returns:
    ``(tokens [B, G] int32, values (each [B, G] float32), lengths [B] int32)``: ``lengths`` counts the
    generated tokens, ``eos`` included.
  """
  b, g = th.first_logits.shape[0], max_new_tokens
  ones = jnp.ones((b, 1), jnp.int32)

  def advance(state, cache, rows: _TokenRows):
    tok, new = draw(rows.logits, rows.step)
    out = rows.out.at[:, rows.step].set(jnp.where(rows.done, pad, tok))
    values = tuple(buf.at[:, rows.step].set(jnp.where(rows.done, 0.0, x)) for buf, x in zip(rows.values, new))
    logits, cache = nnx.merge(graphdef, state)(
        tok[:, None], positions=(th.pos + rows.step)[:, None], segment_ids=ones, cache=cache,
        cache_start=jnp.full((b,), th.slot + rows.step, jnp.int32))
    return cache, _TokenRows(out=out, values=values, logits=logits[:, 0].astype(jnp.float32),
                             done=rows.done | (tok == eos), step=rows.step + 1)

  n_values = len(jax.eval_shape(draw, th.first_logits, 0)[1])
  rows = _TokenRows(out=jnp.full((b, g), pad, jnp.int32),
                    values=tuple(jnp.zeros((b, g), jnp.float32) for _ in range(n_values)),
                    logits=th.first_logits, done=jnp.zeros((b,), bool), step=jnp.int32(0))
  # The sampler's and engine's loop: it stops once every row has drawn eos (later steps would only
  # write pad and 0, the buffers' initial values).
  _, rows, _ = decode_loop(advance, state, th.cache, rows, g)
  out, values = rows.out, rows.values
  is_eos = out == eos
  lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, g)
  return out, values, lengths


@functools.partial(jax.jit, static_argnames=("graphdef", "thoughts", "eot", "eos", "pad", "max_new_tokens"))
def _sample(graphdef, state, head, tokens, positions, segment_ids, params, seed, *, thoughts: int, eot: int | None,
            eos: int, pad: int, max_new_tokens: int):
  model = nnx.merge(graphdef, state)
  b = tokens.shape[0]
  th = think(model, graphdef, state, head, tokens, positions, segment_ids, thoughts=thoughts, eot=eot,
             extra=max_new_tokens)
  base = jax.random.key(seed)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(b))

  def draw(logits, i):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
    s = sample_logits(logits, keys, **params)
    return s.tokens, (s.logprobs, s.sampling_logprobs)

  out, (lp, slp), lengths = decode_tokens(graphdef, state, th, draw, eos=eos, pad=pad, max_new_tokens=max_new_tokens)
  return out, lp, slp, lengths, th.thought_inputs, th.count


def _per_row(name: str, value, b: int, dtype) -> jnp.ndarray:
  arr = np.asarray(value, dtype)
  if arr.ndim == 0:
    arr = np.full((b,), arr, dtype)
  if arr.shape != (b,):
    raise ValueError(f"latent_sample: {name} must be a scalar or one value per prompt ({b}), got shape {arr.shape}")
  return jnp.asarray(arr)


def latent_sample(model, prompts: Sequence[Sequence[int]], *, thoughts: int, eot: int | None, eos: int, pad: int,
                  max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed: int = 0,
                  eot_head=None) -> LatentSample:
  """Sampled completions after continuous thoughts (Coconut decoding in the sampling package).

  Args:
    model: a :class:`jaxrl.models.Transformer` trained with continuous thoughts (``jaxrl.latent``).
    prompts: token ids per row, ending with ``<bot>`` (:func:`jaxrl.latent.prompt_ids`).
    thoughts: ``N`` continuous thoughts per row (0: plain decoding); with ``eot_head`` the most a row may think.
    eot: id of ``<eot>``, fed after the thoughts; None for a model trained without markers.
    eos: end-of-turn id (a row stops after it). pad: id written after the end.
    max_new_tokens: language tokens to generate at most.
    temperature, top_k, top_p, min_p: a scalar or one per prompt, as :func:`sample_logits` reads them
      (temperature 0: greedy, the tokens of :func:`jaxrl.latent.latent_generate`).
    seed: PRNG seed; row ``r``'s step ``i`` uses ``fold_in(fold_in(key(seed), r), i)``.
    eot_head: the ``<eot>`` classifier (:func:`jaxrl.latent.init_eot_head`); None: exactly ``thoughts``.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("latent_sample: prompts must be a non-empty list of non-empty token id lists")
  if thoughts < 0 or max_new_tokens < 1:
    raise ValueError(f"latent_sample: thoughts >= 0 and max_new_tokens >= 1, got {thoughts}, {max_new_tokens}")
  b = len(prompts)
  params = {"temperature": _per_row("temperature", temperature, b, np.float32),
            "top_k": _per_row("top_k", top_k, b, np.int32), "top_p": _per_row("top_p", top_p, b, np.float32),
            "min_p": _per_row("min_p", min_p, b, np.float32)}
  rows = left_pad([np.asarray(p, np.int32) for p in prompts], pad)
  graphdef, state = nnx.split(model)
  out, lp, slp, lengths, th, count = _sample(
      graphdef, state, eot_head, rows["tokens"], rows["positions"], rows["segment_ids"], params,
      jnp.asarray(seed, jnp.uint32), thoughts=thoughts, eot=eot, eos=eos, pad=pad, max_new_tokens=max_new_tokens)
  return LatentSample(tokens=np.asarray(out), logprobs=np.asarray(lp), sampling_logprobs=np.asarray(slp),
                      lengths=np.asarray(lengths), thoughts=np.asarray(th), n_thoughts=np.asarray(count))
