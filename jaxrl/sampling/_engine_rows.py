"""The rollout engine's host-side rows: their records, the checks of requests, and their packing.

:class:`Completion` (a finished sample) and :class:`EngineMetrics` are public; :class:`Row` (one sample
of a request, as the scheduler tracks it), :class:`RowGroup` (the samples of one prompt sharing its
prefilled blocks) and :class:`PrefillJob` (a row whose cache is being written) are the scheduler's
records. The functions pack rows into the host arrays the engine's device programs take
(:func:`install_fields`, :func:`table_rows`, :func:`slot_index`, :func:`block_pairs`) and turn what
comes back into completions and a :class:`jaxrl.sampling.SampleOutput` (:func:`completion`,
:func:`sample_output`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

from jaxrl.sampling._requests import FINISH_REASONS, Request, length_bucket, next_pow2, stop_string_end
from jaxrl.sampling._rows import SampleOutput, TopLogprobs
from jaxrl.sharding import allgather_scalar

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
  tower_calls: int = 0
  "Vision-tower program calls (a VLM: one per patch bucket of the prompts whose images are prefilled)."
  preemptions: int = 0
  interruptions: int = 0
  busy_slot_steps: int = 0
  time_to_first_token: list[float] = dataclasses.field(default_factory=list)
  decode_seconds: float = 0.0


@dataclasses.dataclass
class RowGroup:
  """A prompt's prefilled blocks, held (one reference) until all its samples are admitted."""

  blocks: list[int] | None = None
  left: int = 0
  prefilling: bool = False  # the first sample's prompt is being prefilled; the others wait in slots
  shard: int = -1  # data shard of that prefill


@dataclasses.dataclass
class Row:
  """One sample of a request as the scheduler tracks it: its tokens so far (mirrored from its slot when it
  leaves it), its slot and blocks while admitted."""

  request: Request
  prompt: list[int]
  sample: int
  index: int
  max_new: int
  group: RowGroup
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
  images: object = None  # VLM: the prompt's PromptImages (None: text only)
  rope: np.ndarray | None = None  # VLM: [len(prompt), 3] int32, the prompt's rotary positions
  rope_delta: int = 0  # VLM: generated token at position p rotates by p + rope_delta

  def rope_positions(self, start: int, count: int) -> np.ndarray:  # [count, 3] int32
    """Rotary positions of sequence positions ``start .. start + count - 1``: the prompt's, then
    ``p + rope_delta`` (:func:`jaxrl.models.decode_rope_positions`)."""
    pos = np.arange(start, start + count, dtype=np.int32)
    out = np.repeat((pos + self.rope_delta)[:, None], 3, axis=1)
    inside = pos < len(self.prompt)
    out[inside] = self.rope[pos[inside]]
    return out


@dataclasses.dataclass(eq=False)
class PrefillJob:
  """A row whose cache is being written, ``prefill_chunk`` tokens per scheduling round."""

  row: Row
  seq: list[int]  # the tokens to cache: prompt + generated, but the pending last one
  recompute: bool  # the row already sits in its slot (a weight update); otherwise install when done
  done: int = 0  # tokens of ``seq`` cached so far
  feats: object = None  # VLM: the tower's output for the row's images [M, D] (device), once per job



def check_request(r: Request) -> None:
  """Raises ValueError naming the first field of ``r`` out of its range."""
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


def check_same_everywhere(requests: Sequence[Request], prompts: list[list[int]]) -> None:
  """Raises unless every process submits the same requests (a CRC of them, compared across processes)."""
  text = repr([(ids, dataclasses.replace(r, prompt=())) for r, ids in zip(requests, prompts)])
  digests = allgather_scalar(np.int64(zlib.crc32(text.encode())))
  if len(set(digests.tolist())) != 1:
    raise ValueError(f"Engine.submit on {len(digests)} processes: every process must submit the same requests in "
                     "the same order (the schedule runs on every process); Engine.generate gathers per-process "
                     "prompts itself")


def install_fields(rows: list[Row], *, num_slots: int, max_blocks: int, num_blocks: int, max_len: int,
                   k_top: int, entropy: bool, rope: bool = False) -> dict[str, np.ndarray]:
  """The rows' slot state (slot, table, sampling parameters, key inputs, tokens so far) as the host arrays
  of one install call: ``next_pow2(len(rows))`` entries, the padding aimed at slot ``num_slots`` (dropped);
  the generated-so-far columns are ``length_bucket`` wide (padded to ``max_len`` on the device)."""
  a = next_pow2(len(rows))
  g = min(length_bucket(max(len(r.tokens) for r in rows), minimum=8), max_len)  # padded on device
  f = dict(slot=np.full((a,), num_slots, np.int32), tables=np.full((a, max_blocks), num_blocks, np.int32),
           prompt_len=np.ones((a,), np.int32), prompt_last=np.zeros((a,), np.int32),
           tokens=np.zeros((a, g), np.int32), logprobs=np.zeros((a, g), np.float32),
           sampling_logprobs=np.zeros((a, g), np.float32), versions=np.full((a, g), -1, np.int32),
           n_gen=np.zeros((a,), np.int32), seed=np.zeros((a,), np.uint32), request=np.zeros((a,), np.int32),
           sample=np.zeros((a,), np.int32), temperature=np.zeros((a,), np.float32),
           top_k=np.zeros((a,), np.int32), top_p=np.ones((a,), np.float32), min_p=np.zeros((a,), np.float32),
           max_new=np.ones((a,), np.int32))
  if entropy:
    f["entropy"] = np.zeros((a, g), np.float32)
  if rope:
    f["rope_delta"] = np.asarray([r.rope_delta for r in rows] + [0] * (a - len(rows)), np.int32)
  if k_top:
    f["top_ids"] = np.zeros((a, g, k_top), np.int32)
    f["top_values"] = np.zeros((a, g, k_top), np.float32)
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
    if entropy and n:
      f["entropy"][k, :n] = row.entropy
    if k_top and n:
      f["top_ids"][k, :n] = row.top_ids
      f["top_values"][k, :n] = row.top_values
    f["n_gen"][k] = n
    f["seed"][k] = r.seed % 2**32
    f["request"][k] = r.request_id
    f["sample"][k] = row.sample
    f["temperature"][k], f["top_k"][k], f["top_p"][k], f["min_p"][k] = r.temperature, r.top_k, r.top_p, r.min_p
    f["max_new"][k] = row.max_new
  return f


def chunk_vision(row: Row, start: int, count: int, image_token: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A VLM row's prefill inputs for sequence positions ``start .. start + count - 1``: rotary positions
  ``[count, 3]``, which tokens take an image embedding ``[count]`` (the prompt's image tokens only: a
  generated image-pad token is a token) and their row of the tower's output ``[count]``."""
  rope = row.rope_positions(start, count)
  pos = np.arange(start, start + count)
  prompt = np.asarray(row.prompt)
  inside = pos < len(prompt)
  mask = np.zeros((count,), bool)
  idx = np.zeros((count,), np.int32)
  if row.images is not None:
    is_image = prompt == image_token
    mask[inside] = is_image[pos[inside]]
    idx[inside] = np.maximum(np.cumsum(is_image) - 1, 0)[pos[inside]]
  return rope, mask, idx


def table_rows(rows: list[Row], *, num_slots: int, max_blocks: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
  """``(slot [A], tables [A, max_blocks])`` of the rows' block tables, padded to ``A = next_pow2(len(rows))``
  (padding: slot ``num_slots``, block ``num_blocks``, both dropped on the device)."""
  a = next_pow2(len(rows))
  slot = np.full((a,), num_slots, np.int32)
  tables = np.full((a, max_blocks), num_blocks, np.int32)
  for k, row in enumerate(rows):
    slot[k] = row.slot
    tables[k, :len(row.blocks)] = row.blocks
  return slot, tables


def slot_index(slots: list[int], num_slots: int) -> np.ndarray:
  """``slots`` padded with ``num_slots`` (dropped on the device) to ``next_pow2(len(slots))`` entries."""
  a = next_pow2(len(slots))
  idx = np.full((a,), num_slots, np.int32)
  idx[:len(slots)] = slots
  return idx


def block_pairs(src, dst, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
  """Block copies ``src -> dst`` padded to ``next_pow2(len(src))`` pairs (padding copies into block
  ``num_blocks``, dropped on the device)."""
  a = next_pow2(len(src))
  s = np.zeros((a,), np.int32)
  d = np.full((a,), num_blocks, np.int32)
  s[:len(src)] = src
  d[:len(dst)] = dst
  return s, d


def completion(row: Row, reason: int, *, tokenizer, stop_strings: tuple[str, ...], max_top_logprobs: int
               ) -> Completion:
  """The finished row (its tokens synced to the host) as a :class:`Completion`, cut at the first stop string."""
  n = len(row.tokens)
  tokens = np.asarray(row.tokens, np.int32)
  finish = FINISH_REASONS[reason]
  if stop_strings and tokenizer is not None:
    cut = stop_string_end(tokenizer, tokens, stop_strings)
    if cut is not None and (cut < n or finish != "stop"):
      n, finish = cut, "stop"
  k = row.request.top_logprobs
  top = lambda a, dt: np.asarray(a[:n], dt).reshape(n, max_top_logprobs)[:, :k] if k else None
  return Completion(
      request_id=row.request.request_id, sample=row.sample, prompt=np.asarray(row.prompt, np.int32),
      tokens=tokens[:n], logprobs=np.asarray(row.logprobs[:n], np.float32),
      sampling_logprobs=np.asarray(row.sampling_logprobs[:n], np.float32),
      versions=np.asarray(row.versions[:n], np.int32), finish_reason=finish, index=row.index,
      top_ids=top(row.top_ids, np.int32), top_logprobs=top(row.top_values, np.float32),
      entropy=np.asarray(row.entropy[:n], np.float32) if row.request.entropy else None)


def sample_output(rows: dict[int, Completion], count: int, n: int, max_new_tokens: int, *, pad_token_id: int,
                  tokenizer, k_top: int = 0, want_entropy: bool = False) -> SampleOutput:
  """The completions of ``count`` prompts times ``n`` samples (keyed by :attr:`Completion.index`) as the
  :class:`SampleOutput` of :meth:`jaxrl.sampling.Sampler.generate` (``[count·n, max_new_tokens]``, padded)."""
  total = count * n
  m = max_new_tokens
  tokens = np.full((total, m), pad_token_id, np.int32)
  lp = np.zeros((total, m), np.float32)
  slp = np.zeros((total, m), np.float32)
  versions = np.full((total, m), -1, np.int32)
  lengths = np.zeros((total,), np.int32)
  top_ids = np.full((total, m, k_top), pad_token_id, np.int32)
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
  if tokenizer is not None:
    texts = [tokenizer.decode(tokens[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(total)]
  return SampleOutput(tokens=tokens, logprobs=lp, sampling_logprobs=slp, lengths=lengths, finish_reason=reasons,
                      versions=versions, prompt_lengths=np.asarray([len(rows[i].prompt) for i in range(total)],
                                                                   np.int32),
                      prompt_index=np.repeat(np.arange(count, dtype=np.int32), n), texts=texts,
                      top_logprobs=TopLogprobs(ids=top_ids, logprobs=top_lp) if k_top else None,
                      entropy=ent if want_entropy else None)
