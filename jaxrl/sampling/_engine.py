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
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import kernels, models
from jaxrl.models import cache_block_bytes, cache_shards
from jaxrl.sampling import _layers
from jaxrl.sampling._paged import BlockPool, blocks_for
from jaxrl.sampling._requests import (
    FINISH_REASONS,
    Request,
    build_stops,
    check_token,
    encode_prompts,
    gather_prompts,
    length_bucket,
    next_pow2,
    per_prompt,
    special_tokens,
    stop_string_end,
)
from jaxrl.sampling._rows import Rows, SampleOutput, TopLogprobs, decode_loop, emit, process_rows
from jaxrl.sharding import LogicalRules
from jaxrl.sharding import allgather_scalar

_PAGED_IMPL = {"reference": "reference", "pallas_triton": "pallas_triton", "pallas_tpu": "pallas_tpu"}


def paged_impl_for(attention_impl: str) -> str:
  """The paged-attention kernel the engine uses for a model's ``attention_impl`` (``auto`` when it has no
  paged twin: the backend picks)."""
  return _PAGED_IMPL.get(attention_impl, "auto")


# --------------------------------------------------------------------------------------------------
# Requests and completions


@dataclasses.dataclass(frozen=True)
class Completion:
  """One finished sample: the tokens after the prompt with their log-probs and policy versions."""

  request_id: int
  sample: int
  prompt: np.ndarray  # [P] int32
  tokens: np.ndarray  # [len] int32
  logprobs: np.ndarray  # [len] float32: log_softmax(logits / T)[token], untruncated
  sampling_logprobs: np.ndarray  # [len] float32: under the truncated distribution sampled from
  versions: np.ndarray  # [len] int32: policy version that produced each token
  finish_reason: str  # "eos" | "stop" | "length"
  index: int = 0
  "Position of this row among the rows of its :meth:`Engine.submit` call (``request·n + sample``)."
  top_ids: np.ndarray | None = None  # [len, k] int32, when the request asked for top_logprobs=k
  top_logprobs: np.ndarray | None = None  # [len, k] float32: log_softmax(logits / T), untruncated
  entropy: np.ndarray | None = None  # [len] float32, when the request asked for it


@dataclasses.dataclass
class EngineMetrics:
  """Counters since the engine was built (``time_to_first_token`` per finished row, seconds)."""

  decode_calls: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  prefill_tokens: int = 0
  prefill_calls: int = 0
  "Prefill program calls (one per chunk of up to ``prefill_rows`` rows)."
  recomputed_tokens: int = 0
  preemptions: int = 0
  interruptions: int = 0
  busy_slot_steps: int = 0
  time_to_first_token: list[float] = dataclasses.field(default_factory=list)
  decode_seconds: float = 0.0


@dataclasses.dataclass
class _Group:
  """A prompt's prefilled blocks, held (one reference) until all its samples are admitted."""

  blocks: list[int] | None = None
  left: int = 0
  prefilling: bool = False  # the first sample's prompt is being prefilled; the others wait in slots
  shard: int = -1  # data shard of that prefill


@dataclasses.dataclass
class _Row:
  request: Request
  prompt: list[int]
  sample: int
  index: int
  max_new: int
  group: _Group
  submitted: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  entropy: list[float] = dataclasses.field(default_factory=list)
  top_ids: list[list[int]] = dataclasses.field(default_factory=list)
  top_values: list[list[float]] = dataclasses.field(default_factory=list)
  slot: int = -1
  blocks: list[int] = dataclasses.field(default_factory=list)
  n_gen: int = 0  # generated tokens (device value, mirrored after each call)
  first_token: float | None = None
  admitted_at: int = 0
  started: bool = False  # counted against its group (admitted at least once)


@dataclasses.dataclass(eq=False)
class _Job:
  """A row whose cache is being written, ``prefill_chunk`` tokens per scheduling round."""

  row: _Row
  seq: list[int]  # the tokens to cache: prompt + generated, but the pending last one
  recompute: bool  # the row already sits in its slot (a weight update); otherwise install when done
  done: int = 0  # tokens of ``seq`` cached so far


def budget_blocks(bytes_per_device: int, block_bytes: int, dp: int, tp: int) -> int:
  """Blocks of the whole pool that ``bytes_per_device`` buys on every device (a multiple of ``dp``)."""
  num_blocks = int(bytes_per_device // (block_bytes // tp)) * dp
  return num_blocks - num_blocks % dp


def check_pool(num_slots: int, shards: int, num_blocks: int, max_len: int, block_size: int, *,
               budget: str = "") -> str | None:
  """The engine's refusal of a pool layout, or None: ``num_slots`` not a multiple of the cache-batch
  ``shards``, or a pool shard (``num_blocks // shards`` blocks) that cannot hold one row of ``max_len``
  plus one block of look-ahead. ``budget`` says where ``num_blocks`` came from (for the message)."""
  if num_slots % shards:
    return f"num_slots: {num_slots} is not a multiple of the cache-batch shards ({shards})"
  need = blocks_for(max_len, block_size) + 1
  if num_blocks // shards < need:
    return (f"kv cache: {num_blocks // shards} blocks per shard{f' ({budget})' if budget else ''} cannot hold one "
            f"row of max_len={max_len} ({need} blocks of {block_size}); raise the budget or lower max_len")
  return None


# --------------------------------------------------------------------------------------------------
# The engine


class Engine:
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
    self.prefill_chunk = prefill_chunk
    if isinstance(max_top_logprobs, bool) or not isinstance(max_top_logprobs, int) or not \
        0 <= max_top_logprobs <= model.cfg.vocab_size:
      raise ValueError(f"max_top_logprobs: must be an int in [0, vocab_size={model.cfg.vocab_size}], got "
                       f"{max_top_logprobs!r}")
    self.max_top_logprobs, self.entropy = max_top_logprobs, bool(entropy)
    if sum(x is not None for x in (kv_cache_bytes, num_blocks, kv_cache_fraction)) != 1:
      raise ValueError("give exactly one of kv_cache_bytes, num_blocks, kv_cache_fraction")
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
    self.unstack_layers = jax.default_backend() == "cpu" if unstack_layers is None else bool(unstack_layers)
    self.paged_impl = paged_impl or paged_impl_for(self.cfg.attention_impl)
    if self.paged_impl not in kernels.PAGED_IMPLS:
      raise ValueError(f"paged_impl: {self.paged_impl!r} is not one of {list(kernels.PAGED_IMPLS)}")

    self.dp, tp = cache_shards(self.cfg, mesh, self.rules)
    self.num_slots = num_slots
    self.max_blocks = blocks_for(max_len, block_size)
    self.block_bytes = cache_block_bytes(self.cfg, block_size, self.cache_dtype)
    if kv_cache_fraction is not None:
      if not 0 < kv_cache_fraction <= 1:
        raise ValueError(f"kv_cache_fraction: must be in (0, 1], got {kv_cache_fraction!r}")
      local = [d for d in (mesh.devices.flat if mesh is not None else jax.devices())
               if d.process_index == jax.process_index()]
      stats = [d.memory_stats() or {} for d in local]
      if not stats or any("bytes_limit" not in st for st in stats):
        raise ValueError("kv_cache_fraction: this backend reports no device memory; give kv_cache_bytes")
      free = min(st["bytes_limit"] - st.get("bytes_in_use", 0) for st in stats)
      kv_cache_bytes = int(kv_cache_fraction * free)
      if self._procs > 1:  # the pool's shape must be the same on every process: the least free memory
        kv_cache_bytes = int(allgather_scalar(kv_cache_bytes).min())
    if kv_cache_bytes is not None:
      if kv_cache_bytes <= 0:
        raise ValueError(f"kv_cache_bytes: must be positive, got {kv_cache_bytes!r}")
      num_blocks = budget_blocks(kv_cache_bytes, self.block_bytes, self.dp, tp)
    elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
      raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
    num_blocks -= num_blocks % self.dp
    bad = check_pool(num_slots, self.dp, num_blocks, max_len, block_size, budget=(
        f"budget {kv_cache_bytes or num_blocks} {'bytes per device' if kv_cache_bytes else 'blocks'}"))
    if bad:
      raise ValueError(bad)
    self.num_blocks = num_blocks
    self.kv_cache_bytes_per_device = num_blocks // self.dp * (self.block_bytes // tp)

    self.source_graphdef = nnx.graphdef(model)
    self._given_placed = bool(placed)
    self.graphdef, self.params = nnx.split(model if placed else self._placed(model))
    self.version = int(version)
    self._programs = engine_programs(self.graphdef, nnx.merge(self.graphdef, self.params).cfg, mesh, self.rules,
                               self.cache_dtype, self.paged_impl, self.num_slots, self.max_len, self.max_blocks,
                               self.num_blocks, self.block_size, row_tile, max_top_logprobs, self.entropy)
    self.pages, self.slots = self._programs.init()
    self.pool = BlockPool(num_blocks, self.dp)
    self._stops, self._stop_strings = build_stops(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids, (), ())
    self._stop_key: tuple = ((), ())
    self._waiting: collections.deque[_Row] = collections.deque()
    self._running: dict[int, _Row] = {}  # slot -> row
    self._finished: collections.deque[Completion] = collections.deque()
    self._admissions = 0
    self._holding: list[_Group] = []  # groups holding prompt blocks for samples still to admit
    self._jobs: list[_Job] = []  # admitted rows whose cache is being prefilled (chunk by chunk)
    self._parked: list[_Row] = []  # samples holding a slot until their group's prompt is prefilled
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
      _check_same_everywhere(requests, prompts)
    k = 0
    for r, ids in zip(requests, prompts):
      _check_request(r)
      if r.top_logprobs > self.max_top_logprobs:
        raise ValueError(f"Request.top_logprobs: {r.top_logprobs} exceeds the engine's max_top_logprobs="
                         f"{self.max_top_logprobs}")
      if r.entropy and not self.entropy:
        raise ValueError("Request.entropy: the engine was built without entropy=True")
      group = _Group(left=r.n)
      max_new = min(r.max_new_tokens, self.max_len - len(ids))
      for j in range(r.n):
        self._waiting.append(_Row(request=r, prompt=ids, sample=j, index=k, max_new=max_new, group=group,
                                  submitted=now))
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
    for job in self._jobs:  # partly prefilled with the old weights: start again
      job.done = 0
    self.version = self.version + 1 if version is None else int(version)
    if mode == "interrupt" and self._running:
      rows = list(self._running.values())
      self._sync_tokens(rows)
      self.metrics.interruptions += len(rows)
      jobs = [_Job(row=row, seq=(row.prompt + row.tokens)[:-1], recompute=True) for row in rows]
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
               return_state: bool = False) -> SampleOutput:
    """:meth:`jaxrl.sampling.Sampler.generate`'s contract, served by the engine (same rows, same draws).

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
    ids = encode_prompts(self.tokenizer, prompts, vocab_size=self.cfg.vocab_size, max_len=self.max_len,
                         add_special_tokens=self.add_special_tokens)
    count = len(ids)
    procs = self._procs
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"n: must be a positive int, got {n!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
    temp = per_prompt("temperature", temperature, count, np.float32, lambda x: np.isfinite(x) and x >= 0)
    tp = per_prompt("top_p", top_p, count, np.float32, lambda x: 0 < x <= 1)
    tk = per_prompt("top_k", top_k, count, np.int32, lambda x: x >= 0 and x == int(x))
    mp = per_prompt("min_p", min_p, count, np.float32, lambda x: 0 <= x <= 1)
    if request_ids is None:  # as Sampler.generate: process p's prompts get ids p·count + 0..count-1
      request_ids = np.arange(count) + (jax.process_index() * count if procs > 1 else 0)
    rid = np.asarray(request_ids)
    if (rid.shape != (count,) or not np.issubdtype(rid.dtype, np.integer) or (rid < 0).any()
        or (rid >= 2**31).any()):
      raise ValueError(f"request_ids: expected {count} ints in [0, 2**31), got {request_ids!r}")
    self.set_stops(stop_token_ids, stop_strings)
    local_count = count
    if procs > 1:  # each process passed its own prompts: schedule all of them everywhere, return this process's rows
      ids, (temp, tp, tk, mp, rid) = gather_prompts(ids, (temp, tp, tk, mp, rid))
      count = len(ids)
    self._submit([Request(prompt=p, n=n, max_new_tokens=max_new_tokens, temperature=float(temp[i]),
                          top_p=float(tp[i]), top_k=int(tk[i]), min_p=float(mp[i]), seed=int(seed),
                          request_id=int(rid[i]), top_logprobs=int(return_top_logprobs),
                          entropy=bool(return_entropy)) for i, p in enumerate(ids)], check=False)
    rows = {c.index: c for c in self.completions()}
    out = self._output(rows, count, n, max_new_tokens, int(return_top_logprobs), bool(return_entropy))
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

  # ------------------------------------------------------------------------------------------------
  # Scheduling

  def step(self, *, admit: bool = True) -> None:
    """One scheduling round: admit, reserve blocks (preempting if needed), one decode call, retire."""
    if self._started is None:
      self._started = time.perf_counter()
    if admit:
      self._admit()
    if not self._running:
      if self._waiting and not self._jobs and not self._parked:
        raise RuntimeError("engine: no row could be admitted into an empty engine (cache too small)")
      return
    steps = self._reserve()
    t0 = time.perf_counter()
    budget = np.int32(steps)
    early = np.bool_(bool(self._waiting))  # stop at the first finished row only when a row waits for its slot
    self.pages, self.slots, summary = self._programs.decode(self.params, self.pages, self.slots, self._stops,
                                                            np.int32(self.version), budget, early)
    host = jax.device_get(summary)  # replicated: every process reads the same values from its own devices
    now = time.perf_counter()
    m = self.metrics
    m.decode_calls += 1
    m.decode_seconds += now - t0
    busy = len(self._running)
    made = 0
    ended = []
    for slot, row in self._running.items():
      n = int(host["n_gen"][slot])
      made += n - row.n_gen
      row.n_gen = n
      if row.first_token is None and n > 0:
        row.first_token = now
        m.time_to_first_token.append(now - row.submitted)
      if host["done"][slot]:
        ended.append((slot, row, int(host["reason"][slot])))
    m.generated_tokens += made
    steps_run = int(host["ran"])
    m.decode_steps += steps_run
    m.busy_slot_steps += busy * steps_run
    if ended:
      self._retire(ended)

  def _admit(self) -> None:
    """Fills free slots from the queue (FIFO), runs one prefill chunk of every admitted row whose cache
    is not complete, installs the rows whose cache is, and forks the other samples of each prefilled
    prompt from its blocks."""
    taken = set(self._running) | {j.row.slot for j in self._jobs} | {r.slot for r in self._parked}
    free = [s for s in range(self.num_slots) if s not in taken]
    while self._waiting and free:
      row = self._waiting[0]
      slot = self._pick_slot(free, row)
      fresh = not row.tokens
      g = row.group
      if fresh and (g.blocks is not None or g.prefilling):
        row.slot = slot  # blocks planned once the group's prefill has run
        self._parked.append(row)
      else:
        cached = len(row.prompt) + len(row.tokens) - 1
        need = blocks_for(cached + 1, self.block_size)
        blocks = self.pool.allocate(self._shard(slot), need)
        if blocks is None and self._holding and not self._running and not self._jobs and not self._parked:
          for h in list(self._holding):  # an empty engine: prompt blocks held for later samples go first
            self._drop_group(h)
          blocks = self.pool.allocate(self._shard(slot), need)
        if blocks is None:
          break
        row.slot, row.blocks = slot, blocks
        self._jobs.append(_Job(row=row, seq=(row.prompt + row.tokens)[:-1], recompute=False))
        if fresh and g.left > 1:
          g.prefilling, g.shard = True, self._shard(slot)
      self._waiting.popleft()
      free.remove(slot)
    ready = []
    if self._jobs:
      finished = self._prefill_chunks(self._jobs)
      self._jobs = [j for j in self._jobs if j not in finished]
      ready = [j.row for j in finished]
      for row in ready:
        g = row.group
        if not row.tokens and g.prefilling:
          g.prefilling = False
          g.blocks = row.blocks[:blocks_for(len(row.prompt) - 1, self.block_size)]
          self.pool.share(g.blocks)
          self._holding.append(g)
    copies, forked, back, parked = [], [], [], []
    for row in self._parked:
      g = row.group
      if g.prefilling:
        parked.append(row)
        continue
      plan = None if back or g.blocks is None else self._fork_plan(row, g.blocks, self._shard(row.slot))
      if plan is None:  # no room, or the group's blocks were dropped: back to the queue (in order)
        back.append(row)
        row.slot = -1
        continue
      row.blocks, pairs = plan
      copies += pairs
      forked.append(row)
    self._parked = parked
    for row in reversed(back):
      self._waiting.appendleft(row)
    if copies:
      src, dst = zip(*copies)
      self.pages = self._programs.copy(self.pages, *self._bucket_pairs(src, dst))
    admitted = ready + forked
    if not admitted:
      return
    self._install(admitted)
    for row in admitted:
      self._admissions += 1
      row.admitted_at = self._admissions
      self._running[row.slot] = row
      g = row.group
      if not row.tokens and not row.started:
        row.started = True
        g.left -= 1
        if g.left == 0 and g.blocks is not None:
          self._drop_group(g)

  def _drop_group(self, g: _Group) -> None:
    self.pool.release(g.blocks)
    g.blocks = None
    self._holding.remove(g)

  def _shard(self, slot: int) -> int:
    return slot // (self.num_slots // self.dp)

  def _pick_slot(self, free: list[int], row: _Row) -> int:
    """A free slot, on the shard of the row's group's blocks when it has some."""
    g = row.group
    if (g.blocks or g.prefilling) and self.dp > 1:
      shard = self.pool.shard_of(g.blocks[0]) if g.blocks else g.shard
      for s in free:
        if s // (self.num_slots // self.dp) == shard:
          return s
    # Spread over shards: the shard with the most free blocks among those with a free slot.
    return max(free, key=lambda s: (self.pool.free_count(s // (self.num_slots // self.dp)), -s))

  def _fork_plan(self, row: _Row, src: list[int], shard: int):
    """Blocks for a new sample of a prefilled prompt: shares the full blocks (same shard), copies the rest."""
    need = blocks_for(len(row.prompt), self.block_size)
    full = (len(row.prompt) - 1) // self.block_size
    same = self.pool.shard_of(src[0]) == shard if src else True
    shared = src[:full] if same else []
    own = self.pool.allocate(shard, need - len(shared))
    if own is None:
      return None
    self.pool.share(shared)
    blocks = list(shared) + own
    copies = [(src[i], blocks[i]) for i in range(len(shared), len(src))]
    return blocks, copies

  def _reserve(self) -> int:
    """Blocks for the next decode call's writes; when the pool runs dry, prompt blocks held for
    not-yet-admitted samples are dropped first, then the latest-admitted row is preempted."""
    steps = self.steps_per_call
    changed: dict[int, _Row] = {}
    while True:
      short = None
      for slot, row in sorted(self._running.items(), key=lambda kv: kv[1].admitted_at):
        last = len(row.prompt) + row.max_new - 2  # position of the last token ever fed
        pos = len(row.prompt) + row.n_gen - 1
        extra = blocks_for(min(pos + steps, last + 1), self.block_size) - len(row.blocks)
        if extra > 0:
          got = self.pool.allocate(self._shard(slot), extra)
          if got is None:
            short = row
            break
          row.blocks += got
          changed[id(row)] = row
      if short is None:
        break
      held = [g for g in self._holding
              if g.blocks and (self.dp == 1 or self.pool.shard_of(g.blocks[0]) == self._shard(short.slot))]
      if held:
        for g in held:
          self._drop_group(g)
        continue
      victims = [r for r in self._running.values() if self._shard(r.slot) == self._shard(short.slot)]
      victim = max(victims, key=lambda r: r.admitted_at)
      changed.pop(id(victim), None)
      self._preempt(victim)
    rows = [r for r in changed.values() if r.slot >= 0]
    if rows:
      self._set_tables(rows)
    return steps

  def _preempt(self, row: _Row) -> None:
    self._sync_tokens([row])
    self._release_rows([row])
    self.metrics.preemptions += 1
    self._waiting.appendleft(row)

  def _release_rows(self, rows: list[_Row]) -> None:
    for row in rows:
      del self._running[row.slot]
      self.pool.release(row.blocks)
      row.blocks = []
    self.slots = self._programs.free(self.slots, self._put_slot_idx([row.slot for row in rows]))
    for row in rows:
      row.slot = -1

  def _sync_tokens(self, rows: list[_Row]) -> None:
    """Copies the rows' generated tokens, log-probs and versions to the host."""
    idx = self._put_slot_idx([r.slot for r in rows])
    got = jax.device_get(self._programs.gather(self.slots, idx))
    for k, row in enumerate(rows):
      n = int(got["n_gen"][k])
      row.n_gen = n
      row.tokens = got["tokens"][k, :n].tolist()
      row.logprobs = got["logprobs"][k, :n].tolist()
      row.sampling_logprobs = got["sampling_logprobs"][k, :n].tolist()
      row.versions = got["versions"][k, :n].tolist()
      if "entropy" in got:
        row.entropy = got["entropy"][k, :n].tolist()
      if "top_ids" in got:
        row.top_ids = got["top_ids"][k, :n].tolist()
        row.top_values = got["top_values"][k, :n].tolist()

  def _retire(self, ended: list[tuple[int, _Row, int]]) -> None:
    rows = [row for _, row, _ in ended]
    self._sync_tokens(rows)
    self._release_rows(rows)
    for _, row, reason in ended:
      n = len(row.tokens)
      tokens = np.asarray(row.tokens, np.int32)
      finish = FINISH_REASONS[reason]
      if self._stop_strings and self.tokenizer is not None:
        cut = stop_string_end(self.tokenizer, tokens, self._stop_strings)
        if cut is not None and (cut < n or finish != "stop"):
          n, finish = cut, "stop"
      k = row.request.top_logprobs
      top = lambda a, dt: np.asarray(a[:n], dt).reshape(n, self.max_top_logprobs)[:, :k] if k else None
      self._finished.append(Completion(
          request_id=row.request.request_id, sample=row.sample, prompt=np.asarray(row.prompt, np.int32),
          tokens=tokens[:n], logprobs=np.asarray(row.logprobs[:n], np.float32),
          sampling_logprobs=np.asarray(row.sampling_logprobs[:n], np.float32),
          versions=np.asarray(row.versions[:n], np.int32), finish_reason=finish, index=row.index,
          top_ids=top(row.top_ids, np.int32), top_logprobs=top(row.top_values, np.float32),
          entropy=np.asarray(row.entropy[:n], np.float32) if row.request.entropy else None))

  # ------------------------------------------------------------------------------------------------
  # Device programs, called from the schedule

  def _prefill_chunks(self, jobs: list[_Job]) -> list[_Job]:
    """One chunk (``prefill_chunk`` tokens, or the rest) of every job's cache; returns the jobs whose
    cache is complete. A chunk's queries read the earlier chunks' keys/values from the row's blocks."""
    by_shape: dict[tuple[int, int], list[_Job]] = collections.defaultdict(list)
    for job in jobs:
      n = len(job.seq)
      if job.done < n:
        p = context_bucket(n, self.min_bucket, self.block_size, self.max_blocks)  # context of the row
        t = p - job.done if self.prefill_chunk is None else min(self.prefill_chunk, p - job.done)
        by_shape[(p, t)].append(job)
    m = self.metrics
    u = prefill_batch_rows(self.prefill_rows, self.dp)
    per = u // self.dp  # rows of each pool shard per call: row k lives on shard k // per (row-local prefill)
    for (p, t), items in sorted(by_shape.items()):
      by_shard: list[list[_Job]] = [[] for _ in range(self.dp)]
      for job in items:
        by_shard[self.pool.shard_of(job.row.blocks[0])].append(job)
      for i in range(0, max(len(q) for q in by_shard), per):
        toks = np.zeros((u, t), np.int32)
        start = np.zeros((u,), np.int32)
        n_cache = np.zeros((u,), np.int32)
        tables = np.full((u, p // self.block_size), self.num_blocks, np.int32)
        for k, job in ((d * per + j, job) for d, q in enumerate(by_shard) for j, job in enumerate(q[i:i + per])):
          part = job.seq[job.done:job.done + t]
          toks[k, :len(part)] = part
          start[k], n_cache[k] = job.done, len(job.seq)
          nb = blocks_for(n_cache[k], self.block_size)
          tables[k, :nb] = job.row.blocks[:nb]
          if self.dp > 1 and any(self.pool.shard_of(b) != k // per for b in job.row.blocks[:nb]):
            raise RuntimeError(f"engine: row {job.row.request.request_id}/{job.row.sample} holds blocks of "
                               "several pool shards; a row's blocks must all be on its slot's shard")
          if job.recompute:
            m.recomputed_tokens += len(part)
          else:
            m.prefill_tokens += len(part)
          job.done += len(part)
        m.prefill_calls += 1
        self.pages = self._programs.prefill(self.params, self.pages, np.asarray(toks), np.asarray(n_cache),
                                            np.asarray(tables), np.asarray(start))
    return [job for job in jobs if job.done >= len(job.seq)]

  def _install(self, rows: list[_Row]) -> None:
    """Loads the rows' state (table, sampling parameters, key, tokens so far) into their slots."""
    a = next_pow2(len(rows))
    g = min(length_bucket(max(len(r.tokens) for r in rows), minimum=8), self.max_len)  # padded on device
    f = dict(slot=np.full((a,), self.num_slots, np.int32), tables=np.full((a, self.max_blocks), self.num_blocks,
                                                                              np.int32),
             prompt_len=np.ones((a,), np.int32), prompt_last=np.zeros((a,), np.int32),
             tokens=np.zeros((a, g), np.int32), logprobs=np.zeros((a, g), np.float32),
             sampling_logprobs=np.zeros((a, g), np.float32), versions=np.full((a, g), -1, np.int32),
             n_gen=np.zeros((a,), np.int32), seed=np.zeros((a,), np.uint32), request=np.zeros((a,), np.int32),
             sample=np.zeros((a,), np.int32), temperature=np.zeros((a,), np.float32),
             top_k=np.zeros((a,), np.int32), top_p=np.ones((a,), np.float32), min_p=np.zeros((a,), np.float32),
             max_new=np.ones((a,), np.int32))
    if self.entropy:
      f["entropy"] = np.zeros((a, g), np.float32)
    if self.max_top_logprobs:
      f["top_ids"] = np.zeros((a, g, self.max_top_logprobs), np.int32)
      f["top_values"] = np.zeros((a, g, self.max_top_logprobs), np.float32)
    for k, row in enumerate(rows):
      r = row.request
      n = len(row.tokens)
      f["slot"][k] = row.slot
      f["tables"][k, :len(row.blocks)] = row.blocks
      f["prompt_len"][k] = len(row.prompt)
      f["prompt_last"][k] = row.prompt[-1]
      f["tokens"][k, :n] = row.tokens
      f["logprobs"][k, :n] = row.logprobs
      f["sampling_logprobs"][k, :n] = row.sampling_logprobs
      f["versions"][k, :n] = row.versions
      if self.entropy and n:
        f["entropy"][k, :n] = row.entropy
      if self.max_top_logprobs and n:
        f["top_ids"][k, :n] = row.top_ids
        f["top_values"][k, :n] = row.top_values
      f["n_gen"][k] = n
      f["seed"][k] = r.seed % 2**32
      f["request"][k] = r.request_id
      f["sample"][k] = row.sample
      f["temperature"][k], f["top_k"][k], f["top_p"][k], f["min_p"][k] = r.temperature, r.top_k, r.top_p, r.min_p
      f["max_new"][k] = row.max_new
      row.n_gen = n
      if n and row.first_token is None:
        row.first_token = time.perf_counter()
    self.slots = self._programs.install(self.slots, {k: np.asarray(v) for k, v in f.items()})

  def _set_tables(self, rows: list[_Row]) -> None:
    a = next_pow2(len(rows))
    slot = np.full((a,), self.num_slots, np.int32)
    tables = np.full((a, self.max_blocks), self.num_blocks, np.int32)
    for k, row in enumerate(rows):
      slot[k] = row.slot
      tables[k, :len(row.blocks)] = row.blocks
    self.slots = self._programs.set_tables(self.slots, slot, tables)

  def _put_slot_idx(self, slots: list[int]) -> np.ndarray:
    a = next_pow2(len(slots))
    idx = np.full((a,), self.num_slots, np.int32)
    idx[:len(slots)] = slots
    return idx

  def _bucket_pairs(self, src, dst):
    a = next_pow2(len(src))
    s = np.zeros((a,), np.int32)
    d = np.full((a,), self.num_blocks, np.int32)
    s[:len(src)] = src
    d[:len(dst)] = dst
    return s, d

  def _output(self, rows: dict[int, Completion], count: int, n: int, max_new_tokens: int, k_top: int = 0,
              want_entropy: bool = False) -> SampleOutput:
    total = count * n
    m = max_new_tokens
    tokens = np.full((total, m), self.pad_token_id, np.int32)
    lp = np.zeros((total, m), np.float32)
    slp = np.zeros((total, m), np.float32)
    versions = np.full((total, m), -1, np.int32)
    lengths = np.zeros((total,), np.int32)
    top_ids = np.full((total, m, k_top), self.pad_token_id, np.int32)
    top_lp = np.zeros((total, m, k_top), np.float32)
    ent = np.zeros((total, m), np.float32)
    reasons = []
    for i in range(total):
      c = rows[i]
      k = len(c.tokens)
      tokens[i, :k], lp[i, :k], slp[i, :k], versions[i, :k] = c.tokens, c.logprobs, c.sampling_logprobs, c.versions
      if k_top and k:
        top_ids[i, :k], top_lp[i, :k] = c.top_ids, c.top_logprobs
      if want_entropy:
        ent[i, :k] = c.entropy
      lengths[i] = k
      reasons.append(c.finish_reason)
    texts = None
    if self.tokenizer is not None:
      texts = [self.tokenizer.decode(tokens[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(total)]
    return SampleOutput(tokens=tokens, logprobs=lp, sampling_logprobs=slp, lengths=lengths, finish_reason=reasons,
                           versions=versions, prompt_lengths=np.asarray([len(rows[i].prompt) for i in range(total)],
                                                                        np.int32),
                           prompt_index=np.repeat(np.arange(count, dtype=np.int32), n), texts=texts,
                           top_logprobs=TopLogprobs(ids=top_ids, logprobs=top_lp) if k_top else None,
                           entropy=ent if want_entropy else None)

  # ------------------------------------------------------------------------------------------------
  # Input handling (the sampler's rules)

  def _placed(self, model):
    if self.unstack_layers:
      return _layers.unstack_layers(model, mesh=self.mesh, rules=self.rules)
    return model if self.mesh is None else models.shard_model(model, self.mesh, self.rules)



def _check_same_everywhere(requests: Sequence[Request], prompts: list[list[int]]) -> None:
  """Raises unless every process submits the same requests (a CRC of them, compared across processes)."""
  import zlib

  text = repr([(ids, dataclasses.replace(r, prompt=())) for r, ids in zip(requests, prompts)])
  digests = allgather_scalar(np.int64(zlib.crc32(text.encode())))
  if len(set(digests.tolist())) != 1:
    raise ValueError(f"Engine.submit on {len(digests)} processes: every process must submit the same requests in "
                     "the same order (the schedule runs on every process); Engine.generate gathers per-process "
                     "prompts itself")


def _check_request(r: Request) -> None:
  if not isinstance(r.n, int) or r.n < 1:
    raise ValueError(f"Request.n: must be a positive int, got {r.n!r}")
  if isinstance(r.max_new_tokens, bool) or not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
    raise ValueError(f"Request.max_new_tokens: must be a positive int, got {r.max_new_tokens!r}")
  if not (np.isfinite(r.temperature) and r.temperature >= 0):
    raise ValueError(f"Request.temperature: must be >= 0, got {r.temperature!r}")
  if not 0 < r.top_p <= 1:
    raise ValueError(f"Request.top_p: must be in (0, 1], got {r.top_p!r}")
  if r.top_k < 0 or not 0 <= r.min_p <= 1:
    raise ValueError(f"Request.top_k / min_p out of range: {r.top_k!r}, {r.min_p!r}")
  if not 0 <= r.request_id < 2**31:
    raise ValueError(f"Request.request_id: must be in [0, 2**31), got {r.request_id!r}")


# --------------------------------------------------------------------------------------------------
# Jitted programs


class _Programs:
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
                  top_values=jnp.zeros((s, g, self.k_top), jnp.float32) if self.k_top else None)

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
            "temperature", "top_k", "top_p", "min_p", "max_new", "entropy", "top_ids", "top_values")
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

  def _prefill(self, params, pages, tokens, n_cache, tables, start=None):
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

    def run(pages, params, tokens, start):  # one piece of T' tokens per row, starting at ``start``
      model = nnx.merge(self.graphdef, params)
      pos = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [U, T']
      seg = (pos < n_cache[:, None]).astype(jnp.int32)
      x = model.embed_tokens(tokens)  # [U, T', D]
      if row_spec is not None:  # the rows' activations live where their blocks do
        x = jax.lax.with_sharding_constraint(x, row_spec)

      def attend(k_l, v_l):  # the layer's context read, attention and cache write, for Attention.__call__
        def fn(q, k, v):  # [U, T', N, H], [U, T', K, H] x2
          out, k_l2, v_l2 = paged(q, k, v, k_l, v_l, tables, pos, seg, start, n_cache)
          return out, (k_l2, v_l2)
        return fn

      _, pages = model.run_layers(x, positions=pos, kv=pages, attend=attend, annotate=False)
      return pages

    with jax.named_scope("prefill"):
      if not self.row_tile:
        return run(pages, params, tokens, start)
      # reproducible: queries in tiles of one block, so every chunking computes the same tiles

      def tile(carry, i):
        pages, params = carry  # params ride in the carry: NNX modules cannot cross trace levels
        cut = jax.lax.dynamic_slice_in_dim(tokens, i * self.bs, self.bs, axis=1)
        return (run(pages, params, cut, start + i * self.bs), params), None

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
    logits, pages = self._step(nnx.merge(self.graphdef, params), token, pos, active, pages, slots.tables)
    return pages, emit(slots, logits, version, stops)

  def _step(self, model, token, pos, active, pages, tables):
    """One token per slot through the model's path (:meth:`jaxrl.models.Transformer.run`), each layer's
    attention writing into and reading from the paged pool."""
    paged = self._attend_fn()

    def attend(k_l, v_l):  # the layer's cache write and paged attention, for Attention.__call__
      def fn(q, k, v):  # [S, 1, N, H], [S, 1, K, H] x2
        out, k_l2, v_l2 = paged(q[:, 0], k[:, 0], v[:, 0], k_l, v_l, tables, pos, active)
        return out[:, None], (k_l2, v_l2)
      return fn

    logits, pages = model.run(token[:, None], positions=pos[:, None], kv=pages, attend=attend, annotate=False)
    return logits[:, 0], pages


@functools.lru_cache(maxsize=64)
def context_bucket(n: int, min_bucket: int, block_size: int, max_blocks: int) -> int:
  """The attention context (cache slots) a prefill of ``n`` tokens runs over: the power-of-two bucket, at
  least one block, and never more than the row's ``max_blocks`` blocks -- a 34,814-token recompute at
  ``max_len`` 34,816 runs over 34,816 slots, not 65,536 (half the prefill's activations)."""
  return min(max(length_bucket(n, minimum=min_bucket), block_size), max_blocks * block_size)


def prefill_batch_rows(prefill_rows: int, shards: int) -> int:
  """Rows of one prefill call: ``prefill_rows`` rounded up to a multiple of the pool's shards, so that
  every shard prefills the same number of its own rows (the row-local prefill, :meth:`_Programs._prefill`)."""
  return -(-prefill_rows // shards) * shards


@functools.lru_cache(maxsize=64)
def engine_programs(graphdef, cfg, mesh, rules, cache_dtype, paged_impl, num_slots, max_len, max_blocks, num_blocks,
                    block_size, row_tile, top_logprobs: int = 0, entropy: bool = False) -> _Programs:
  """The engine programs for one (model structure, mesh, rules, settings), memoized like the sampler's:
  engines of equal settings (each paged ``Sampler.generate`` call builds one) share compiled programs."""
  return _Programs(graphdef, cfg, mesh, rules, cache_dtype, paged_impl, num_slots, max_len, max_blocks, num_blocks,
                   block_size, row_tile, top_logprobs, entropy)
