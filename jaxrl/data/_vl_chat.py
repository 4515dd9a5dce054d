"""Chat records with images -> token ids, loss masks, and the images' patches in token order (Qwen2-VL).

A message's ``content`` is a string or a list of parts:

  {"type": "text", "text": "..."}
  {"type": "image", "image": <path | bytes | data URL | {"bytes", "path"}>}
  {"type": "image_url", "image_url": {"url": <data URL | local path | file:// URL>}}

Any message may hold several images, and images may come in any turn. A record may also list its images at
the top level, ``"images": [...]``, placed in order by parts ``{"type": "image"}`` without a source (the TRL
layout) or by ``<image>`` markers in string content (the verl / EasyR1 layout). Each image is first rendered
as ``<|vision_start|><|image_pad|><|vision_end|>`` (what the Qwen2-VL / Qwen2.5-VL chat templates write for
an image part, without ``add_vision_id``), the messages are tokenised with the text path
(:func:`jaxrl.data.encode_chat`: same chat template, same loss masks), and then each ``<|image_pad|>``
is repeated ``N = t*h*w / merge**2`` times for its image (what ``Qwen2_5_VLProcessor`` does). Image-pad
tokens are never trained (their embeddings are replaced by the vision tower's output).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.data._chat import encode_chat, encode_prompt
from jaxrl.data._images import ImageConfig, load_image, num_image_tokens, process_image
from jaxrl.data._sources import DataError, record_messages

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""What one image renders to before expansion."""
_RESERVED = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)


@dataclasses.dataclass(frozen=True)
class VisionTokenIds:
  """Token ids of the vision markers in a tokenizer."""

  vision_start: int
  image_pad: int
  vision_end: int

  @classmethod
  def of(cls, tokenizer) -> VisionTokenIds:
    """Looks the markers up; raises :class:`DataError` naming a missing one."""
    ids = []
    for token in (VISION_START, IMAGE_PAD, VISION_END):
      i = tokenizer.convert_tokens_to_ids(token)
      if i is None or i == tokenizer.unk_token_id:
        raise DataError(f"the tokenizer has no {token} token; image records need a vision-language tokenizer "
                        "(Qwen2-VL / Qwen2.5-VL)", reason="no vision tokens")
      ids.append(int(i))
    return cls(*ids)


IMAGE_MARKER = "<image>"
"""In string content of a record with a top-level ``images`` list (the verl / EasyR1 layout), each marker
is the next listed image."""


class _Pool:
  """A record's top-level ``images`` list, handed out in order to image parts without their own image."""

  def __init__(self, images: Any, where: str):
    if images is not None and not isinstance(images, list):
      raise DataError(f"{where}: 'images' must be a list, got {type(images).__name__}", reason="wrong type")
    self.images, self.where, self.used = images, where, 0

  def take(self, key: str) -> tuple[Any, str]:
    if self.images is None:
      raise DataError(f"{key}: an image part needs an 'image' (path, bytes or data URL), or the record an 'images' "
                      "list", reason="missing field")
    if self.used >= len(self.images):
      raise DataError(f"{key}: an image without its own source, and the record's 'images' list "
                      f"({len(self.images)}) is used up", reason="missing image")
    self.used += 1
    return self.images[self.used - 1], f"{key} (images[{self.used - 1}])"

  def check_used(self) -> None:
    if self.images is not None and self.used != len(self.images):
      raise DataError(f"{self.where}: the record lists {len(self.images)} images but its messages place "
                      f"{self.used}", reason="invalid record")


def _image_source(part: dict[str, Any], key: str, pool: _Pool) -> tuple[Any, str]:
  if part["type"] == "image":
    return (part["image"], key) if part.get("image") is not None else pool.take(key)
  url = part.get("image_url")
  url = url.get("url") if isinstance(url, dict) else url
  if not isinstance(url, str) or not url:
    raise DataError(f"{key}: an image_url part needs 'image_url': {{'url': ...}}", reason="missing field")
  return url, key


def _flatten_text(text: str, key: str, pool: _Pool, images: list[tuple[Any, str]]) -> str:
  """String content: with a record ``images`` list, each :data:`IMAGE_MARKER` is the next listed image."""
  if pool.images is None or IMAGE_MARKER not in text:
    _check_text(text, key)
    return text
  pieces = text.split(IMAGE_MARKER)
  for piece in pieces:
    _check_text(piece, key)
  for _ in pieces[1:]:
    images.append(pool.take(key))
  return IMAGE_PLACEHOLDER.join(pieces)


def _flatten_parts(content: list[Any], key: str, pool: _Pool, images: list[tuple[Any, str]]) -> str:
  pieces = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
      if not isinstance(part.get("text"), str):
        raise DataError(f"{key}[{j}]: a text part needs a string 'text'", reason="wrong type")
      pieces.append(_flatten_text(part["text"], f"{key}[{j}]", pool, images))
    elif kind in ("image", "image_url"):
      images.append(_image_source(part, f"{key}[{j}]", pool))
      pieces.append(IMAGE_PLACEHOLDER)
    else:
      raise DataError(f"{key}[{j}]: a content part needs 'type' 'text', 'image' or 'image_url', got {kind!r}",
                      reason="wrong type")
  return "".join(pieces)


def flatten_vl_messages(messages: Any, *, where: str = "record",
                        images: list[Any] | None = None) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
  """Messages with part lists -> messages with string content, and the images in order.

  Images come from the parts themselves (``image`` / ``image_url``) or, for parts ``{"type": "image"}``
  without a source (the TRL layout) and :data:`IMAGE_MARKER` s in text (the verl / EasyR1 layout), from
  ``images``, a record's top-level list, in order; every listed image must be placed.

  Returns:
    ``(messages, images)``: each message's ``content`` a string with :data:`IMAGE_PLACEHOLDER` per image;
    ``images`` the ``(source, where)`` pairs in token order, ``where`` naming the part
    (``file:line: messages[i].content[j]``, plus ``(images[k])`` for a listed image).

  Raises:
    DataError: naming the message and part: a part of unknown type or without its field, text that holds a
      vision marker itself (it would be taken for an image), or listed images that are missing or left over.
  """
  if not isinstance(messages, list):
    raise DataError(f"{where}: 'messages' must be a list", reason="wrong type")
  pool = _Pool(images, where)
  out, found = [], []
  for i, m in enumerate(messages):
    content = m.get("content") if isinstance(m, dict) else None
    key = f"{where}: messages[{i}].content"
    if isinstance(content, list):
      out.append({**m, "content": _flatten_parts(content, key, pool, found)})
    elif isinstance(content, str):
      out.append({**m, "content": _flatten_text(content, key, pool, found)})
    else:
      out.append(m)  # record_messages names what is wrong with it
  pool.check_used()
  return out, found


def _check_text(text: str, where: str) -> None:
  for marker in _RESERVED:
    if marker in text:
      raise DataError(f"{where}: text holds the marker {marker}; give images as image parts",
                      reason="invalid record")


def vl_record_messages(record: Any, *, where: str = "record") -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
  """Validates a record that may hold images (as :func:`jaxrl.data.record_messages` validates a text record,
  on the flattened messages) without loading its images.

  Returns:
    :func:`flatten_vl_messages`' ``(messages, images)``: chat messages with string content, and the
    ``(source, where)`` of each image in token order.

  Raises:
    DataError: a malformed part (naming ``where`` and the part) or record (as ``record_messages``).
  """
  listed = record.get("images") if isinstance(record, dict) else None
  if isinstance(record, dict) and "messages" in record:
    flat, images = flatten_vl_messages(record["messages"], where=where, images=listed)
    return record_messages({"messages": flat}), images
  if isinstance(record, dict) and (isinstance(record.get("prompt"), list)
                                   or (listed is not None and isinstance(record.get("prompt"), str))):
    prompt = record.get("prompt")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    flat, images = flatten_vl_messages(prompt, where=where, images=listed)
    return record_messages({**record, "prompt": flat}), images
  return record_messages(record), []


def load_vl_images(images: list[tuple[Any, str]], config: ImageConfig, *,
                   image_root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Loads and processes ``(source, where)`` images: ``pixel_values [sum t*h*w, patch_dim]`` float32 (in
  order) and ``grid_thw [I, 3]`` int32. Errors name each image's ``where``."""
  pixels, grids = [], []
  for source, where in images:
    image = load_image(source, where=where, root=image_root, max_source_pixels=config.max_source_pixels)
    p, grid = process_image(image, config, where=where)
    pixels.append(p)
    grids.append(grid)
  if not pixels:
    return np.zeros((0, config.patch_dim), np.float32), np.zeros((0, 3), np.int32)
  return np.concatenate(pixels), np.asarray(grids, np.int32)


def expand_image_tokens(arrays: dict[str, np.ndarray], grid_thw: np.ndarray, *, image_pad: int,
                        merge_size: int, where: str = "record") -> dict[str, np.ndarray]:
  """Repeats the k-th ``image_pad`` token of ``arrays["tokens"]`` (and the same entries of every other
  token-aligned array) ``num_image_tokens(grid_thw[k])`` times; ``loss_mask``/``turn_id`` are then cleared on
  image-pad tokens.

  Raises:
    DataError: the number of ``image_pad`` tokens is not the number of images.
  """
  tokens = arrays["tokens"]
  is_pad = tokens == image_pad  # [L]
  if int(is_pad.sum()) != len(grid_thw):
    raise DataError(f"{where}: the chat template wrote {int(is_pad.sum())} image tokens for {len(grid_thw)} "
                    "images (does it drop image parts of some roles?)", reason="invalid record")
  repeats = np.ones(len(tokens), np.int64)
  repeats[is_pad] = [num_image_tokens(g, merge_size) for g in grid_thw]
  out = {k: np.repeat(v, repeats) for k, v in arrays.items()}
  pads = out["tokens"] == image_pad
  if "loss_mask" in out:
    out["loss_mask"] = out["loss_mask"] & ~pads
  if "turn_id" in out:
    out["turn_id"] = np.where(pads, 0, out["turn_id"]).astype(np.int32)
  return out


def encode_vl_record(tokenizer, record: dict[str, Any], *, images: ImageConfig | None = None,
                     image_root: str | Path | None = None, end_of_turn: str | None = None) -> dict[str, np.ndarray]:
  """Tokenises a chat record with images (module docstring) for training.

  Args:
    tokenizer: a Qwen2-VL-style tokenizer (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``).
    record: ``{"messages": [...]}`` or ``{"prompt": str | messages, "completion": str}``; ``_where``
      (``file:line``) and ``_index`` as from a source.
    images: image processing settings (default :class:`ImageConfig` ()).
    image_root: directory relative image paths are read from (default: the current directory).
    end_of_turn: as for :func:`jaxrl.data.encode_chat`.

  Returns:
    ``tokens``, ``loss_mask``, ``turn_id``, ``sample_id`` [L] (as :func:`jaxrl.data.encode_record`), and
    ``pixel_values`` [P, patch_dim] float32 and ``grid_thw`` [I, 3] int32 of the record's images in token order.

  Raises:
    DataError: starting with the record's ``file:line`` (and the message/part for an image problem).
  """
  cfg = ImageConfig() if images is None else images
  where = record.get("_where", "record") if isinstance(record, dict) else "record"
  pad = VisionTokenIds.of(tokenizer).image_pad
  try:
    messages, sources = vl_record_messages(record, where=where)
    text = encode_chat(tokenizer, messages, end_of_turn=end_of_turn)
  except DataError as e:
    message = str(e) if str(e).startswith(where) else f"{where}: {e}"
    raise DataError(message, reason=e.reason) from None
  pixels, grids = load_vl_images(sources, cfg, image_root=image_root)
  out = expand_image_tokens(text, grids, image_pad=pad, merge_size=cfg.merge_size, where=where)
  out["sample_id"] = np.full(out["tokens"].shape, int(record.get("_index", 0)), np.int32)
  out["pixel_values"] = pixels
  out["grid_thw"] = grids
  return out


def encode_vl_prompt(tokenizer, record: dict[str, Any], *, images: ImageConfig | None = None,
                     image_root: str | Path | None = None) -> dict[str, np.ndarray]:
  """Prompt tokens for sampling, with the prompt's images: :func:`jaxrl.data.encode_prompt` of the
  flattened messages plus the generation header, image tokens expanded. A record whose last assistant turn
  has no user turn after it (a training record) is cut before that turn; a record that ends with user turns
  is the prompt whole.

  Returns:
    ``tokens`` [L] int32, ``pixel_values`` [P, patch_dim] float32, ``grid_thw`` [I, 3] int32.
  """
  cfg = ImageConfig() if images is None else images
  where = record.get("_where", "record")
  pad = VisionTokenIds.of(tokenizer).image_pad
  messages = record.get("messages", record.get("prompt"))
  if isinstance(messages, str):
    messages = [{"role": "user", "content": messages}]
  flat, sources = flatten_vl_messages(messages, where=where, images=record.get("images"))
  assistant = [i for i, m in enumerate(flat) if m.get("role") == "assistant"]
  if assistant and not any(m.get("role") == "user" for m in flat[assistant[-1]:]):
    flat = flat[:assistant[-1]]  # the record's answer and what follows it are not prompt
    sources = sources[:sum(str(m.get("content") or "").count(IMAGE_PAD) for m in flat)]
  pixels, grids = load_vl_images(sources, cfg, image_root=image_root)
  tokens = encode_prompt(tokenizer, {"prompt": flat})
  out = expand_image_tokens({"tokens": tokens}, grids, image_pad=pad, merge_size=cfg.merge_size, where=where)
  return {"tokens": out["tokens"], "pixel_values": pixels, "grid_thw": grids}
