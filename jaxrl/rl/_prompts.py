"""Prompt records for RL: JSONL files or the built-in arithmetic task, and a resumable shuffled stream.

Records may hold images (a vision-language model): image parts in the messages or a top-level ``images``
list, as :func:`jaxrl.data.encode_vl_prompt` reads them (paths relative to the record's file). Their prompt
tokens count the image placeholders; the pixels are loaded again when a prompt is drawn
(:meth:`EncodedPrompts.images`), so a large image set is never held in memory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl import data as data_lib
from jaxrl.rl._config import BuiltinPrompts, PromptData

PROMPT_KEYS = ("messages", "prompt", "completion", "images")
"""Record keys that make the prompt; every other key (not starting with ``_``) goes to the reward."""


def read_records(paths: Sequence[str | Path], *, check_prompt: bool = True) -> list[dict[str, Any]]:
  """Reads JSONL records (one object per line); a bad line (not UTF-8, not JSON, not an object, or,
  with ``check_prompt``, no usable prompt) raises a one-line error naming ``file:line``."""
  records = []
  for p in paths:
    if not Path(p).is_file():
      raise data_lib.DataError(f"data file not found: {p}")
    with open(p, "rb") as f:
      for i, raw in enumerate(f, start=1):
        if not raw.strip():
          continue
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise data_lib.DataError(f"{p}:{i}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                   f"{e.start + 1})", reason="not UTF-8") from None
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise data_lib.DataError(f"{p}:{i}: invalid JSON: {e}", reason="malformed JSON") from None
        if not isinstance(rec, dict):
          raise data_lib.DataError(f"{p}:{i}: expected a JSON object, got {type(rec).__name__}",
                                   reason="not a JSON object")
        if check_prompt:
          try:
            _check_prompt(rec)
          except data_lib.DataError as e:
            raise data_lib.DataError(f"{p}:{i}: {e}", reason=e.reason) from None
        rec.setdefault("_where", f"{p}:{i}")
        records.append(rec)
  return records


def _has_images(rec: dict[str, Any]) -> bool:
  """The record lists images or has list (multimodal) message content."""
  messages = rec.get("messages", rec.get("prompt"))
  parts = isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                             for m in messages)
  return "images" in rec or parts


def _check_prompt(rec: dict[str, Any]) -> None:
  """A prompt record has ``prompt`` (a non-empty string or messages) or ``messages``, with text; a record
  with images is checked with its image parts flattened (:func:`jaxrl.data.flatten_vl_messages`, without
  loading them)."""
  if _has_images(rec):  # the same checks on the messages with image parts flattened to placeholders
    key = "messages" if "messages" in rec else "prompt"
    messages = rec.get(key)
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    flat, _ = data_lib.flatten_vl_messages(messages, where=key, images=rec.get("images"))
    rec = {key: flat}
  if "messages" in rec:
    messages, key = rec["messages"], "messages"
  elif "prompt" in rec:
    messages, key = rec["prompt"], "prompt"
    if isinstance(messages, str):
      if not messages.strip():
        raise data_lib.DataError("'prompt' is empty", reason="empty prompt")
      return
  else:
    raise data_lib.DataError(f"record needs 'prompt' or 'messages'; has keys {sorted(rec)}",
                             reason="missing field")
  if not isinstance(messages, list) or not messages:
    raise data_lib.DataError(f"'{key}' must be a non-empty list of messages (or a string prompt)",
                             reason="wrong type")
  for j, m in enumerate(messages):
    data_lib._sources._check_message(m, f"{key}[{j}]")  # pylint: disable=protected-access
  if key == "messages":
    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    messages = messages[:assistant[-1]] if assistant else messages
  if not any(m["content"].strip() for m in messages):
    raise data_lib.DataError(f"'{key}' has no non-empty prompt message", reason="empty prompt")


def builtin_records(cfg: BuiltinPrompts, split: str) -> list[dict[str, Any]]:
  """Built-in arithmetic prompts (``messages`` with the worked answer, and ``answer``)."""
  return cfg.records(split)


def reward_fields(record: dict[str, Any]) -> dict[str, Any]:
  """The record's columns for the reward function (``answer``, ``tests``, ...)."""
  return {k: v for k, v in record.items() if k not in PROMPT_KEYS and not k.startswith("_")}


def rm_prompt(record: dict[str, Any]) -> str | list[dict[str, Any]]:
  """The record's prompt as a reward model reads it (:class:`jaxrl.pref.RewardModel`): ``prompt``, or the
  ``messages`` before the last assistant turn (what :func:`jaxrl.data.encode_prompt` samples from)."""
  if "messages" not in record:
    return record["prompt"]
  messages = data_lib.record_messages(record)
  assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  return messages[:assistant[-1]] if assistant else messages


class EncodedPrompts:
  """Records with their prompt token ids and rendered prompt text; over-long prompts are skipped (one
  with images is never truncated: its image tokens and pixels would disagree). ``zero_pixels``: every
  image's pixel values come back zeroed from :meth:`images` (the image-ablated control)."""

  def __init__(self, records: list[dict[str, Any]], tokenizer, *, max_tokens: int,
               images: data_lib.ImageConfig | None = None, zero_pixels: bool = False):
    self.records, self.ids, self.texts = [], [], []
    self.skipped = 0
    self.max_tokens = max_tokens
    self.skipped_where: list[str] = []  # file:line (or "record N") of the skipped prompts
    self.tokenizer, self.image_config = tokenizer, images or data_lib.ImageConfig()
    self.zero_pixels = zero_pixels
    self.with_images: list[bool] = []
    for n, rec in enumerate(records):
      vl = _has_images(rec)
      ids = self._encode(rec)["tokens"] if vl else data_lib.encode_prompt(tokenizer, rec)
      if len(ids) > max_tokens:
        self.skipped += 1
        self.skipped_where.append(str(rec.get("_where", f"record {n}")))
        continue
      self.records.append(rec)
      self.with_images.append(vl)
      self.ids.append(ids.astype(np.int32))
      self.texts.append(tokenizer.decode(ids.tolist(), skip_special_tokens=False))
    if not self.records:
      raise data_lib.DataError(f"no prompt fits data.max_prompt_tokens={max_tokens} "
                               f"({self.skipped} skipped)")

  def __len__(self) -> int:
    return len(self.records)

  @property
  def has_images(self) -> bool:
    return any(self.with_images)

  def _encode(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
    where = str(rec.get("_where", ""))
    root = Path(where.rsplit(":", 1)[0]).parent if ":" in where else None
    return data_lib.encode_vl_prompt(self.tokenizer, rec, images=self.image_config, image_root=root)

  def images(self, i: int) -> dict[str, np.ndarray] | None:
    """Prompt ``i``'s images for the sampler (``pixel_values``, ``grid_thw``, loaded now), or None."""
    if not self.with_images[i]:
      return None
    enc = self._encode(self.records[i])
    if not np.array_equal(enc["tokens"], self.ids[i]):
      raise data_lib.DataError(f"{self.records[i].get('_where', f'record {i}')}: its images changed since the "
                               "prompts were loaded (their token count differs)")
    return dict(enc, pixel_values=np.zeros_like(enc["pixel_values"])) if self.zero_pixels else enc

  def skip_report(self, report: data_lib.SkipReport | None = None) -> data_lib.SkipReport:
    """Adds the over-long prompts to ``report`` (a new one by default) and returns it."""
    report = data_lib.SkipReport() if report is None else report
    reason = f"prompt longer than data.max_prompt_tokens={self.max_tokens}"
    for where in self.skipped_where:
      report.add(reason, where)
    return report


class PromptStream:
  """Seeded per-epoch shuffle over ``count`` prompts; the state is ``{epoch, index, drawn}``.

  ``drawn`` counts prompts handed out so far; it is the request id of the next prompt, so the
  sampler's draws for a prompt depend on when it was drawn, not on the batch it landed in.
  """

  def __init__(self, count: int, *, seed: int):
    if count < 1:
      raise ValueError(f"PromptStream needs at least one prompt, got {count}")
    self.count, self.seed = count, seed
    self.epoch, self.index, self.drawn = 0, 0, 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.count)

  def take(self, k: int) -> tuple[list[int], list[int]]:
    """The next ``k`` prompt indices and their request ids."""
    out, ids = [], []
    for _ in range(k):
      if self.index == self.count:
        self.epoch, self.index = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
      out.append(int(self._order[self.index]))
      ids.append(self.drawn)
      self.index += 1
      self.drawn += 1
    return out, ids

  def get_state(self) -> dict[str, int]:
    return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn}

  def set_state(self, state: dict[str, int]) -> None:
    self.epoch, self.index, self.drawn = int(state["epoch"]), int(state["index"]), int(state["drawn"])
    self._order = self._permutation(self.epoch)


def load_prompt_sets(cfg: PromptData, tokenizer) -> tuple[EncodedPrompts, EncodedPrompts | None]:
  """Train and held-out prompt sets from the ``data:`` section."""
  if cfg.train:
    train = read_records(cfg.train)
    heldout = read_records(cfg.heldout) if cfg.heldout else []
  elif cfg.image_task is not None or cfg.caption_task is not None:
    task = cfg.image_task or cfg.caption_task
    train = task.records("train")
    heldout = read_records(cfg.heldout) if cfg.heldout else task.records("heldout")
  else:
    train = builtin_records(cfg.builtin, "train")
    heldout = read_records(cfg.heldout) if cfg.heldout else builtin_records(cfg.builtin, "heldout")
  kw = dict(max_tokens=cfg.max_prompt_tokens, images=cfg.images, zero_pixels=cfg.zero_pixels)
  enc_train = EncodedPrompts(train, tokenizer, **kw)
  enc_heldout = EncodedPrompts(heldout, tokenizer, **kw) if heldout else None
  return enc_train, enc_heldout
