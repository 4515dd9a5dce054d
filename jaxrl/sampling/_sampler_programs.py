"""The whole-batch sampler's jitted device programs: prefill, decode loop, cache recompute and fork.

They act on :class:`jaxrl.sampling._rows.Rows` laid out as :mod:`jaxrl.sampling._sampler` describes
(row ``r``'s cache is its prompt then its generated tokens, position = slot, the last token pending).
:func:`sampler_programs` builds them once per (model structure, mesh, options); equal samplers share
them and their compiled shape buckets.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import _compile_target, models
from jaxrl.sampling import _decode, _latent
from jaxrl.sampling._requests import Stops
from jaxrl.sampling._rows import Rows, decode_loop, emit

_FORK_TAG = 0x5EED


class _Programs:
  """The jitted device programs for one (model structure, mesh, options); shared by equal samplers.

  ``counts`` counts traces per program: a trace happens exactly when a program compiles for a new
  input shape bucket.
  """

  def __init__(self, graphdef, cfg, mesh, rules, cache_dtype, decode_impl):
    self.graphdef, self.cfg, self.mesh, self.rules = graphdef, cfg, mesh, rules
    self.cache_dtype, self.decode_impl = cache_dtype, decode_impl
    self.counts: collections.Counter[str] = collections.Counter()
    self.prefill = jax.jit(self._prefill_program,
                           static_argnames=("gen_len", "k_top", "want_entropy", "max_thoughts"))
    self.decode = jax.jit(self._decode_program, donate_argnames=("rows",))
    self.recompute = jax.jit(self._recompute_program, donate_argnames=("rows",))
    self.fork = jax.jit(self._fork_program)

  def row_sharding(self, ndim: int) -> NamedSharding | None:
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, PartitionSpec(*self.rules.spec(("cache_batch",), self.mesh), *[None] * (ndim - 1)))

  def constrain_rows(self, rows: Rows) -> Rows:
    if self.mesh is None:
      return rows
    axes = models.KVCache.logical_axes()
    cache = jax.tree.map(
        lambda x, names: jax.lax.with_sharding_constraint(x, self.rules.sharding(names, self.mesh, x.shape)),
        rows.cache, axes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))

    def one(x):
      return jax.lax.with_sharding_constraint(x, self.row_sharding(x.ndim)) if x is not None else None
    rest = {f: one(getattr(rows, f)) for f in Rows._fields if f != "cache" and f != "keys"}
    return rows._replace(cache=cache, **rest)

  def _prefill_program(self, params, seed, *, prompt, prompt_len, src, active, request, sample, temperature,
                       top_k, top_p, min_p, max_new, gen_len, k_top, want_entropy, n_thoughts=None,
                       max_thoughts=0, rope=None, rope_delta=None, images=None):
    """Prefills every prompt's first ``p - 1`` tokens once and copies the cache to its sample rows.

    The last prompt token is left pending (``n_gen = 0``): the first decode step feeds it and samples
    token 0, so sampling is compiled once, inside the loop.

    Latent mode (``n_thoughts [U]``, at most the static ``max_thoughts``): prompt ``u`` is its tokens
    (ending with ``<bot>``), ``n_thoughts[u]`` placeholder slots, then ``<eot>``. Its tokens are
    prefilled, the continuous thoughts are fed into the placeholder slots
    (:func:`jaxrl.sampling._latent.feed_thoughts`), and ``<eot>`` is left pending.

    VLM: ``rope [U, P, 3]`` are the prompts' rotary positions and ``rope_delta [R]`` each sample row's
    decode offset; ``images`` (:class:`jaxrl.models.VisionInputs`, ``U`` rows) run through the tower once
    here, per prompt row, before the cache is copied to the sample rows.
    """
    self.counts["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    cfg = self.cfg
    u, p = prompt.shape
    r = src.shape[0]
    s = p + gen_len
    filled = prompt_len - 1 if n_thoughts is None else prompt_len - 1 - n_thoughts  # [U] tokens to prefill
    with jax.named_scope("prefill"):
      seg = (jnp.arange(p)[None, :] < filled[:, None]).astype(jnp.int32)  # [U, P]
      pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
      cache = models.KVCache.init(cfg, u, p, self.cache_dtype)
      embeds = _image_embeds(model, prompt, images, src=None, width=p)
      h, cache = model(prompt, positions=pos, segment_ids=seg, cache=cache, cache_start=jnp.zeros((u,), jnp.int32),
                       return_hidden=True, rope_positions=rope, **embeds)
    if max_thoughts:
      with jax.named_scope("thoughts"):  # thought j at slot = position filled + j: the row stays a contiguous prefix
        last = h[jnp.arange(u), filled - 1]  # [U, D]: hidden state of each prompt's <bot>
        cache, _, _, _ = _latent.feed_thoughts(self.graphdef, params, None, cache, last, slot=filled, pos=filled,
                                               thoughts=max_thoughts, limit=n_thoughts)

    def grow(x, axis):  # pad the slot axis to S, then copy prompt rows to sample rows
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, s - p)
      return jnp.take(jnp.pad(x, widths), src, axis=axis - 1)

    cache = models.KVCache(k=grow(cache.k, 2), v=grow(cache.v, 2), segment_ids=grow(cache.segment_ids, 1),
                           positions=grow(cache.positions, 1))
    base = jax.random.key(seed)
    keys = jax.vmap(lambda q, j: jax.random.fold_in(jax.random.fold_in(base, q), j))(request, sample)
    g = gen_len
    rows = Rows(
        cache=cache, prompt=prompt[src], prompt_len=prompt_len[src],
        tokens=jnp.zeros((r, g), jnp.int32), logprobs=jnp.zeros((r, g), jnp.float32),
        sampling_logprobs=jnp.zeros((r, g), jnp.float32), versions=jnp.full((r, g), -1, jnp.int32),
        entropy=jnp.zeros((r, g), jnp.float32) if want_entropy else None,
        top_ids=jnp.zeros((r, g, k_top), jnp.int32) if k_top else None,
        top_values=jnp.zeros((r, g, k_top), jnp.float32) if k_top else None,
        n_gen=jnp.zeros((r,), jnp.int32), done=~active, reason=jnp.zeros((r,), jnp.int32), keys=keys,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_new=max_new, rope_delta=rope_delta,
        prompt_rope=None if rope is None else rope[src], prompt_src=None if rope is None else src)
    return self.constrain_rows(rows)

  def _recompute_program(self, params, rows, vision=None):
    self.counts["recompute"] += 1
    model = nnx.merge(self.graphdef, params)
    with jax.named_scope("recompute_cache"):
      rows = rows._replace(cache=_recompute_cache(model, rows, self.cache_dtype, vision))
    return self.constrain_rows(rows)

  def _decode_program(self, params, rows, stops, budget, version):
    self.counts["decode"] += 1
    _, rows, _ = decode_loop(functools.partial(self._advance, stops=stops, version=version), params, None, rows,
                             budget)
    return rows

  def _fork_program(self, rows, src, child, real):
    self.counts["fork"] += 1
    take = lambda x: None if x is None else jnp.take(x, src, axis=0)
    cache = rows.cache
    new_cache = models.KVCache(k=jnp.take(cache.k, src, axis=1), v=jnp.take(cache.v, src, axis=1),
                               segment_ids=take(cache.segment_ids), positions=take(cache.positions))
    fields = {f: take(getattr(rows, f)) for f in Rows._fields if f != "cache"}
    keys = jax.vmap(lambda k, j: jax.random.fold_in(jax.random.fold_in(k, _FORK_TAG), j))(fields["keys"], child)
    fields.update(keys=keys, done=fields["done"] | ~real)
    return self.constrain_rows(Rows(cache=new_cache, **fields))

  def _advance(self, params, carry: None, rows: Rows, *, stops: Stops, version) -> tuple[None, Rows]:
    """One decode step of every row (:func:`decode_loop`'s ``advance``): feed its pending token through
    the dense cache in ``rows``, sample the next."""
    model = nnx.merge(self.graphdef, params)
    pos = rows.prompt_len + rows.n_gen - 1  # [R] slot of the pending token
    token = jnp.where(
        rows.n_gen > 0,
        jnp.take_along_axis(rows.tokens, jnp.maximum(rows.n_gen - 1, 0)[:, None], axis=1)[:, 0],
        jnp.take_along_axis(rows.prompt, jnp.maximum(pos, 0)[:, None], axis=1)[:, 0])
    if self.decode_impl == "kernel":
      logits, cache = _decode.decode_step(model, token, pos, rows.cache, mesh=self.mesh, rules=self.rules,
                                          rope_delta=rows.rope_delta)
    else:
      rope = None if rows.rope_delta is None else models.decode_rope_positions(pos[:, None], rows.rope_delta)
      out, cache = model(token[:, None], positions=pos[:, None], segment_ids=jnp.ones_like(pos)[:, None],
                         cache=rows.cache, cache_start=pos, rope_positions=rope)
      logits = out[:, 0]
    rows = self.constrain_rows(rows._replace(cache=cache))
    return carry, emit(rows, logits, version, stops)


@_compile_target.cache_per_platform(maxsize=64)
def sampler_programs(graphdef, cfg, mesh, rules, cache_dtype, decode_impl) -> _Programs:
  """The :class:`jaxrl.sampling.Sampler` programs for this model structure, mesh and options (cached:
  samplers with equal arguments share one set and its compiled buckets; the key also holds the platform
  compiled for, as :func:`jaxrl.sampling.engine_programs`'s)."""
  return _Programs(graphdef, cfg, mesh, rules, cache_dtype, decode_impl)


# --------------------------------------------------------------------------------------------------
# Pure device functions


def _image_embeds(model, prompts, images, *, src, width: int) -> dict:
  """``embeds``/``embeds_mask`` keywords of the model for ``prompts [U, P]`` with ``images`` (U rows: the
  tower runs once over them), taken to the rows ``src`` (None: the U rows) and padded to ``width``
  slots; ``{}`` without images. Only prompt tokens take image embeddings: a generated image-pad
  token is embedded as a token, as transformers' ``generate`` does."""
  if images is None:
    return {}
  embeds, mask = model.embed_images(prompts, images, annotate=False)  # [U, P, D], [U, P]
  if src is not None:
    embeds, mask = jnp.take(embeds, src, axis=0), jnp.take(mask, src, axis=0)
  pad = width - prompts.shape[1]
  return dict(embeds=jnp.pad(embeds, ((0, 0), (0, pad), (0, 0))), embeds_mask=jnp.pad(mask, ((0, 0), (0, pad))))


def _recompute_cache(model, rows: Rows, dtype, vision=None) -> models.KVCache:
  """KV cache of every row's sequence (prompt + generated) except the pending last token, in one prefill
  (a VLM's with its rotary positions: the prompt's, then ``slot + delta``; and its images' embeddings,
  ``vision = (prompts [U, P], VisionInputs)`` run through the tower once per prompt row)."""
  r, p = rows.prompt.shape
  s = rows.cache.k.shape[2]
  slot = jnp.arange(s)[None, :]  # [1, S]
  pl = rows.prompt_len[:, None]
  gen_idx = jnp.clip(slot - pl, 0, rows.tokens.shape[1] - 1)
  from_prompt = jnp.pad(rows.prompt, ((0, 0), (0, s - p)))  # [R, S]
  from_gen = jnp.take_along_axis(rows.tokens, gen_idx, axis=1)
  tokens = jnp.where(slot < pl, from_prompt, from_gen)  # [R, S]
  valid = slot < pl + rows.n_gen[:, None] - 1
  seg = valid.astype(jnp.int32)
  tokens = jnp.where(valid, tokens, 0)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))
  rope = None
  if rows.rope_delta is not None:
    from_prompt = jnp.pad(rows.prompt_rope, ((0, 0), (0, s - p), (0, 0)))  # [R, S, 3]
    rope = jnp.where((slot < pl)[..., None], from_prompt, models.decode_rope_positions(pos, rows.rope_delta))
  embeds = {} if vision is None else _image_embeds(model, vision[0], vision[1], src=rows.prompt_src, width=s)
  cache = models.KVCache.init(model.cfg, r, s, dtype)
  _, cache = model(tokens, positions=pos, segment_ids=seg, cache=cache, cache_start=jnp.zeros((r,), jnp.int32),
                   return_hidden=True, rope_positions=rope, **embeds)
  return cache

