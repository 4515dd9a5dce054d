"""A batching queue in front of a generate backend: concurrent requests share one ``generate`` call.

The backend is anything with :meth:`jaxrl.sampling.Sampler.generate`'s signature (the sampler, or an
engine with a generate-compatible API). Every request is expanded into rows (one per prompt and
sample); rows of requests that arrive within ``batch_wait_s`` of each other, up to ``max_batch_rows``,
are generated together with ``n=1``, each row keeping its own temperature, top-p and top-k and its own
PRNG stream (:func:`row_request_id`), so a row's tokens do not depend on what it was batched with.
The batch runs to the longest requested ``max_tokens``; shorter requests are cut back to their own
``max_tokens`` (finish reason ``length``), which leaves their tokens unchanged.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Backend", "Batcher", "GenRequest", "RowResult", "row_request_id"]


class Backend(Protocol):
  """What the batcher needs: :meth:`jaxrl.sampling.Sampler.generate` (``tokenizer`` and ``max_len`` too)."""

  tokenizer: Any
  max_len: int

  def generate(self, prompts, *, n: int, max_new_tokens: int, temperature, top_p, top_k, seed: int,
               request_ids: Sequence[int], stop_strings: Sequence[str], return_top_logprobs: int) -> Any: ...


def row_request_id(seed: int, prompt_index: int, sample_index: int) -> int:
  """The sampler ``request_id`` (with base seed 0) of sample ``sample_index`` of prompt ``prompt_index``
  in a request with ``seed``: a CRC-32 of the three numbers, in ``[0, 2**31)``."""
  return zlib.crc32(f"{int(seed)}:{int(prompt_index)}:{int(sample_index)}".encode()) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenRequest:
  """One HTTP request's generation: ``n`` samples of each of ``prompts`` (token ids)."""

  prompts: list[list[int]]
  n: int = 1
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop: tuple[str, ...] = ()
  top_logprobs: int = 0
  echo: bool = False
  """``/v1/completions`` ``echo``: the prompt (with its log-probs) is prepended; ``max_tokens`` may be 0."""
  echo_temperature: float = 1.0
  """``echo_temperature`` (a jaxrl extension): the prompt log-probs are ``log_softmax(logits / T)``."""
  prompt_texts: tuple[str | None, ...] = ()
  """The prompts as sent, where they were text (for the echoed text and its offsets)."""
  images: tuple = ()
  """A VLM's images per prompt (``{pixel_values, grid_thw}`` or None); empty: text prompts."""


@dataclasses.dataclass(frozen=True)
class RowResult:
  """One completion: ``tokens`` with their log-probs (``log_softmax(logits / T)``, untruncated)."""

  tokens: list[int]
  logprobs: list[float]
  top_ids: list[list[int]]  # [len, k]
  top_logprobs: list[list[float]]  # [len, k]
  finish_reason: str  # "eos" | "stop" | "length"
  prompt_tokens: int
  prompt_logprobs: Any = None
  """With ``echo``: the prompt's :class:`jaxrl.serve._score.PromptLogprobs`."""


@dataclasses.dataclass
class _Job:
  req: GenRequest | None
  future: cf.Future
  fn: Any = None  # a callable run alone on the worker thread (prompt scoring), instead of ``req``

  @property
  def rows(self) -> int:
    return 0 if self.req is None else len(self.req.prompts) * self.req.n


class Batcher:
  """Runs ``backend.generate`` on a worker thread over batches of queued requests.

  Args:
    backend: a sampler or engine (only this thread calls it).
    max_batch_rows: most rows per ``generate`` call (a request larger than this runs alone).
    batch_wait_s: how long the first request of a batch waits for others to join it.
  """

  def __init__(self, backend: Backend, *, max_batch_rows: int = 64, batch_wait_s: float = 0.01):
    if max_batch_rows < 1:
      raise ValueError(f"max_batch_rows: must be >= 1, got {max_batch_rows!r}")
    if batch_wait_s < 0:
      raise ValueError(f"batch_wait_s: must be >= 0, got {batch_wait_s!r}")
    self.backend = backend
    self.max_batch_rows = max_batch_rows
    self.batch_wait_s = batch_wait_s
    self.batch_sizes: list[int] = []
    """Rows of every ``generate`` call made so far (for tests and benchmarks)."""
    self._queue: queue.Queue[_Job | None] = queue.Queue()
    self._held: _Job | None = None
    self._thread = threading.Thread(target=self._loop, name="jaxrl-serve-batcher", daemon=True)
    self._thread.start()

  def submit(self, req: GenRequest) -> cf.Future:
    """Queues ``req``; the future resolves to ``list[list[RowResult]]`` (per prompt, per sample)."""
    fut: cf.Future = cf.Future()
    self._queue.put(_Job(req, fut))
    return fut

  def call(self, fn) -> cf.Future:
    """Queues ``fn()`` to run on the worker thread between generate calls (so device work stays serial);
    the future resolves to its result."""
    fut: cf.Future = cf.Future()
    self._queue.put(_Job(None, fut, fn))
    return fut

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=60)

  # ------------------------------------------------------------------------------------------------

  def _next_batch(self) -> list[_Job] | None:
    first = self._held or self._queue.get()
    self._held = None
    if first is None:
      return None
    if first.fn is not None:
      return [first]
    jobs, rows = [first], first.rows
    deadline = time.monotonic() + self.batch_wait_s
    while rows < self.max_batch_rows:
      try:
        job = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
      except queue.Empty:
        break
      if job is None:
        self._queue.put(None)
        break
      if job.fn is not None or rows + job.rows > self.max_batch_rows or job.req.stop != first.req.stop:
        self._held = job  # starts the next batch
        break
      jobs.append(job)
      rows += job.rows
    return jobs

  def _loop(self) -> None:
    while True:
      jobs = self._next_batch()
      if jobs is None:
        return
      if jobs[0].fn is not None:
        try:
          jobs[0].future.set_result(jobs[0].fn())
        except Exception as e:  # noqa: BLE001 (reported to the request, not the server)
          jobs[0].future.set_exception(e)
        continue
      try:
        results = self._run(jobs)
      except Exception as e:  # a bad batch fails its requests, not the server
        for job in jobs:
          job.future.set_exception(e)
        continue
      for job, res in zip(jobs, results):
        job.future.set_result(res)

  def _run(self, jobs: list[_Job]) -> list[list[list[RowResult]]]:
    prompts, temp, top_p, top_k, rids, images = [], [], [], [], [], []
    for job in jobs:
      r = job.req
      for p, ids in enumerate(r.prompts):
        for j in range(r.n):
          prompts.append(ids)
          images.append(r.images[p] if r.images else None)
          temp.append(r.temperature)
          top_p.append(r.top_p)
          top_k.append(r.top_k)
          rids.append(row_request_id(r.seed, p, j))
    k = max(job.req.top_logprobs for job in jobs)
    self.batch_sizes.append(len(prompts))
    out = self.backend.generate(
        prompts, n=1, max_new_tokens=max(job.req.max_tokens for job in jobs), temperature=np.asarray(temp, np.float32),
        top_p=np.asarray(top_p, np.float32), top_k=np.asarray(top_k, np.int32), seed=0, request_ids=rids,
        stop_strings=list(jobs[0].req.stop), return_top_logprobs=k,
        **({"images": images} if any(x is not None for x in images) else {}))
    results, row = [], 0
    for job in jobs:
      r, per_prompt = job.req, []
      for ids in r.prompts:
        samples = []
        for _ in range(r.n):
          length, reason = int(out.lengths[row]), out.finish_reason[row]
          if length > r.max_tokens:
            length, reason = r.max_tokens, "length"
          kk = r.top_logprobs
          top_ids = out.top_logprobs.ids[row, :length, :kk].tolist() if kk else []
          top_lp = out.top_logprobs.logprobs[row, :length, :kk].tolist() if kk else []
          samples.append(RowResult(tokens=out.tokens[row, :length].tolist(), logprobs=out.logprobs[row, :length].tolist(),
                                   top_ids=top_ids, top_logprobs=top_lp, finish_reason=reason, prompt_tokens=len(ids)))
          row += 1
        per_prompt.append(samples)
      results.append(per_prompt)
    return results
