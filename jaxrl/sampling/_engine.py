"""The rollout engine: a fixed set of decode slots over a paged KV cache, with continuous batching.

Memory. The KV cache is one pool of ``NB`` blocks of ``block_size`` slots per layer
(``k, v [L, NB, bs, K, H]``), allocated once from a budget; it never grows with the number of
requests. Every decode slot has a block table (``[num_slots, MB]``, ``MB = ceil(max_len / bs)``)
naming the blocks that hold its sequence; a row holds ``ceil(cached tokens / bs)`` blocks plus at
most one block of look-ahead for the steps of the current decode call.

Schedule (host side, between device programs):
  1. finished rows leave their slots, their blocks return to the pool and their completions are
     streamed out;
  2. waiting rows are admitted into free slots: the prompts of newly admitted groups are prefilled
     (one jitted program per (rows, length) bucket; a group's ``n`` samples share the prompt's full
     blocks and copy its last, partial block), and preempted or interrupted rows recompute the cache
     of their prompt plus the tokens they already generated; with ``prefill_chunk`` each round runs
     one chunk of every such row, so a long prompt is prefilled across rounds while the running rows
     keep decoding;
  3. every running row gets the blocks its next steps write; when the pool is empty the most
     recently admitted row is *preempted* (blocks freed, tokens kept, requeued at the front, its
     cache recomputed when it is readmitted) — never a failure, never a truncation;
  4. one jitted decode call (``num_slots`` rows, cache and slot state donated) runs up to
     ``steps_per_call`` steps, and stops early as soon as a row finishes while rows are waiting.

Each row follows the sampler's invariant (:mod:`jaxrl.sampling._sampler`): the cache holds every
token of the sequence but the last, which is pending and fed at the next step; token ``i`` is drawn
with ``fold_in(fold_in(fold_in(key(seed), request_id), sample), i)`` through
:func:`jaxrl.sampling.sample_logits`, so a row's draws do not depend on its slot, the slot count,
the other rows, preemption or interruption.

Sharding. Slots (and their state) are split over the cache-batch mesh axes, the pool's block axis
likewise (a slot only gets blocks of its own shard, see :class:`BlockPool`), kv heads over the
tensor axis; the decode's and the prefill's per-layer cache reads, writes and attention run under
``shard_map``, so a device only touches its own rows' blocks (a prefill call's rows are grouped by
shard, ``prefill_rows`` rounded up to a multiple of the shards).

Several processes. On a mesh that spans processes every process runs the whole schedule above over
the same global request list, so all of them issue the same jitted programs with the same host
inputs (block tables, slot indices, prompts) in the same order: one SPMD program per call. The
schedule only depends on the requests and on what the decode calls return, and everything the host
reads back (the per-slot summary of a decode call, the rows gathered at retirement or preemption) is
a replicated output, which each process reads from its own devices. :meth:`Engine.generate` gathers
every process's prompts (equal counts, as :meth:`Sampler.generate`), schedules all of them and returns
each process its own rows; :meth:`Engine.submit` must be given the same requests on every process
(a digest is compared). The cost is host work on every process for every row, and rows cross
processes only as the small replicated read-backs.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl import _compile_target, kernels, models
from jaxrl.models import cache_block_bytes, cache_shards
from jaxrl.sampling import _layers, _vision
from jaxrl.sampling._engine_pool import pool_blocks
from jaxrl.sampling._engine_programs import engine_programs, paged_impl_for
from jaxrl.sampling._engine_rows import (
    Completion,
    EngineMetrics,
    PrefillJob,
    Row,
    RowGroup,
    check_request,
    check_same_everywhere,
    sample_output,
)
from jaxrl.sampling._engine_schedule import Scheduler
from jaxrl.sampling._paged import BlockPool, blocks_for
from jaxrl.sampling._requests import (
    Request,
    build_stops,
    check_counts,
    check_token,
    encode_prompts,
    gather_prompts,
    prompt_args,
    special_tokens,
)
from jaxrl.sampling._rows import SampleOutput, process_rows
from jaxrl.sharding import LogicalRules


class Engine(Scheduler):
  """Continuous-batching rollout engine over a paged KV cache (see the module docstring).

  Example::

      engine = sampling.Engine(model, tokenizer, mesh=mesh, num_slots=64, kv_cache_bytes=8 << 30, max_len=4096)
      out = engine.generate(prompts, n=8, max_new_tokens=2048, temperature=1.0, seed=0)  # a SampleOutput
      engine.submit([sampling.Request(prompt=ids, n=4, max_new_tokens=512, request_id=7)])
      for c in engine.completions():        # each row as soon as it finishes
        score(c.tokens, c.logprobs, c.versions, c.finish_reason)
      engine.update_weights(new_params_model, version=3)   # between decode steps

  Args:
    model: the model (split once; new weights of the same shapes never recompile).
    tokenizer: a transformers tokenizer (optional with token-id prompts).
    mesh, rules: slots and cache blocks over the ``cache_batch`` mesh axes, kv heads over
      ``cache_kv_heads`` (default :meth:`LogicalRules.default`).
    num_slots: decode slots (rows decoded together); a multiple of the cache-batch shards.
    max_len: most tokens per row (prompt + completion).
    block_size: cache slots per block.
    kv_cache_bytes: cache budget *per device*; the pool gets as many blocks as fit. Exclusive with
      ``num_blocks`` (the pool size over all devices) and ``kv_cache_fraction`` (of the device's free
      memory, where the backend reports it).
    steps_per_call: most decode steps per device call (a call also ends when a row finishes).
    prefill_rows: rows per prefill program (prompts are prefilled in groups of this many); on a mesh
      rounded up to a multiple of the cache-batch shards, each shard prefilling its own rows.
    prefill_chunk: prefill long sequences this many tokens (a multiple of ``block_size``) per
      scheduling round, with a decode call of the running rows between chunks, so admitting a long
      prompt does not stall decoding; ``None``: whole sequences. Results do not depend on it.
    eos_token_ids, pad_token_id, cache_dtype, add_special_tokens, version, unstack_layers: as in
      :class:`jaxrl.sampling.Sampler`.
    paged_impl: paged attention implementation (``"auto"`` or one of
      :data:`jaxrl.kernels.PAGED_IMPLS`); default from the model's ``attention_impl``.
    max_top_logprobs: most ``Request.top_logprobs`` (``generate(return_top_logprobs=)``); the slots then
      hold ``[num_slots, max_len, k]`` ids and log-probs, and every decode step takes the top ``k``.
    entropy: compute the per-token entropy (``Request.entropy``, ``generate(return_entropy=True)``).
    row_tile: decode (and sample) the slots in a scan over tiles of this many rows (a divisor of
      ``num_slots``; on a mesh, a multiple of the cache-batch shards). With ``row_tile=1`` every
      row's arithmetic has the same shapes whatever ``num_slots`` and the slot it lands in, so
      results are bit-identical across slot counts (XLA's reductions and matmuls round differently
      by batch size and row position, by ~1 ulp); costs one pass over the weights per tile, so it
      is a reproducibility switch, not a serving setting.
    placed: ``model`` is already the sampling copy (compute dtype, unstacked, on the mesh), e.g. a
      :class:`Sampler`'s own: used as is, and :meth:`update_weights` expects models of that structure.
  """

  def __init__(self, model, tokenizer=None, *, mesh: Mesh | None = None, rules: LogicalRules | None = None,
               num_slots: int = 8, max_len: int = 2048, block_size: int = 16, kv_cache_bytes: int | None = None,
               num_blocks: int | None = None, kv_cache_fraction: float | None = None, steps_per_call: int = 8,
               prefill_rows: int = 4, eos_token_ids: Sequence[int] | None = None, pad_token_id: int | None = None,
               cache_dtype: str | None = None, add_special_tokens: bool = True, version: int = 0,
               unstack_layers: bool | None = None, paged_impl: str | None = None, min_bucket: int = 8,
               row_tile: int | None = None, prefill_chunk: int | None = None, max_top_logprobs: int = 0,
               entropy: bool = False, placed: bool = False):
    _check_settings(model.cfg.vocab_size, num_slots=num_slots, max_len=max_len, block_size=block_size,
                    steps_per_call=steps_per_call, prefill_rows=prefill_rows, row_tile=row_tile,
                    prefill_chunk=prefill_chunk, max_top_logprobs=max_top_logprobs,
                    budgets=(kv_cache_bytes, num_blocks, kv_cache_fraction))
    self.prefill_chunk = prefill_chunk
    self.max_top_logprobs, self.entropy = max_top_logprobs, bool(entropy)
    self.cfg = model.cfg
    self.tokenizer = tokenizer
    self.mesh = mesh
    # The processes the mesh spans: several run one schedule together; a process-local mesh (the asynchronous
    # trainer's rollout sub-mesh on several processes) runs only local programs.
    self._procs = len({d.process_index for d in mesh.devices.flat}) if mesh is not None else 1
    self.rules = rules or LogicalRules.default()
    self.max_len = max_len
    self.min_bucket = min_bucket
    self.add_special_tokens = add_special_tokens
    self.cache_dtype = jnp.dtype(cache_dtype or self.cfg.dtype)
    self.block_size = block_size
    self.steps_per_call = steps_per_call
    self.prefill_rows = prefill_rows
    self.eos_token_ids, self.pad_token_id = special_tokens(
        tokenizer, eos_token_ids, pad_token_id, functools.partial(check_token, tokenizer, self.cfg.vocab_size))
    self.unstack_layers = (_compile_target.compile_platform() == "cpu" if unstack_layers is None
                           else bool(unstack_layers))
    self.paged_impl = paged_impl or paged_impl_for(self.cfg.attention_impl)
    if self.paged_impl not in kernels.PAGED_IMPLS:
      raise ValueError(f"paged_impl: {self.paged_impl!r} is not one of {list(kernels.PAGED_IMPLS)}")

    self.dp, tp = cache_shards(self.cfg, mesh, self.rules)
    self.num_slots = num_slots
    self.max_blocks = blocks_for(max_len, block_size)
    self.block_bytes = cache_block_bytes(self.cfg, block_size, self.cache_dtype)
    self.num_blocks = pool_blocks(kv_cache_bytes=kv_cache_bytes, num_blocks=num_blocks,
                                  kv_cache_fraction=kv_cache_fraction, mesh=mesh, procs=self._procs,
                                  block_bytes=self.block_bytes, dp=self.dp, tp=tp, num_slots=num_slots,
                                  max_len=max_len, block_size=block_size)
    self.kv_cache_bytes_per_device = self.num_blocks // self.dp * (self.block_bytes // tp)
    self._place_model(model, placed=placed, version=version, row_tile=row_tile)
    self._init_schedule()

  def _place_model(self, model, *, placed: bool, version: int, row_tile: int | None) -> None:
    """Splits the model (placed first, unless ``placed``) into the engine's graphdef and params, and gets the
    programs for it (shared by equal engines) and the empty pool and slots they start from."""
    self.source_graphdef = nnx.graphdef(model)
    self._given_placed = bool(placed)
    self.graphdef, self.params = nnx.split(model if placed else self._placed(model))
    self.version = int(version)
    self._programs = engine_programs(self.graphdef, nnx.merge(self.graphdef, self.params).cfg, self.mesh, self.rules,
                                     self.cache_dtype, self.paged_impl, self.num_slots, self.max_len,
                                     self.max_blocks, self.num_blocks, self.block_size, row_tile,
                                     self.max_top_logprobs, self.entropy)
    self.pages, self.slots = self._programs.init()

  def _placed(self, model):
    """The sampling copy of ``model`` (the sampler's rules): layers unstacked, or sharded over the mesh."""
    if self.unstack_layers:
      return _layers.unstack_layers(model, mesh=self.mesh, rules=self.rules)
    return model if self.mesh is None else models.shard_model(model, self.mesh, self.rules)

  def _init_schedule(self) -> None:
    """An idle schedule: every block free, eos the only stop, no rows, zero metrics."""
    self.pool = BlockPool(self.num_blocks, self.dp)
    self._stops, self._stop_strings = build_stops(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids, (), ())
    self._stop_key: tuple = ((), ())
    self._waiting: collections.deque[Row] = collections.deque()
    self._running: dict[int, Row] = {}  # slot -> row
    self._finished: collections.deque[Completion] = collections.deque()
    self._admissions = 0
    self._holding: list[RowGroup] = []  # groups holding prompt blocks for samples still to admit
    self._jobs: list[PrefillJob] = []  # admitted rows whose cache is being prefilled (chunk by chunk)
    self._parked: list[Row] = []  # samples holding a slot until their group's prompt is prefilled
    self._started: float | None = None
    self.metrics = EngineMetrics()

  # ------------------------------------------------------------------------------------------------
  # Public API

  @property
  def compile_counts(self) -> collections.Counter[str]:
    """Traces (= compilations) per program: ``prefill``, ``decode``, ``install``, ``copy``."""
    return self._programs.counts

  @property
  def cache_bytes(self) -> int:
    """Bytes of the allocated KV-cache pool, all devices together."""
    return int(self.pages[0].nbytes + self.pages[1].nbytes)

  def stats(self) -> dict[str, float]:
    """Gauges and rates: busy slots, cache use, queue length, tokens/s, mean time to first token."""
    m = self.metrics
    ttft = m.time_to_first_token
    return {"busy_slots": float(len(self._running)), "cache_use": self.pool.used / self.num_blocks,
            "queue_length": float(len(self._waiting)), "prefilling": float(len(self._jobs)),
            "preemptions": float(m.preemptions),
            "interruptions": float(m.interruptions), "decode_steps": float(m.decode_steps),
            "slot_occupancy": m.busy_slot_steps / max(m.decode_steps * self.num_slots, 1),
            "tokens_per_s": m.generated_tokens / max(m.decode_seconds, 1e-9),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else 0.0,
            "ttft_max_s": float(np.max(ttft)) if ttft else 0.0}

  @property
  def idle(self) -> bool:
    """No waiting, prefilling or running rows."""
    return not self._waiting and not self._running and not self._jobs and not self._parked

  def submit(self, requests: Sequence[Request]) -> None:
    """Queues requests (rows ``request·n + sample`` of this call get ``Completion.index``).

    On a mesh that spans several processes every process runs the same schedule over the same
    requests, so every process must submit the same requests in the same order (checked: a digest is
    compared across processes); :meth:`generate` gathers each process's own prompts for it.
    """
    self._submit(requests, check=self._procs > 1)

  def _submit(self, requests: Sequence[Request], *, check: bool) -> None:
    now = time.perf_counter()
    for r in requests:
      if not isinstance(r, Request):
        raise TypeError(f"submit: expected Request objects, got {type(r).__name__}")
    prompts = encode_prompts(self.tokenizer, [r.prompt for r in requests], vocab_size=self.cfg.vocab_size,
                             max_len=self.max_len, add_special_tokens=self.add_special_tokens) if requests else []
    if check:
      check_same_everywhere(requests, prompts)
    images = _vision.check_images(self.cfg, prompts, [r.images for r in requests])
    k = 0
    for i, (r, ids) in enumerate(zip(requests, prompts)):
      check_request(r)
      if r.top_logprobs > self.max_top_logprobs:
        raise ValueError(f"Request.top_logprobs: {r.top_logprobs} exceeds the engine's max_top_logprobs="
                         f"{self.max_top_logprobs}")
      if r.entropy and not self.entropy:
        raise ValueError("Request.entropy: the engine was built without entropy=True")
      group = RowGroup(left=r.n)
      max_new = min(r.max_new_tokens, self.max_len - len(ids))
      rope, delta = None, 0
      if _vision.is_vlm(self.cfg):
        rope, delta = _vision.prompt_rope(self.cfg, ids, images[i], where=f"requests[{i}] (request_id {r.request_id})")
      for j in range(r.n):
        self._waiting.append(Row(request=r, prompt=ids, sample=j, index=k, max_new=max_new, group=group,
                                  submitted=now, images=images[i], rope=rope, rope_delta=delta))
        k += 1

  def completions(self, callback: Callable[[Completion], None] | None = None) -> Iterator[Completion]:
    """Steps the engine until it is idle, yielding (and passing to ``callback``) each row as it ends."""
    while True:
      while self._finished:
        c = self._finished.popleft()
        if callback is not None:
          callback(c)
        yield c
      if self.idle:
        return
      self.step()

  def pop_finished(self) -> list[Completion]:
    """The rows that ended in the scheduling rounds run so far, without stepping (for callers that
    drive :meth:`step` themselves, one round at a time, as the asynchronous trainer does)."""
    out = list(self._finished)
    self._finished.clear()
    return out

  def update_weights(self, model, version: int | None = None, *, mode: str = "interrupt") -> None:
    """New weights from the next decode step on (same architecture and shapes: no recompilation).

    ``mode="interrupt"`` (AReaL): running rows keep their tokens, their cache is recomputed with
    the new weights and they continue, their next tokens recording ``version``. ``mode="finish"``:
    running rows first decode to their end under the old weights (their completions are queued for
    :meth:`completions`), then the weights change.
    """
    if mode not in ("interrupt", "finish"):
      raise ValueError(f"update_weights: mode {mode!r} is not one of ['interrupt', 'finish']")
    if nnx.graphdef(model) != self.source_graphdef:
      raise ValueError("update_weights: the new model's structure differs from the engine's model")
    params = nnx.state(model if self._given_placed else self._placed(model))
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
    if shapes(params) != shapes(self.params):
      raise ValueError("update_weights: the new model's parameter shapes or dtypes differ from the engine's")
    if mode == "finish":
      while self._running:
        self.step(admit=False)
    self.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, self.params))
    for g in list(self._holding):  # prompt caches of the old weights: later samples prefill again
      self._drop_group(g)
    for job in self._jobs:  # partly prefilled with the old weights: start again (images through the new tower)
      job.done, job.feats = 0, None
    self.version = self.version + 1 if version is None else int(version)
    if mode == "interrupt" and self._running:
      rows = list(self._running.values())
      self._sync_tokens(rows)
      self.metrics.interruptions += len(rows)
      jobs = [PrefillJob(row=row, seq=(row.prompt + row.tokens)[:-1], recompute=True) for row in rows]
      while jobs:
        finished = self._prefill_chunks(jobs)
        jobs = [j for j in jobs if j not in finished]

  def set_weights(self, model, *, version: int | None = None) -> None:
    """:meth:`Sampler.set_weights`'s signature: :meth:`update_weights` with in-flight rows interrupted."""
    self.update_weights(model, version, mode="interrupt")

  def generate(self, prompts, *, n: int = 1, max_new_tokens: int = 64, temperature=1.0, top_p=1.0, top_k=0,
               min_p=0.0, seed: int = 0, request_ids: Sequence[int] | None = None,
               stop_token_ids: Sequence[int | str] = (), stop_strings: Sequence[str] = (),
               return_top_logprobs: int = 0, return_entropy: bool = False, max_steps: int | None = None,
               return_state: bool = False, images=None) -> SampleOutput:
    """:meth:`jaxrl.sampling.Sampler.generate`'s contract, served by the engine (same rows, same draws;
    ``images`` and ``encode_vl_prompt`` dict prompts as there).

    ``return_top_logprobs`` needs an engine built with ``max_top_logprobs`` at least that large and
    ``return_entropy`` one built with ``entropy=True``. ``max_steps`` and ``return_state`` are not
    served by the engine (use :class:`Sampler`); they must keep their defaults.
    """
    if max_steps is not None or return_state:
      raise ValueError("Engine.generate: max_steps and return_state are Sampler-only options")
    if isinstance(return_top_logprobs, bool) or not isinstance(return_top_logprobs, (int, np.integer)) or \
        not 0 <= return_top_logprobs <= self.max_top_logprobs:
      raise ValueError(f"return_top_logprobs: must be an int in [0, max_top_logprobs={self.max_top_logprobs}] "
                       f"(an Engine argument), got {return_top_logprobs!r}")
    if return_entropy and not self.entropy:
      raise ValueError("return_entropy: the engine was built without entropy=True")
    if not self.idle:
      raise RuntimeError("Engine.generate needs an idle engine; use submit/completions while it is busy")
    prompts, images = _vision.split_prompts(prompts, images)
    ids = encode_prompts(self.tokenizer, prompts, vocab_size=self.cfg.vocab_size, max_len=self.max_len,
                         add_special_tokens=self.add_special_tokens)
    images = _vision.check_images(self.cfg, ids, images)
    count = len(ids)
    procs = self._procs
    if procs > 1 and any(x is not None for x in images):
      raise ValueError("Engine.generate: prompts with images across several processes are not supported; submit "
                       "the same Requests (with their images) on every process")
    check_counts(n=n, max_new_tokens=max_new_tokens)
    args = prompt_args(count, procs, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       request_ids=request_ids)
    temp, tp, tk, mp, rid = args.temperature, args.top_p, args.top_k, args.min_p, args.request_ids
    self.set_stops(stop_token_ids, stop_strings)
    local_count = count
    if procs > 1:  # each process passed its own prompts: schedule all of them everywhere, return this process's rows
      ids, (temp, tp, tk, mp, rid) = gather_prompts(ids, (temp, tp, tk, mp, rid))
      count = len(ids)
      images = [None] * count
    self._submit([Request(prompt=p, n=n, max_new_tokens=max_new_tokens, temperature=float(temp[i]),
                          top_p=float(tp[i]), top_k=int(tk[i]), min_p=float(mp[i]), seed=int(seed),
                          request_id=int(rid[i]), top_logprobs=int(return_top_logprobs),
                          entropy=bool(return_entropy), images=images[i]) for i, p in enumerate(ids)], check=False)
    rows = {c.index: c for c in self.completions()}
    out = sample_output(rows, count, n, max_new_tokens, pad_token_id=self.pad_token_id, tokenizer=self.tokenizer,
                        k_top=int(return_top_logprobs), want_entropy=bool(return_entropy))
    if procs > 1:
      out = process_rows(out, jax.process_index() * local_count, local_count, n)
    return out

  def set_stops(self, stop_token_ids: Sequence[int | str] = (), stop_strings: Sequence[str] = ()) -> None:
    """Stop tokens / strings (besides eos) for the rows decoded from now on; only while idle."""
    key = (tuple(stop_token_ids), (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings))
    if key == self._stop_key:
      return
    if not self.idle:
      raise RuntimeError("set_stops: the stop rules can only change while the engine is idle")
    self._stops, self._stop_strings = build_stops(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids,
                                                  stop_token_ids, stop_strings)
    self._stop_key = key


def _check_settings(vocab_size: int, *, num_slots, max_len, block_size, steps_per_call, prefill_rows, row_tile,
                    prefill_chunk, max_top_logprobs, budgets: tuple) -> None:
  """Raises ValueError naming the first :class:`Engine` argument out of its range (``budgets``:
  ``(kv_cache_bytes, num_blocks, kv_cache_fraction)``, exactly one given; their values are checked when
  the pool is sized, :func:`jaxrl.sampling._engine_pool.pool_blocks`)."""
  for key, val in (("num_slots", num_slots), ("max_len", max_len), ("block_size", block_size),
                   ("steps_per_call", steps_per_call), ("prefill_rows", prefill_rows)):
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
      raise ValueError(f"{key}: must be a positive int, got {val!r}")
  if row_tile is not None and (not isinstance(row_tile, int) or row_tile < 1 or num_slots % row_tile):
    raise ValueError(f"row_tile: must be a positive divisor of num_slots={num_slots}, got {row_tile!r}")
  if max_len < 2:
    raise ValueError(f"max_len: must be >= 2, got {max_len!r}")
  if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                    or prefill_chunk < 1 or prefill_chunk % block_size):
    raise ValueError(f"prefill_chunk: must be a positive multiple of block_size={block_size}, got "
                     f"{prefill_chunk!r}")
  if isinstance(max_top_logprobs, bool) or not isinstance(max_top_logprobs, int) or not \
      0 <= max_top_logprobs <= vocab_size:
    raise ValueError(f"max_top_logprobs: must be an int in [0, vocab_size={vocab_size}], got "
                     f"{max_top_logprobs!r}")
  if sum(x is not None for x in budgets) != 1:
    raise ValueError("give exactly one of kv_cache_bytes, num_blocks, kv_cache_fraction")
