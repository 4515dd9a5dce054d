"""Row state and results shared by the whole-batch sampler and the rollout engine: :class:`Rows` (the
decode-loop carry), :func:`emit` (sample one token per unfinished row, record it, check the stop rules),
:class:`SamplerState` (a paused generation) and :class:`SampleOutput` (what a generate call returns)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import models
from jaxrl.sampling._logits import entropy as _entropy
from jaxrl.sampling._logits import sample_logits
from jaxrl.sampling._logits import top_logprobs as _top_logprobs
from jaxrl.sampling._requests import ANY, NEVER, Stops


class Rows(NamedTuple):
  """Device state of every sample row (the decode-loop carry), of the whole-batch sampler (``R`` rows) and
  of the engine's decode slots (``R`` = ``num_slots``) alike. ``G`` is the completion width (the sampler's
  bucket, the engine's ``max_len``). Each path sets its own cache fields and leaves the other's None:
  the sampler ``cache`` and ``prompt`` (a dense cache, the prompt kept for a recompute), the engine
  ``tables`` and ``prompt_last`` (block tables into its paged pool, the pending prompt token). A VLM's
  rows also carry ``rope_delta`` (decode rotary positions ``p + delta``, :func:`jaxrl.models.decode_rope_positions`);
  the sampler's also the prompt's rotary positions and prompt row, for a recompute."""

  prompt_len: jax.Array  # [R] int32
  tokens: jax.Array  # [R, G] int32
  logprobs: jax.Array  # [R, G] float32
  sampling_logprobs: jax.Array  # [R, G] float32
  versions: jax.Array  # [R, G] int32
  n_gen: jax.Array  # [R] int32 generated tokens
  done: jax.Array  # [R] bool (the engine's free slots are done)
  reason: jax.Array  # [R] int32, index into FINISH_REASONS
  keys: jax.Array  # [R] PRNG keys
  temperature: jax.Array  # [R] float32
  top_k: jax.Array  # [R] int32
  top_p: jax.Array  # [R] float32
  min_p: jax.Array  # [R] float32
  max_new: jax.Array  # [R] int32
  entropy: jax.Array | None = None  # [R, G] float32
  top_ids: jax.Array | None = None  # [R, G, k] int32
  top_values: jax.Array | None = None  # [R, G, k] float32
  cache: models.KVCache | None = None  # sampler: k, v [L, R, S, K, H]
  prompt: jax.Array | None = None  # sampler: [R, P] int32
  tables: jax.Array | None = None  # engine: [R, MB] int32 block ids (free entries: the pool size)
  prompt_last: jax.Array | None = None  # engine: [R] int32, the last prompt token (pending before step 0)
  rope_delta: jax.Array | None = None  # VLM (M-RoPE): [R] int32, a token at position p rotates by p + delta
  prompt_rope: jax.Array | None = None  # VLM sampler: [R, P, 3] int32, the prompt's rotary positions
  prompt_src: jax.Array | None = None  # VLM sampler: [R] int32, the prompt row (of the state's images)



@dataclasses.dataclass(frozen=True)
class TopLogprobs:
  """The ``k`` most likely tokens at each generated position (OpenAI's ``top_logprobs``)."""

  ids: np.ndarray  # [N, max_new, k] int32 (pad after the end)
  logprobs: np.ndarray  # [N, max_new, k] float32: log_softmax(logits / T), untruncated


@dataclasses.dataclass(frozen=True)
class SampleOutput:
  """Completions of one :meth:`Sampler.generate` / :meth:`Sampler.resume` call, rows ``i·n + j``.

  ``tokens`` hold the pad id after ``lengths``; ``logprobs``, ``sampling_logprobs`` and ``entropy`` are
  0 there and ``versions`` -1. ``state`` is set when a step budget left rows unfinished (or when asked
  with ``return_state=True``); pass it to :meth:`Sampler.resume` or :meth:`Sampler.fork`.
  """

  tokens: np.ndarray  # [N, max_new] int32
  logprobs: np.ndarray  # [N, max_new] float32, see Sampler.generate
  sampling_logprobs: np.ndarray  # [N, max_new] float32
  lengths: np.ndarray  # [N] int32
  finish_reason: list[str]  # "eos" | "stop" | "length" ("interrupted" for unfinished rows)
  versions: np.ndarray  # [N, max_new] int32: policy version that produced each token
  prompt_lengths: np.ndarray  # [N] int32
  prompt_index: np.ndarray  # [N] int32: which input prompt each row continues
  texts: list[str] | None = None
  top_logprobs: TopLogprobs | None = None
  entropy: np.ndarray | None = None  # [N, max_new] float32
  state: SamplerState | None = None


@dataclasses.dataclass
class SamplerState:
  """A paused generation: every row's tokens, log-probs, versions, finish flags, keys and KV cache.

  Produced by :meth:`Sampler.generate` / :meth:`Sampler.fork`; consumed by :meth:`Sampler.resume`
  (which donates its cache: a state can be resumed once; fork first to branch).
  """

  rows: Rows
  stops: Stops
  num_rows: int
  max_new_tokens: int
  prompt_index: np.ndarray  # [N]
  stop_strings: tuple[str, ...]
  consumed: bool = False
  latent: bool = False  # generated in latent mode: the cache holds continuous thoughts
  vision: tuple | None = None  # (prompts [U, P], VisionInputs [U, ...]) on device, for a recompute

  @property
  def finished(self) -> np.ndarray:  # [N] bool
    return np.asarray(jax.device_get(self.rows.done))[:self.num_rows]

  @property
  def lengths(self) -> np.ndarray:  # [N] int32
    return np.asarray(jax.device_get(self.rows.n_gen))[:self.num_rows]


def emit(rows: Rows, logits: jax.Array, version: jax.Array, stops: Stops) -> Rows:
  """Samples token ``n_gen`` of every unfinished row from ``logits [R, V]`` and checks the stop rules."""
  r, g = rows.tokens.shape
  active = ~rows.done
  idx = rows.n_gen
  step_keys = jax.vmap(jax.random.fold_in)(rows.keys, idx)
  out = sample_logits(logits, step_keys, temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p,
                      min_p=rows.min_p)
  at = jnp.where(active, idx, g)  # out of bounds for finished rows: the write is dropped
  ar = jnp.arange(r)

  def put(buf, value):
    return buf.at[ar, at].set(value.astype(buf.dtype), mode="drop")

  upd = dict(tokens=put(rows.tokens, out.tokens), logprobs=put(rows.logprobs, out.logprobs),
             sampling_logprobs=put(rows.sampling_logprobs, out.sampling_logprobs),
             versions=put(rows.versions, jnp.broadcast_to(version, (r,))))
  if rows.entropy is not None:
    upd["entropy"] = put(rows.entropy, _entropy(logits, rows.temperature))
  if rows.top_ids is not None:
    ids, values = _top_logprobs(logits, rows.temperature, rows.top_ids.shape[-1])
    upd["top_ids"] = put(rows.top_ids, ids)
    upd["top_values"] = put(rows.top_values, values)
  n_gen = idx + active.astype(jnp.int32)
  tokens = upd["tokens"]
  ls = stops.seqs.shape[1]
  offs = n_gen[:, None] - ls + jnp.arange(ls)[None, :]  # [R, Ls] indices of the last Ls tokens
  window = jnp.take_along_axis(tokens, jnp.clip(offs, 0, g - 1), axis=1)
  window = jnp.where(offs >= 0, window, NEVER - 1)
  seqs = stops.seqs[None]  # [1, M, Ls]
  match = jnp.all((seqs == ANY) | (seqs == window[:, None, :]), axis=-1)  # [R, M]
  eos = jnp.any(match & (stops.kind == 1)[None], axis=-1)
  stop = jnp.any(match & (stops.kind == 2)[None], axis=-1)
  length = n_gen >= rows.max_new
  reason = jnp.where(eos, 1, jnp.where(stop, 2, jnp.where(length, 3, 0)))
  finished = active & (eos | stop | length)
  return rows._replace(n_gen=n_gen, done=rows.done | finished, reason=jnp.where(finished, reason, rows.reason), **upd)


def process_rows(out: SampleOutput, first_prompt: int, count: int, n: int) -> SampleOutput:
  """The rows of prompts ``first_prompt .. first_prompt + count - 1`` of a global output, with
  ``prompt_index`` relative to them. ``state`` stays the global state (every process holds it)."""
  rows = slice(first_prompt * n, (first_prompt + count) * n)
  cut = lambda a: None if a is None else a[rows]
  top = None if out.top_logprobs is None else TopLogprobs(ids=cut(out.top_logprobs.ids),
                                                          logprobs=cut(out.top_logprobs.logprobs))
  return dataclasses.replace(
      out, tokens=cut(out.tokens), logprobs=cut(out.logprobs), sampling_logprobs=cut(out.sampling_logprobs),
      lengths=cut(out.lengths), finish_reason=out.finish_reason[rows], versions=cut(out.versions),
      prompt_lengths=cut(out.prompt_lengths), prompt_index=cut(out.prompt_index) - first_prompt,
      texts=None if out.texts is None else out.texts[rows], top_logprobs=top, entropy=cut(out.entropy))


def decode_loop(advance, params, carry, rows: Rows, budget, *, early=None) -> tuple:
  """The decode loop of the sampler and the engine: ``carry, rows = advance(params, carry, rows)`` (one
  step of every row: feed its pending input, sample the next token with :func:`emit`) in a
  ``lax.while_loop`` until every row is done or ``budget`` steps ran; with ``early`` (a traced bool), it
  also stops after the step in which a row finishes. ``carry`` is what the step threads besides the rows
  (the engine's paged pool; None for the sampler, whose dense cache is in ``rows``); a path that feeds
  something other than the pending token (e.g. latent thoughts) plugs in its own ``advance``.

  Returns ``(carry, rows, steps run)``.
  """
  done0 = jnp.sum(rows.done)

  def cond(c):
    _, rows, step, _ = c
    go = (step < budget) & jnp.any(~rows.done)
    return go if early is None else go & (~early | (jnp.sum(rows.done) == done0))

  def body(c):
    carry, rows, step, params = c  # params ride in the carry: NNX modules cannot cross trace levels
    with jax.named_scope("decode_step"):
      carry, rows = advance(params, carry, rows)
    return carry, rows, step + 1, params

  carry, rows, steps, _ = jax.lax.while_loop(cond, body, (carry, rows, jnp.int32(0), params))
  return carry, rows, steps
