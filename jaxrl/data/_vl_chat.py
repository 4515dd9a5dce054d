"""Chat records with images -> token ids, loss masks, and the images' patches in token order (Qwen2-VL).

A message's ``content`` is a string or a list of parts:

  {"type": "text", "text": "..."}
  {"type": "image", "image": <path | bytes | data URL | {"bytes", "path"}>}
  {"type": "image_url", "image_url": {"url": <data URL | local path | file:// URL>}}

Any message may hold several images, and images may come in any turn. Each image part is first rendered
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
"""What one image part renders to before expansion."""
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


def _image_source(part: dict[str, Any], where: str) -> Any:
  if part["type"] == "image":
    if part.get("image") is None:
      raise DataError(f"{where}: an image part needs an 'image' (path, bytes or data URL)", reason="missing field")
    return part["image"]
  url = part.get("image_url")
  url = url.get("url") if isinstance(url, dict) else url
  if not isinstance(url, str) or not url:
    raise DataError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}", reason="missing field")
  return url


def flatten_vl_messages(messages: Any, *, where: str = "record") -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
  """Messages with part lists -> messages with string content, and the images in order.

  Returns:
    ``(messages, images)``: each message's ``content`` a string with :data:`IMAGE_PLACEHOLDER` per image
    part; ``images`` the ``(source, where)`` pairs in token order, ``where`` naming the part
    (``file:line: messages[i].content[j]``).

  Raises:
    DataError: naming the message and part: a part of unknown type or without its field, or text that holds
      a vision marker itself (it would be taken for an image).
  """
  if not isinstance(messages, list):
    raise DataError(f"{where}: 'messages' must be a list", reason="wrong type")
  out, images = [], []
  for i, m in enumerate(messages):
    content = m.get("content") if isinstance(m, dict) else None
    if not isinstance(content, list):
      text = content if isinstance(content, str) else ""
      _check_text(text, f"{where}: messages[{i}].content")
      out.append(m)
      continue
    pieces = []
    for j, part in enumerate(content):
      key = f"{where}: messages[{i}].content[{j}]"
      kind = part.get("type") if isinstance(part, dict) else None
      if kind == "text":
        if not isinstance(part.get("text"), str):
          raise DataError(f"{key}: a text part needs a string 'text'", reason="wrong type")
        _check_text(part["text"], key)
        pieces.append(part["text"])
      elif kind in ("image", "image_url"):
        images.append((_image_source(part, key), key))
        pieces.append(IMAGE_PLACEHOLDER)
      else:
        raise DataError(f"{key}: a content part needs 'type' 'text', 'image' or 'image_url', got {kind!r}",
                        reason="wrong type")
    out.append({**m, "content": "".join(pieces)})
  return out, images


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
  if isinstance(record, dict) and "messages" in record:
    flat, images = flatten_vl_messages(record["messages"], where=where)
    return record_messages({"messages": flat}), images
  if isinstance(record, dict) and isinstance(record.get("prompt"), list):
    flat, images = flatten_vl_messages(record["prompt"], where=where)
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
  flat, sources = flatten_vl_messages(messages, where=where)
  assistant = [i for i, m in enumerate(flat) if m.get("role") == "assistant"]
  if assistant and not any(m.get("role") == "user" for m in flat[assistant[-1]:]):
    flat = flat[:assistant[-1]]  # the record's answer and what follows it are not prompt
    sources = sources[:sum(m["content"].count(IMAGE_PAD) for m in flat)]
  pixels, grids = load_vl_images(sources, cfg, image_root=image_root)
  tokens = encode_prompt(tokenizer, {"prompt": flat})
  out = expand_image_tokens({"tokens": tokens}, grids, image_pad=pad, merge_size=cfg.merge_size, where=where)
  return {"tokens": out["tokens"], "pixel_values": pixels, "grid_thw": grids}
