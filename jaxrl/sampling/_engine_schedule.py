"""The scheduling rounds of the rollout engine: admit, reserve blocks, decode, retire (host side).

:class:`Scheduler` is the base class of :class:`jaxrl.sampling.Engine` and holds the schedule that the
engine's module docstring describes: :meth:`Scheduler.step` runs one round -- finished rows leave their
slots, waiting rows are admitted (their caches prefilled chunk by chunk, a prompt's samples forked from
its blocks), running rows get the blocks their next steps write (preempting the latest admitted when the
pool runs dry), then one decode call. The engine builds the state it works on (the pool, the queues, the
device programs and their buffers) and its public API (submit, generate, update_weights) drives it.
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.sampling._engine_programs import EnginePrograms, context_bucket, prefill_batch_rows
from jaxrl.sampling._engine_rows import (
    Completion,
    EngineMetrics,
    PrefillJob,
    Row,
    RowGroup,
    block_pairs,
    chunk_vision,
    completion,
    install_fields,
    slot_index,
    table_rows,
)
from jaxrl.sampling._paged import BlockPool, blocks_for
from jaxrl.sampling._requests import next_pow2
from jaxrl.sampling._vision import patch_bucket, vision_rows


class Scheduler:
  """The engine's scheduling rounds over the state below, which :class:`jaxrl.sampling.Engine` sets up."""

  cfg: object
  num_slots: int
  max_len: int
  block_size: int
  max_blocks: int
  num_blocks: int
  dp: int
  "Cache-batch shards: slot ``s`` and its blocks live on shard ``s // (num_slots // dp)``."
  steps_per_call: int
  prefill_rows: int
  prefill_chunk: int | None
  min_bucket: int
  max_top_logprobs: int
  entropy: bool
  tokenizer: object
  version: int
  params: object
  pages: tuple
  slots: object
  pool: BlockPool
  metrics: EngineMetrics
  _programs: EnginePrograms
  _stops: object
  _stop_strings: tuple
  _waiting: collections.deque[Row]
  _running: dict[int, Row]
  _finished: collections.deque[Completion]
  _admissions: int
  _holding: list[RowGroup]
  _jobs: list[PrefillJob]
  _parked: list[Row]
  _started: float | None

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
        self._jobs.append(PrefillJob(row=row, seq=(row.prompt + row.tokens)[:-1], recompute=False))
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
      self.pages = self._programs.copy(self.pages, *block_pairs(src, dst, self.num_blocks))
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

  def _drop_group(self, g: RowGroup) -> None:
    self.pool.release(g.blocks)
    g.blocks = None
    self._holding.remove(g)

  def _shard(self, slot: int) -> int:
    return slot // (self.num_slots // self.dp)

  def _pick_slot(self, free: list[int], row: Row) -> int:
    """A free slot, on the shard of the row's group's blocks when it has some."""
    g = row.group
    if (g.blocks or g.prefilling) and self.dp > 1:
      shard = self.pool.shard_of(g.blocks[0]) if g.blocks else g.shard
      for s in free:
        if s // (self.num_slots // self.dp) == shard:
          return s
    # Spread over shards: the shard with the most free blocks among those with a free slot.
    return max(free, key=lambda s: (self.pool.free_count(s // (self.num_slots // self.dp)), -s))

  def _fork_plan(self, row: Row, src: list[int], shard: int):
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
    changed: dict[int, Row] = {}
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

  def _preempt(self, row: Row) -> None:
    self._sync_tokens([row])
    self._release_rows([row])
    self.metrics.preemptions += 1
    self._waiting.appendleft(row)

  def _release_rows(self, rows: list[Row]) -> None:
    for row in rows:
      del self._running[row.slot]
      self.pool.release(row.blocks)
      row.blocks = []
    self.slots = self._programs.free(self.slots, slot_index([row.slot for row in rows], self.num_slots))
    for row in rows:
      row.slot = -1

  def _sync_tokens(self, rows: list[Row]) -> None:
    """Copies the rows' generated tokens, log-probs and versions to the host."""
    idx = slot_index([r.slot for r in rows], self.num_slots)
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

  def _retire(self, ended: list[tuple[int, Row, int]]) -> None:
    rows = [row for _, row, _ in ended]
    self._sync_tokens(rows)
    self._release_rows(rows)
    for _, row, reason in ended:
      self._finished.append(completion(row, reason, tokenizer=self.tokenizer, stop_strings=self._stop_strings,
                                       max_top_logprobs=self.max_top_logprobs))

  # ------------------------------------------------------------------------------------------------
  # Device programs, called from the schedule

  def _prefill_chunks(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
    """One chunk (``prefill_chunk`` tokens, or the rest) of every job's cache; returns the jobs whose
    cache is complete. A chunk's queries read the earlier chunks' keys/values from the row's blocks."""
    by_shape: dict[tuple[int, int], list[PrefillJob]] = collections.defaultdict(list)
    for job in jobs:
      n = len(job.seq)
      if job.done < n:
        p = context_bucket(n, self.min_bucket, self.block_size, self.max_blocks)  # context of the row
        t = p - job.done if self.prefill_chunk is None else min(self.prefill_chunk, p - job.done)
        by_shape[(p, t)].append(job)
    m = self.metrics
    self._embed_images(jobs)
    u = prefill_batch_rows(self.prefill_rows, self.dp)
    per = u // self.dp  # rows of each pool shard per call: row k lives on shard k // per (row-local prefill)
    for (p, t), items in sorted(by_shape.items()):
      by_shard: list[list[PrefillJob]] = [[] for _ in range(self.dp)]
      for job in items:
        by_shard[self.pool.shard_of(job.row.blocks[0])].append(job)
      for i in range(0, max(len(q) for q in by_shard), per):
        toks = np.zeros((u, t), np.int32)
        start = np.zeros((u,), np.int32)
        n_cache = np.zeros((u,), np.int32)
        tables = np.full((u, p // self.block_size), self.num_blocks, np.int32)
        vl = dict(rope=np.zeros((u, t, 3), np.int32), feat_mask=np.zeros((u, t), bool),
                  feat_idx=np.zeros((u, t), np.int32), feats=[None] * u)
        for k, job in ((d * per + j, job) for d, q in enumerate(by_shard) for j, job in enumerate(q[i:i + per])):
          if self.cfg.mrope_section is not None:
            vl["rope"][k], vl["feat_mask"][k], vl["feat_idx"][k] = chunk_vision(job.row, job.done, t,
                                                                                self.cfg.image_token_id)
            vl["feats"][k] = job.feats
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
                                            np.asarray(tables), np.asarray(start), **self._vision_args(vl))
    return [job for job in jobs if job.done >= len(job.seq)]

  def _embed_images(self, jobs: list[PrefillJob]) -> None:
    """Runs the vision tower once for every job with images and no features yet (one call per patch
    bucket, over its jobs' rows); each job keeps its rows for all its prefill chunks."""
    todo = [j for j in jobs if j.row.images is not None and j.feats is None and j.done < len(j.seq)]
    by_bucket: dict[int, list[PrefillJob]] = collections.defaultdict(list)
    for job in todo:
      by_bucket[patch_bucket(job.row.images.num_patches, self.cfg.vision.spatial_merge_size)].append(job)
    for _, items in sorted(by_bucket.items()):
      a = next_pow2(len(items))
      images = vision_rows(self.cfg, [j.row.images for j in items] + [None] * (a - len(items)), a)
      feats = self._programs.embed(self.params, images)  # [A, M, D]
      for k, job in enumerate(items):
        job.feats = feats[k]
    self.metrics.tower_calls += len(by_bucket)

  def _vision_args(self, vl: dict) -> dict:
    """The VLM keywords of a prefill call: rotary positions, and the tower's rows of the call's jobs
    stacked ``[U, M, D]`` when a chunk holds image tokens."""
    if self.cfg.mrope_section is None:
      return {}
    out = dict(rope=vl["rope"])
    feats = vl["feats"]
    if vl["feat_mask"].any():
      have = [f for f in feats if f is not None]
      most = max(f.shape[0] for f in have)
      zero = jnp.zeros((most, have[0].shape[1]), have[0].dtype)
      rows = [zero if f is None else jnp.pad(f, ((0, most - f.shape[0]), (0, 0))) for f in feats]
      out.update(feats=jnp.stack(rows), feat_idx=vl["feat_idx"], feat_mask=vl["feat_mask"])
    return out

  def _install(self, rows: list[Row]) -> None:
    """Loads the rows' state (table, sampling parameters, key, tokens so far) into their slots."""
    f = install_fields(rows, num_slots=self.num_slots, max_blocks=self.max_blocks, num_blocks=self.num_blocks,
                       max_len=self.max_len, k_top=self.max_top_logprobs, entropy=self.entropy,
                       rope=self.cfg.mrope_section is not None)
    for row in rows:
      row.n_gen = len(row.tokens)
      if row.n_gen and row.first_token is None:
        row.first_token = time.perf_counter()
    self.slots = self._programs.install(self.slots, {k: np.asarray(v) for k, v in f.items()})

  def _set_tables(self, rows: list[Row]) -> None:
    slot, tables = table_rows(rows, num_slots=self.num_slots, max_blocks=self.max_blocks, num_blocks=self.num_blocks)
    self.slots = self._programs.set_tables(self.slots, slot, tables)
