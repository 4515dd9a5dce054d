"""The rollout engine's jitted device programs: init, prefill, decode, install, copy, free, gather.

:class:`EnginePrograms` holds one set of programs for one (model structure, mesh, shapes) and is shared by
equal engines (:func:`engine_programs` memoizes it); :class:`jaxrl.sampling.Engine` is the host-side
scheduler that calls them. Also here: the paged-attention kernel a model's ``attention_impl`` maps to
(:func:`paged_impl_for`) and the shapes a prefill call runs at (:func:`context_bucket`,
:func:`prefill_batch_rows`), which :mod:`jaxrl.plan` uses to list the programs ahead of time.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import _compile_target, kernels, models
from jaxrl.sampling._requests import length_bucket
from jaxrl.sampling._rows import Rows, decode_loop, emit

_PAGED_IMPL = {"reference": "reference", "pallas_triton": "pallas_triton", "pallas_tpu": "pallas_tpu"}


def paged_impl_for(attention_impl: str) -> str:
  """The paged-attention kernel the engine uses for a model's ``attention_impl`` (``auto`` when it has no
  paged twin: the backend picks)."""
  return _PAGED_IMPL.get(attention_impl, "auto")


class EnginePrograms:
  """The engine's jitted programs for one (model structure, mesh, shapes); shared by equal engines."""

  def __init__(self, graphdef, cfg, mesh, rules, cache_dtype, paged_impl, num_slots, max_len, max_blocks,
               num_blocks, block_size, row_tile, top_logprobs=0, entropy=False):
    self.row_tile = row_tile
    self.k_top, self.want_entropy = top_logprobs, entropy
    self.graphdef, self.cfg, self.mesh, self.rules = graphdef, cfg, mesh, rules
    self.cache_dtype, self.paged_impl = cache_dtype, paged_impl
    self.s, self.g, self.mb, self.nb, self.bs = num_slots, max_len, max_blocks, num_blocks, block_size
    self.counts: collections.Counter[str] = collections.Counter()
    page_shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    self.page_sharding = None if mesh is None else rules.sharding(models.PAGE_AXES, mesh, page_shape)
    slots_abs = jax.eval_shape(self.empty_slots)
    self.slot_sharding = None if mesh is None else Rows(
        *(None if x is None else self._row_sharding(x.ndim) for x in slots_abs))
    pages_sh = None if mesh is None else (self.page_sharding, self.page_sharding)
    jit = jax.jit
    self.init = jit(self._init, out_shardings=None if mesh is None else (pages_sh, self.slot_sharding))
    # What the host reads back (the per-slot summary of a decode call, gathered rows) is replicated, so
    # every process of a multi-process mesh reads it from its own devices (see Engine's module docstring).
    rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    self.decode = jit(self._decode, donate_argnames=("pages", "slots"),
                      out_shardings=None if mesh is None else (pages_sh, self.slot_sharding, rep))
    self.prefill = jit(self._prefill, donate_argnames=("pages",), out_shardings=pages_sh)
    self.embed = jit(self._embed)
    self.copy = jit(self._copy, donate_argnames=("pages",), out_shardings=pages_sh)
    self.install = jit(self._install, donate_argnames=("slots",), out_shardings=self.slot_sharding)
    self.set_tables = jit(self._set_tables, donate_argnames=("slots",), out_shardings=self.slot_sharding)
    self.free = jit(self._free, donate_argnames=("slots",), out_shardings=self.slot_sharding)
    self.gather = jit(self._gather, out_shardings=rep)

  def _row_sharding(self, ndim):
    return NamedSharding(self.mesh, PartitionSpec(*self.rules.spec(("cache_batch",), self.mesh, (self.s,)),
                                                  *[None] * (ndim - 1)))

  def empty_slots(self) -> Rows:
    """Every slot free (done, no blocks): the slot state the engine starts from (its shapes are the decode
    program's, e.g. for ahead-of-time compilation)."""
    s, g = self.s, self.g
    return Rows(tables=jnp.full((s, self.mb), self.nb, jnp.int32), prompt_len=jnp.ones((s,), jnp.int32),
                  prompt_last=jnp.zeros((s,), jnp.int32), tokens=jnp.zeros((s, g), jnp.int32),
                  logprobs=jnp.zeros((s, g), jnp.float32), sampling_logprobs=jnp.zeros((s, g), jnp.float32),
                  versions=jnp.full((s, g), -1, jnp.int32), n_gen=jnp.zeros((s,), jnp.int32),
                  done=jnp.ones((s,), bool), reason=jnp.zeros((s,), jnp.int32),
                  keys=jax.random.split(jax.random.key(0), s), temperature=jnp.zeros((s,), jnp.float32),
                  top_k=jnp.zeros((s,), jnp.int32), top_p=jnp.ones((s,), jnp.float32),
                  min_p=jnp.zeros((s,), jnp.float32), max_new=jnp.ones((s,), jnp.int32),
                  entropy=jnp.zeros((s, g), jnp.float32) if self.want_entropy else None,
                  top_ids=jnp.zeros((s, g, self.k_top), jnp.int32) if self.k_top else None,
                  top_values=jnp.zeros((s, g, self.k_top), jnp.float32) if self.k_top else None,
                  rope_delta=jnp.zeros((s,), jnp.int32) if self.cfg.mrope_section is not None else None)

  def _init(self):
    cfg = self.cfg
    shape = (cfg.num_layers, self.nb, self.bs, cfg.num_kv_heads, cfg.head_dim)
    return (jnp.zeros(shape, self.cache_dtype), jnp.zeros(shape, self.cache_dtype)), self.empty_slots()

  # -- slot state --------------------------------------------------------------------------------

  def _install(self, slots: Rows, f: dict) -> Rows:
    self.counts["install"] += 1
    idx = f["slot"]
    keys = jax.vmap(lambda sd, q, j: jax.random.fold_in(jax.random.fold_in(jax.random.key(sd), q), j))(
        f["seed"], f["request"], f["sample"])
    def put(buf, v):
      if v.ndim >= 2 and v.shape[1] < buf.shape[1]:  # generated-so-far columns, uploaded narrow
        widths = ((0, 0), (0, buf.shape[1] - v.shape[1])) + ((0, 0),) * (v.ndim - 2)
        v = jnp.pad(v, widths, constant_values=-1 if buf is slots.versions else 0)
      return buf.at[idx].set(v.astype(buf.dtype), mode="drop")

    upd = {name: put(getattr(slots, name), f[name]) for name in
           ("tables", "prompt_len", "prompt_last", "tokens", "logprobs", "sampling_logprobs", "versions", "n_gen",
            "temperature", "top_k", "top_p", "min_p", "max_new", "entropy", "top_ids", "top_values", "rope_delta")
           if getattr(slots, name) is not None}
    upd["done"] = slots.done.at[idx].set(False, mode="drop")
    upd["reason"] = slots.reason.at[idx].set(0, mode="drop")
    upd["keys"] = slots.keys.at[idx].set(keys, mode="drop")
    return slots._replace(**upd)

  def _set_tables(self, slots: Rows, idx, tables) -> Rows:
    self.counts["set_tables"] += 1
    return slots._replace(tables=slots.tables.at[idx].set(tables, mode="drop"))

  def _free(self, slots: Rows, idx) -> Rows:
    self.counts["free"] += 1
    return slots._replace(done=slots.done.at[idx].set(True, mode="drop"),
                          tables=slots.tables.at[idx].set(self.nb, mode="drop"))

  def _gather(self, slots: Rows, idx) -> dict:
    self.counts["gather"] += 1
    idx = jnp.minimum(idx, self.s - 1)
    out = dict(n_gen=slots.n_gen[idx], tokens=slots.tokens[idx], logprobs=slots.logprobs[idx],
               sampling_logprobs=slots.sampling_logprobs[idx], versions=slots.versions[idx])
    for name in ("entropy", "top_ids", "top_values"):
      if getattr(slots, name) is not None:
        out[name] = getattr(slots, name)[idx]
    return out

  # -- cache -------------------------------------------------------------------------------------

  def _copy(self, pages, src, dst):
    self.counts["copy"] += 1
    k, v = pages
    return (k.at[:, dst].set(k[:, src], mode="drop"), v.at[:, dst].set(v[:, src], mode="drop"))

  def _embed(self, params, images):
    """The vision tower over ``images`` (:class:`jaxrl.models.VisionInputs`, ``A`` prompt rows): merged
    embeddings ``[A, M, D]`` per row in image-token order, computed once per prompt and sliced into the
    prefill chunks (``feats`` of :meth:`_prefill`)."""
    self.counts["embed"] += 1
    model = nnx.merge(self.graphdef, params)
    return model.visual(images.pixel_values, images.layout, placement=model.placement,  # Pallas under shard_map
                        attention_impl=self.cfg.attention_impl, interpret=self.cfg.attention_interpret)

  def _prefill(self, params, pages, tokens, n_cache, tables, start=None, rope=None, feats=None, feat_idx=None,
               feat_mask=None):
    """Runs ``tokens [U, T]``, positions ``start + arange(T)`` of each row's sequence (the first
    ``n_cache`` positions are valid), through the model and writes their keys/values into the row's
    blocks ``tables [U, P / bs]`` (entries ``>= NB`` are dropped). Keys/values of positions before
    ``start`` (earlier chunks) are read from those blocks. ``start`` (multiples of ``bs``, default 0)
    keeps ``start + T <= P``; a whole-sequence prefill is ``T = P``, ``start = 0``.

    Row-local: on a mesh the rows are split over the pool's shards like the slots (``U`` a multiple of
    the shards; row ``u`` lives on shard ``u // (U / shards)`` and its blocks must be that shard's,
    see :meth:`Engine._prefill_chunks`), and each layer's context read, attention and cache write run
    under ``shard_map`` (:meth:`_prefill_attend_fn`), so a device gathers only its own rows' blocks,
    one layer at a time. Attention runs over a ``P``-slot context whatever ``T``, through
    :func:`jaxrl.kernels.attention` (the model's kernel: flash-style on TPU/GPU). With ``row_tile``
    (the reproducibility switch) the queries run in a scan over tiles of one block, so a sequence
    prefilled in chunks gets bit for bit the keys/values of one piece; otherwise they differ by XLA's
    shape-dependent rounding (about one ulp).

    VLM: ``rope [U, T, 3]`` are the chunk's rotary positions; ``feats [U, M, D]`` (:meth:`_embed`'s rows)
    replace the embedding of the tokens where ``feat_mask [U, T]``, token ``t`` taking row
    ``feat_idx[u, t]``: an image that straddles chunks is embedded once and sliced.
    """
    self.counts["prefill"] += 1
    u, t = tokens.shape
    axes = self._cache_axes()
    shards = axes.shards
    if u % shards:
      raise ValueError(f"engine prefill: {u} rows do not split over the pool's {shards} shards (rows must be "
                       "a multiple of the shards, each shard's rows holding only its blocks)")
    start = jnp.zeros((u,), jnp.int32) if start is None else start.astype(jnp.int32)
    n_cache = n_cache.astype(jnp.int32)
    paged = self._prefill_attend_fn()
    row_spec = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(axes.batch or None, None, None))

    def run(pages, params, tokens, start, per_token):  # one piece of T' tokens per row, starting at ``start``
      model = nnx.merge(self.graphdef, params)
      pos = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [U, T']
      seg = (pos < n_cache[:, None]).astype(jnp.int32)
      embeds = {}
      if feats is not None:
        rows = jnp.take_along_axis(feats, per_token["feat_idx"][..., None], axis=1)  # [U, T', D]
        embeds = dict(embeds=rows, embeds_mask=per_token["feat_mask"])
      x = model.embed_tokens(tokens, **embeds)  # [U, T', D]
      if row_spec is not None:  # the rows' activations live where their blocks do
        x = jax.lax.with_sharding_constraint(x, row_spec)

      def attend(k_l, v_l):  # the layer's context read, attention and cache write, for Attention.__call__
        def fn(q, k, v):  # [U, T', N, H], [U, T', K, H] x2
          out, k_l2, v_l2 = paged(q, k, v, k_l, v_l, tables, pos, seg, start, n_cache)
          return out, (k_l2, v_l2)
        return fn

      _, pages = model.run_layers(x, positions=pos, kv=pages, attend=attend, annotate=False,
                                  rope_positions=per_token.get("rope"))
      return pages

    per_token = {k: v for k, v in dict(rope=rope, feat_idx=feat_idx, feat_mask=feat_mask).items() if v is not None}
    with jax.named_scope("prefill"):
      if not self.row_tile:
        return run(pages, params, tokens, start, per_token)
      # reproducible: queries in tiles of one block, so every chunking computes the same tiles

      def tile(carry, i):
        pages, params = carry  # params ride in the carry: NNX modules cannot cross trace levels
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, i * self.bs, self.bs, axis=1)
        part = {k: cut(v) for k, v in per_token.items()}
        return (run(pages, params, cut(tokens), start + i * self.bs, part), params), None

      (pages, _), _ = jax.lax.scan(tile, (pages, params), jnp.arange(t // self.bs))
      return pages

  def _cache_axes(self) -> models.CacheAxes:
    """The mesh axes the slots and the pool's blocks are split over (when they divide both) and those
    the kv heads are split over (:func:`jaxrl.models.cache_axes`)."""
    return models.cache_axes(self.cfg, self.mesh, self.rules, self.s, self.nb)

  def _prefill_attend_fn(self):
    """``(q, k, v, k_pool, v_pool, tables, pos, seg, start, n_cache) -> (out, k_pool, v_pool)`` for one
    layer of a prefill chunk (``q [U, T, N, H]``, ``k, v [U, T, K, H]``, pools ``[NB, bs, K, H]``): writes
    the chunk's blocks (those below ``n_cache``) into the pool, reads the row's context (the slots up to
    the chunk's end) out of its blocks and attends over the ``P`` slots.
    Under ``shard_map`` over the pool's shards each device does this for its own rows and blocks only."""
    bs, cfg = self.bs, self.cfg
    dt = cfg.jnp_dtype

    def local(q, k, v, k_pool, v_pool, tables, pos, seg, start, n_cache, first):
      u, t = q.shape[:2]
      mb = tables.shape[1]
      p = mb * bs
      nb_local = k_pool.shape[0]
      loc = tables - first  # the shard's own blocks are [0, nb_local); anything else is not this row's
      # First the chunk's blocks (whole blocks: ``start`` and ``T`` are multiples of ``bs``), those holding
      # cached positions (< n_cache). Writing before reading keeps the donated pool in place (reading
      # first, the CPU compiler copied it).
      k_pool = models.write_page_blocks(k_pool, k, loc, start, n_cache)
      v_pool = models.write_page_blocks(v_pool, v, loc, start, n_cache)
      slot = jnp.arange(p, dtype=jnp.int32)[None, :]  # [1, P]
      before = slot < start[:, None]  # [U, P]: cached by earlier chunks
      upto = (slot < start[:, None] + t)[:, :, None, None]  # earlier chunks and this one

      def context(pool):  # the row's P slots out of its blocks; zeros after the chunk
        got = jnp.take(pool, jnp.clip(loc, 0, nb_local - 1), axis=0).reshape(u, p, *pool.shape[2:])
        return jnp.where(upto, got, jnp.zeros((), pool.dtype)).astype(dt)

      # Slots of the chunk past n_cache (padding, or blocks not written) are masked by their segment id 0.
      kv_seg = models.write_rows(before.astype(jnp.int32), seg, start)  # [U, P]
      kv_pos = jnp.broadcast_to(slot, (u, p))
      out = kernels.attention(q, context(k_pool), context(v_pool), segment_ids=(seg, kv_seg),
                              positions=(pos, kv_pos), impl=cfg.attention_impl, interpret=cfg.attention_interpret)
      return out, k_pool, v_pool

    if self.mesh is None:
      return lambda *a: local(*a, jnp.int32(0))
    axes = self._cache_axes()
    nb_local = self.nb // axes.shards
    bs_, hs = axes.batch or None, axes.heads or None

    def sharded(*a):
      first = (jax.lax.axis_index(axes.batch) * nb_local).astype(jnp.int32) if axes.batch else jnp.int32(0)
      return local(*a, first)

    act = PartitionSpec(bs_, None, hs, None)  # q, k, v [U, T, heads, H]
    pool_spec = PartitionSpec(bs_, None, hs, None)  # [NB, bs, K, H]
    rows2, rows1 = PartitionSpec(bs_, None), PartitionSpec(bs_)
    return jax.shard_map(sharded, mesh=self.mesh,
                         in_specs=(act, act, act, pool_spec, pool_spec, rows2, rows2, rows2, rows1, rows1),
                         out_specs=(act, pool_spec, pool_spec), check_vma=False)

  # -- decode ------------------------------------------------------------------------------------

  def _decode(self, params, pages, slots: Rows, stops, version, budget, early):
    """Up to ``budget`` decode steps of every active slot; with ``early``, stops after the step in which
    a row finishes (so a waiting row gets its slot at once)."""
    self.counts["decode"] += 1

    def advance(params, pages, slots):
      t = self.row_tile
      if not t:
        return self._advance(params, pages, slots, stops, version)
      # fixed tiles of rows in a scan: every row's arithmetic has the same shapes whatever S is
      tile = lambda pages, part: self._advance(params, pages, part, stops, version)
      split = lambda x: x.reshape((self.s // t, t) + x.shape[1:])
      pages, tiled = jax.lax.scan(tile, pages, jax.tree.map(split, slots))
      return pages, jax.tree.map(lambda x: x.reshape((self.s,) + x.shape[2:]), tiled)

    pages, slots, steps = decode_loop(advance, params, pages, slots, budget, early=early)
    return pages, slots, dict(n_gen=slots.n_gen, done=slots.done, reason=slots.reason, ran=steps)

  def _attend_fn(self):
    """``(q, k_new, v_new, k_pool, v_pool, tables, pos, active) -> (out, k_pool, v_pool)`` for one layer:
    writes the new token's key/value at its slot's block, then paged attention; sharded with shard_map."""
    impl, mesh = self.paged_impl, self.mesh

    def local(q, k_new, v_new, k_pool, v_pool, tables, pos, active, first):
      tables = tables - first  # the shard's own blocks are [0, NB / shards)
      k_pool = models.write_page_tokens(k_pool, k_new, tables, pos, active)
      v_pool = models.write_page_tokens(v_pool, v_new, tables, pos, active)
      dt = q.dtype
      out = kernels.paged_decode_attention(q, k_pool.astype(dt), v_pool.astype(dt), tables,
                                           jnp.where(active, pos + 1, 0), impl=impl)
      return out, k_pool, v_pool

    if mesh is None:
      return lambda *a: local(*a, jnp.int32(0))
    axes = self._cache_axes()
    bs_, hs = axes.batch or None, axes.heads or None
    nb_local = self.nb // axes.shards

    def sharded(q, k_new, v_new, k_pool, v_pool, tables, pos, active):
      first = (jax.lax.axis_index(axes.batch) * nb_local).astype(jnp.int32) if axes.batch else jnp.int32(0)
      return local(q, k_new, v_new, k_pool, v_pool, tables, pos, active, first)

    q_spec = PartitionSpec(bs_, hs, None)
    pool_spec = PartitionSpec(bs_, None, hs, None)
    row = PartitionSpec(bs_)
    return jax.shard_map(sharded, mesh=mesh,
                         in_specs=(q_spec, q_spec, q_spec, pool_spec, pool_spec, PartitionSpec(bs_, None), row, row),
                         out_specs=(q_spec, pool_spec, pool_spec), check_vma=False)

  def _advance(self, params, pages, slots: Rows, stops, version) -> tuple:
    """One decode step of the given slots: feed each active row's pending token, sample the next."""
    active = ~slots.done
    pos = slots.prompt_len + slots.n_gen - 1
    prev = jnp.take_along_axis(slots.tokens, jnp.maximum(slots.n_gen - 1, 0)[:, None], axis=1)[:, 0]
    token = jnp.where(slots.n_gen > 0, prev, slots.prompt_last)
    rope = None if slots.rope_delta is None else models.decode_rope_positions(pos[:, None], slots.rope_delta)
    logits, pages = self._step(nnx.merge(self.graphdef, params), token, pos, active, pages, slots.tables, rope)
    return pages, emit(slots, logits, version, stops)

  def _step(self, model, token, pos, active, pages, tables, rope=None):
    """One token per slot through the model's path (:meth:`jaxrl.models.Transformer.run`), each layer's
    attention writing into and reading from the paged pool."""
    paged = self._attend_fn()

    def attend(k_l, v_l):  # the layer's cache write and paged attention, for Attention.__call__
      def fn(q, k, v):  # [S, 1, N, H], [S, 1, K, H] x2
        out, k_l2, v_l2 = paged(q[:, 0], k[:, 0], v[:, 0], k_l, v_l, tables, pos, active)
        return out[:, None], (k_l2, v_l2)
      return fn

    logits, pages = model.run(token[:, None], positions=pos[:, None], kv=pages, attend=attend, annotate=False,
                              rope_positions=rope)
    return logits[:, 0], pages


@functools.lru_cache(maxsize=64)
def context_bucket(n: int, min_bucket: int, block_size: int, max_blocks: int) -> int:
  """The attention context (cache slots) a prefill of ``n`` tokens runs over: the power-of-two bucket, at
  least one block, and never more than the row's ``max_blocks`` blocks -- a 34,814-token recompute at
  ``max_len`` 34,816 runs over 34,816 slots, not 65,536 (half the prefill's activations)."""
  return min(max(length_bucket(n, minimum=min_bucket), block_size), max_blocks * block_size)


def prefill_batch_rows(prefill_rows: int, shards: int) -> int:
  """Rows of one prefill call: ``prefill_rows`` rounded up to a multiple of the pool's shards, so that
  every shard prefills the same number of its own rows (the row-local prefill, :meth:`EnginePrograms._prefill`)."""
  return -(-prefill_rows // shards) * shards


@_compile_target.cache_per_platform(maxsize=64)
def engine_programs(graphdef, cfg, mesh, rules, cache_dtype, paged_impl, num_slots, max_len, max_blocks, num_blocks,
                    block_size, row_tile, top_logprobs: int = 0, entropy: bool = False) -> EnginePrograms:
  """The engine programs for one (model structure, mesh, rules, settings), memoized like the sampler's:
  engines of equal settings (each paged ``Sampler.generate`` call builds one) share compiled programs. The key
  also holds the platform compiled for (:func:`jaxrl._compile_target.compile_platform`): the programs trace
  platform-dependent choices (the ``"auto"`` kernels), so a plan for a TPU target never reuses the host's."""
  return EnginePrograms(graphdef, cfg, mesh, rules, cache_dtype, paged_impl, num_slots, max_len, max_blocks, num_blocks,
                   block_size, row_tile, top_logprobs, entropy)
