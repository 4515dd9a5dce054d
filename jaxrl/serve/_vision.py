"""Chat messages with OpenAI ``image_url`` content parts -> a VLM prompt (tokens, pixels, grids).

``{"type": "image_url", "image_url": {"url": ...}}`` parts take a ``data:`` URL (base64) or a local file
(a path or ``file://`` URL, read by the server); remote ``http(s)`` URLs are refused with a 400 (the server
fetches nothing). The messages then go through :func:`jaxrl.data.encode_vl_prompt` (the chat template, image
placeholders expanded per image), so a served prompt is exactly a training/RL prompt.
"""

from __future__ import annotations

from typing import Any

from jaxrl import data as data_lib

IMAGE_PART = "image_url"


class ImageRequestError(ValueError):
  """A 400 about an image part, naming the request field (``param``)."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
  """Any message content part of type ``image_url``."""
  return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == IMAGE_PART
                                                        for p in m["content"]) for m in messages)


def _check_url(part: dict[str, Any], param: str) -> None:
  spec = part.get(IMAGE_PART)
  url = spec.get("url") if isinstance(spec, dict) else spec
  if not isinstance(url, str) or not url:
    raise ImageRequestError(param, "an image_url part needs image_url.url (a data: URL or a local file)")
  if url.split(":", 1)[0].lower() in ("http", "https"):
    raise ImageRequestError(param, "remote image URLs are not fetched (the server reads no network): send the image "
                            "as a data: URL (base64) or a local file path")


def encode_image_chat(tokenizer, messages: list[dict[str, Any]], *, images: data_lib.ImageConfig,
                      vision) -> dict[str, Any]:
  """``encode_vl_prompt``'s ``{tokens, pixel_values, grid_thw}`` of chat ``messages`` (roles already
  mapped) holding ``image_url`` parts; ``vision`` is the model's tower config (None: refused, a text model).

  Raises:
    ImageRequestError: a remote or missing URL, an unreadable image, a model without a tower.
  """
  for i, m in enumerate(messages):
    for j, part in enumerate(m.get("content") if isinstance(m.get("content"), list) else []):
      if isinstance(part, dict) and part.get("type") == IMAGE_PART:
        _check_url(part, f"messages.[{i}].content.[{j}].image_url")
  if vision is None:
    raise ImageRequestError("messages", "this model takes no images (it has no vision tower); send text content")
  try:
    return data_lib.encode_vl_prompt(tokenizer, {"messages": messages, "_where": "messages"}, images=images)
  except data_lib.DataError as e:
    raise ImageRequestError("messages", str(e)) from None
