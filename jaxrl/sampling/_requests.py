"""Requests, stop rules and prompt encoding: the host-side contract the whole-batch
:class:`~jaxrl.sampling.Sampler` and the rollout :class:`~jaxrl.sampling.Engine` share.

Plain functions over ``(tokenizer, vocab_size, ...)``: both callers pass their own settings, neither
reaches into the other. Stop tables are right-aligned token sequences matched on device by the decode
step (:func:`jaxrl.sampling._rows.emit`); stop strings are cut exactly on the host
(:func:`stop_string_end`).
  """

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jaxrl import sharding

FINISH_REASONS = ("interrupted", "eos", "stop", "length")
"""``reason`` codes 0..3; ``interrupted`` only appears for rows a step budget left unfinished."""
NEVER = -3  # a stop-sequence entry that matches no token
ANY = -1  # a left-padding entry of a right-aligned stop sequence: matches anything


def length_bucket(n: int, *, minimum: int = 8, maximum: int | None = None) -> int:
  """The power of two ``>= max(n, minimum)``, capped at ``maximum``."""
  b = next_pow2(max(int(n), int(minimum), 1))
  return b if maximum is None else min(b, int(maximum))


def next_pow2(n: int) -> int:
  """The power of two ``>= n`` (``n >= 1``)."""
  return 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------------------------------
# Requests and results


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
  """One prompt to complete ``n`` times (samples ``0..n-1``)."""

  prompt: Sequence[int] | str
  n: int = 1
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int = 0
  request_id: int = 0
  "With the seed, fixes the row's draws (as ``request_ids`` in :meth:`Sampler.generate`)."
  top_logprobs: int = 0
  "Also return the ``k`` most likely tokens per step (at most the engine's ``max_top_logprobs``)."
  entropy: bool = False
  "Also return the per-token entropy of ``softmax(logits / T)`` (needs an engine with ``entropy=True``)."
  images: object = None
  "A VLM prompt's images: :class:`jaxrl.sampling.PromptImages` or ``{pixel_values, grid_thw}`` (``encode_vl_prompt``)."


class Stops(NamedTuple):
  """Stop sequences as the decode step matches them (built by :func:`build_stops`)."""

  seqs: jax.Array  # [M, Ls] int32, right-aligned, ANY-padded on the left
  kind: jax.Array  # [M] int32: 1 eos, 2 stop, 0 dummy


def special_tokens(tokenizer, eos_token_ids, pad_token_id, check) -> tuple[tuple[int, ...], int]:
  """``(eos ids, pad id)`` from the arguments, defaulting to the tokenizer's (no eos, pad 0 without one);
  ``check(token, key)`` turns each eos entry (an id or a token string) into a validated id."""
  if eos_token_ids is None:
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_token_ids = [] if eos is None else [eos]
  if pad_token_id is None:
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
  return tuple(check(t, "eos_token_ids") for t in eos_token_ids), int(0 if pad_token_id is None else pad_token_id)


def per_prompt(name: str, value, count: int, dtype, check) -> np.ndarray:
  """``value`` (a scalar or one per prompt) as ``count`` values of ``dtype``, each passing ``check``."""
  arr = np.asarray(value, dtype=np.float64)
  if arr.ndim == 0:
    arr = np.full((count,), arr)
  elif arr.shape != (count,):
    raise ValueError(f"{name}: expected a scalar or one value per prompt ({count}), got shape {arr.shape}")
  for i, x in enumerate(arr):
    if not check(x):
      raise ValueError(f"{name}: invalid value {value if np.ndim(value) == 0 else value[i]!r}"
                       + ("" if np.ndim(value) == 0 else f" for prompt {i}"))
  return arr.astype(dtype)


def check_token(tokenizer, vocab_size: int, t, name: str) -> int:
  """``t`` (a token id or a token string of the tokenizer) as a validated id in ``[0, vocab_size)``."""
  if isinstance(t, str):
    if tokenizer is None:
      raise ValueError(f"{name}: {t!r} is a string but the sampler has no tokenizer")
    tid = tokenizer.convert_tokens_to_ids(t)
    unk = getattr(tokenizer, "unk_token_id", None)
    if tid is None or (tid == unk and t != getattr(tokenizer, "unk_token", None)):
      raise ValueError(f"{name}: {t!r} is not a token of the tokenizer's vocabulary")
    t = tid
  if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab_size:
    raise ValueError(f"{name}: {t!r} is not a token id in [0, {vocab_size})")
  return int(t)


def encode_prompts(tokenizer, prompts, *, vocab_size: int, max_len: int, add_special_tokens: bool) -> list[list[int]]:
  """Token-id lists of ``prompts`` (one string or id list, or a list of them), each non-empty, in the
  vocabulary and shorter than ``max_len``; strings are encoded with the tokenizer."""
  if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                  and all(isinstance(x, (int, np.integer)) for x in prompts)):
    prompts = [prompts]
  if isinstance(prompts, np.ndarray):
    prompts = list(prompts) if prompts.ndim == 2 else [prompts]
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts: expected a non-empty list of strings or token-id lists")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if tokenizer is None:
        raise ValueError(f"prompts[{i}] is a string but the sampler has no tokenizer")
      ids = list(tokenizer.encode(p, add_special_tokens=add_special_tokens))
    else:
      ids = [int(t) for t in np.asarray(p).reshape(-1)] if np.ndim(p) else None
      if ids is None:
        raise ValueError(f"prompts[{i}]: expected a string or a list of token ids, got {p!r}")
      bad = [t for t in ids if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"prompts[{i}]: token ids {bad[:4]} are outside [0, {vocab_size})")
    if not ids:
      raise ValueError(f"prompts[{i}] is empty (no tokens); every prompt needs at least one token")
    if len(ids) >= max_len:
      raise ValueError(f"prompts[{i}] has {len(ids)} tokens, but max_len={max_len} leaves no room for a "
                       "completion; shorten the prompt or raise max_len")
    out.append(ids)
  return out


def build_stops(tokenizer, vocab_size: int, eos_token_ids, stop_token_ids,
                stop_strings) -> tuple[Stops, tuple[str, ...]]:
  """The device stop table (eos ids, stop ids, encoded stop strings) and the stop strings, as a tuple."""
  if isinstance(stop_strings, str):
    stop_strings = [stop_strings]
  seqs = [([t], 1) for t in eos_token_ids]
  seqs += [([check_token(tokenizer, vocab_size, t, "stop_token_ids")], 2) for t in stop_token_ids]
  for s in stop_strings:
    if not isinstance(s, str) or not s:
      raise ValueError(f"stop_strings: {s!r} is not a non-empty string")
    if tokenizer is None:
      raise ValueError("stop_strings need a tokenizer")
    ids = list(tokenizer.encode(s, add_special_tokens=False))
    if ids:
      seqs.append((ids, 2))
  m = next_pow2(max(len(seqs), 1))
  ls = next_pow2(max([len(s) for s, _ in seqs] + [1]))
  arr = np.full((m, ls), NEVER, np.int32)
  kind = np.zeros((m,), np.int32)
  for i, (s, k) in enumerate(seqs):
    arr[i, :ls - len(s)] = ANY
    arr[i, ls - len(s):] = s
    kind[i] = k
  return Stops(jax.device_put(arr), jax.device_put(kind)), tuple(stop_strings)


def stop_string_end(tokenizer, tokens: np.ndarray, stop_strings: tuple[str, ...]) -> int | None:
  """Fewest leading tokens whose decoded text contains a stop string, or None."""
  decode = lambda k: tokenizer.decode(tokens[:k].tolist(), skip_special_tokens=False)
  if not any(s in decode(len(tokens)) for s in stop_strings):
    return None
  lo, hi = 1, len(tokens)  # answer in [lo, hi]
  while lo < hi:
    mid = (lo + hi) // 2
    if any(s in decode(mid) for s in stop_strings):
      hi = mid
    else:
      lo = mid + 1
  return lo


class PromptArgs(NamedTuple):
  """One ``generate`` call's per-prompt arguments, checked: an entry per prompt."""
  temperature: np.ndarray  # [U] float32
  top_p: np.ndarray  # [U] float32
  top_k: np.ndarray  # [U] int32
  min_p: np.ndarray  # [U] float32
  request_ids: np.ndarray  # [U] ints in [0, 2**31)
  thoughts: np.ndarray  # [U] int32, continuous thoughts per prompt (latent mode; zero otherwise)


def check_counts(*, n, max_new_tokens) -> None:
  """Refuses a bad ``n`` (samples per prompt) or ``max_new_tokens`` of a ``generate`` call."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"n: must be a positive int, got {n!r}")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")


def prompt_args(count: int, procs: int, *, temperature, top_p, top_k, min_p, request_ids) -> PromptArgs:
  """The sampling knobs and request ids of ``count`` prompts, checked, one entry per prompt (``thoughts``
  zero). Default request ids are ``0..count-1``, offset by ``process_index * count`` on several processes,
  so that every process's rows get distinct ids (and draws) on the same schedule; the sampler and the
  engine both take them from here."""
  temp = per_prompt("temperature", temperature, count, np.float32, lambda x: np.isfinite(x) and x >= 0)
  tp = per_prompt("top_p", top_p, count, np.float32, lambda x: 0 < x <= 1)
  tk = per_prompt("top_k", top_k, count, np.int32, lambda x: x >= 0 and x == int(x))
  mp = per_prompt("min_p", min_p, count, np.float32, lambda x: 0 <= x <= 1)
  if request_ids is None:
    request_ids = np.arange(count) + (jax.process_index() * count if procs > 1 else 0)
  request_ids = np.asarray(request_ids)
  if (request_ids.shape != (count,) or not np.issubdtype(request_ids.dtype, np.integer)
      or (request_ids < 0).any() or (request_ids >= 2**31).any()):
    raise ValueError(f"request_ids: expected {count} ints in [0, 2**31), got {request_ids!r}")
  return PromptArgs(temperature=temp, top_p=tp, top_k=tk, min_p=mp, request_ids=request_ids,
                    thoughts=np.zeros((count,), np.int32))


def gather_prompts(ids: list[list[int]], per_prompt: tuple[np.ndarray, ...]):
  """Every process's prompts and per-prompt arrays, process 0's first (equal counts are required)."""
  counts = sharding.allgather_scalar(len(ids))
  if len(set(counts.tolist())) != 1:
    raise ValueError(f"generate on {len(counts)} processes needs the same number of prompts on each, got "
                     f"{counts.tolist()} (process order)")
  width = int(sharding.allgather_scalar(max(len(x) for x in ids)).max())
  arr = np.full((len(ids), width), -1, np.int64)
  for i, x in enumerate(ids):
    arr[i, :len(x)] = x
  got, _ = sharding.allgather_rows({"ids": arr, **{f"p{k}": v for k, v in enumerate(per_prompt)}})
  all_ids = [[int(t) for t in row if t >= 0] for row in got["ids"]]
  return all_ids, tuple(got[f"p{k}"].astype(v.dtype) for k, v in enumerate(per_prompt))
