"""Images for vision-language models: loading (paths, bytes, data URLs) and Qwen2-VL preprocessing.

:func:`process_image` turns one still image into the vision tower's input exactly as transformers'
``Qwen2VLImageProcessorPil`` does (Qwen2-VL and Qwen2.5-VL share it):

  1. RGB: images with an alpha band or a ``transparency`` entry are composited onto white;
  2. resize (PIL bicubic) to ``smart_resize(h, w)``: both sides multiples of ``patch * merge`` (28),
     the area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as possible;
  3. ``x / 255`` (in float64, then float32), then ``(x - mean) / std`` with the CLIP mean/std (float32);
  4. the still frame repeated ``temporal_patch_size`` times, then flattened to patches in
     ``(gh/m, gw/m, m, m, C, T, P, P)`` order: ``pixel_values [gh*gw, C*T*P*P]`` and ``grid_thw = (1, gh, gw)``.

Each image becomes ``gh*gw / merge**2`` image tokens (:func:`num_image_tokens`). Errors are
:class:`jaxrl.data.DataError` s whose message starts with the caller's ``where`` (``file:line`` and the
record key) and whose ``reason`` (``missing image``, ``unreadable image``, ``oversized image``, ``extreme
aspect ratio``) feeds the skip report.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from jaxrl.data._sources import DataError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""OpenAI CLIP per-channel mean (RGB), the Qwen2-VL processor's ``image_mean``."""
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP per-channel standard deviation (RGB), the Qwen2-VL processor's ``image_std``."""
MAX_ASPECT_RATIO = 200
"""Longest over shortest side beyond which transformers' ``smart_resize`` refuses an image."""
MAX_SOURCE_PIXELS = 89_478_485
"""Default bound on a source image's width * height before decoding (PIL's decompression-bomb limit)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageConfig:
  """How images become vision-tower patches (the fields of a Qwen2-VL ``preprocessor_config.json``)."""

  min_pixels: int = 56 * 56
  "Smallest resized area (pixels); smaller images are upscaled."
  max_pixels: int = 28 * 28 * 1280
  "Largest resized area (pixels); larger images are downscaled. Bounds the patches per image."
  patch_size: int = 14
  "Side of a vision patch (pixels)."
  temporal_patch_size: int = 2
  "Frames per patch; a still image is repeated this many times."
  merge_size: int = 2
  "Patches merged per side into one language-model token."
  image_mean: tuple[float, float, float] = CLIP_MEAN
  "Per-channel mean subtracted after scaling to [0, 1]."
  image_std: tuple[float, float, float] = CLIP_STD
  "Per-channel standard deviation divided by."
  max_source_pixels: int = MAX_SOURCE_PIXELS
  "Source images with more pixels than this are refused before decoding (``oversized image``)."

  def __post_init__(self):
    for key in ("patch_size", "temporal_patch_size", "merge_size", "max_source_pixels"):
      if getattr(self, key) < 1:
        raise ValueError(f"{key} must be >= 1, got {getattr(self, key)!r}")
    if not 0 < self.min_pixels <= self.max_pixels:
      raise ValueError(f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels!r}, "
                       f"max_pixels={self.max_pixels!r}")
    factor = self.patch_size * self.merge_size
    if self.max_pixels < factor * factor:
      raise ValueError(f"max_pixels must be >= (patch_size * merge_size)**2 = {factor * factor}, "
                       f"got {self.max_pixels!r}")
    for key in ("image_mean", "image_std"):
      if len(getattr(self, key)) != 3:
        raise ValueError(f"{key} must have 3 values (RGB), got {getattr(self, key)!r}")

  @property
  def factor(self) -> int:
    """Resized sides are multiples of this (``patch_size * merge_size``)."""
    return self.patch_size * self.merge_size

  @property
  def patch_dim(self) -> int:
    """Values per patch, ``3 * temporal_patch_size * patch_size**2`` (the tower's input width)."""
    return 3 * self.temporal_patch_size * self.patch_size ** 2

  @classmethod
  def from_hf(cls, hf_dir: str | Path, **overrides) -> ImageConfig:
    """Reads ``preprocessor_config.json`` of a Qwen2-VL / Qwen2.5-VL checkpoint directory (defaults for a
    missing file or key); ``overrides`` replace fields (e.g. a recipe's ``max_pixels``)."""
    path = Path(hf_dir) / "preprocessor_config.json"
    hf: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    size = hf.get("size") or {}
    fields: dict[str, Any] = {}
    min_pixels = hf.get("min_pixels", size.get("shortest_edge"))
    max_pixels = hf.get("max_pixels", size.get("longest_edge"))
    if min_pixels is not None:
      fields["min_pixels"] = int(min_pixels)
    if max_pixels is not None:
      fields["max_pixels"] = int(max_pixels)
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
      if key in hf:
        fields[key] = int(hf[key])
    for key in ("image_mean", "image_std"):
      if key in hf:
        fields[key] = tuple(float(x) for x in hf[key])
    return cls(**{**fields, **overrides})


def smart_resize(height: int, width: int, *, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280, where: str = "image") -> tuple[int, int]:
  """The resized ``(height, width)``: multiples of ``factor``, area in ``[min_pixels, max_pixels]``.

  Rounds each side to the nearest multiple of ``factor`` (Python's round, half to even); if the area is
  then above ``max_pixels``, scales both sides by ``beta = sqrt(h*w / max_pixels)`` and floors to
  multiples (at least ``factor``); if below ``min_pixels``, scales by ``sqrt(min_pixels / (h*w))`` and
  ceils. Source: transformers ``qwen2_vl`` ``smart_resize`` (the Qwen2-VL processor's resize rule).

  Raises:
    DataError: ``where``: the aspect ratio is above :data:`MAX_ASPECT_RATIO` (transformers refuses it).
  """
  if height < 1 or width < 1:
    raise DataError(f"{where}: image has an empty side ({width}x{height} pixels)", reason="unreadable image")
  if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
    raise DataError(f"{where}: image aspect ratio {max(height, width) / min(height, width):.1f} "
                    f"({width}x{height} pixels) is above {MAX_ASPECT_RATIO}, which the Qwen2-VL processor "
                    "refuses; crop or pad the image", reason="extreme aspect ratio")
  h = round(height / factor) * factor
  w = round(width / factor) * factor
  if h * w > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h = max(factor, math.floor(height / beta / factor) * factor)
    w = max(factor, math.floor(width / beta / factor) * factor)
  elif h * w < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h = math.ceil(height * beta / factor) * factor
    w = math.ceil(width * beta / factor) * factor
  return h, w


def num_image_tokens(grid_thw, merge_size: int = 2) -> int:
  """Language-model tokens for one image: ``t * h * w // merge_size**2`` (``grid_thw = (t, h, w)`` in patches)."""
  t, h, w = (int(x) for x in grid_thw)
  return t * h * w // merge_size ** 2


def _to_rgb(image: Image.Image) -> Image.Image:
  """RGB, with any transparency composited onto white (as transformers' ``convert_to_rgb``)."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  return image.convert("RGB")


def _normalise_table(cfg: ImageConfig) -> np.ndarray:  # [C, 256] float32
  """The normalised value of each uint8 level per channel: ``x / 255`` in float64 rounded to float32, then
  ``(x - mean) / std`` in float32 (the processor's dtypes), so a lookup gives its values bit for bit."""
  scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
  mean = np.asarray(cfg.image_mean, np.float32)[:, None]
  std = np.asarray(cfg.image_std, np.float32)[:, None]
  return (scaled[None, :] - mean) / std


def process_image(image: Image.Image, config: ImageConfig | None = None, *,
                  where: str = "image") -> tuple[np.ndarray, tuple[int, int, int]]:
  """One still image -> ``(pixel_values [gh*gw, 3*T*P*P] float32, grid_thw (1, gh, gw))``.

  Equal to transformers' ``Qwen2VLImageProcessorPil`` (see the module docstring for the steps).

  Args:
    image: a PIL image of any mode (grayscale, palette, RGBA, ...).
    config: sizes and normalisation; default :class:`ImageConfig` ().
    where: prefix of error messages (``file:line: key``).

  Raises:
    DataError: the aspect ratio is above :data:`MAX_ASPECT_RATIO`.
  """
  cfg = ImageConfig() if config is None else config
  width, height = image.size
  rh, rw = smart_resize(height, width, factor=cfg.factor, min_pixels=cfg.min_pixels,
                        max_pixels=cfg.max_pixels, where=where)
  rgb = _to_rgb(image).resize((rw, rh), resample=Image.Resampling.BICUBIC)
  levels, table = np.asarray(rgb, np.uint8), _normalise_table(cfg)  # [H, W, C] uint8, [C, 256]
  x = np.stack([table[c][levels[..., c]] for c in range(3)], axis=-1)  # [H, W, C] float32
  p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
  gh, gw = rh // p, rw // p
  x = x.reshape(gh // m, m, p, gw // m, m, p, 3)  # [gh/m, m, P, gw/m, m, P, C]
  x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [gh/m, gw/m, m, m, C, P, P]
  x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # [..., C, T, P, P]
  return np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p), (1, gh, gw)


def _decode_data_url(url: str, where: str) -> bytes:
  head, sep, payload = url.partition(",")
  if not sep or ";base64" not in head:
    raise DataError(f"{where}: a data URL must look like 'data:image/png;base64,...', got {url[:40]!r}",
                    reason="unreadable image")
  try:
    return base64.b64decode(payload, validate=True)
  except (binascii.Error, ValueError) as e:
    raise DataError(f"{where}: the data URL's base64 payload does not decode ({e})",
                    reason="unreadable image") from None


def _open_source(source: Any, where: str, root: str | Path | None) -> tuple[Any, str]:
  """``(file object or path, description)`` for ``source``."""
  if isinstance(source, dict):  # a Hugging Face datasets Image value: {"bytes": ..., "path": ...}
    if source.get("bytes") is not None:
      return _open_source(source["bytes"], where, root)
    if source.get("path"):
      return _open_source(source["path"], where, root)
    raise DataError(f"{where}: image object needs 'bytes' or 'path', has keys {sorted(source)}",
                    reason="missing image")
  if isinstance(source, (bytes, bytearray, memoryview)):
    return io.BytesIO(bytes(source)), f"{len(source)} bytes"
  if not isinstance(source, (str, Path)):
    raise DataError(f"{where}: an image must be a path, bytes or a data URL, got {type(source).__name__}",
                    reason="unreadable image")
  text = str(source)
  if text.startswith("data:"):
    return io.BytesIO(_decode_data_url(text, where)), "data URL"
  if text.startswith(("http://", "https://")):
    raise DataError(f"{where}: image URLs are not fetched (no network at run time); download {text!r} and "
                    "give its local path", reason="missing image")
  path = Path(text[len("file://"):] if text.startswith("file://") else text)
  if root is not None and not path.is_absolute():
    path = Path(root) / path
  if not path.is_file():
    raise DataError(f"{where}: image file not found: {path}", reason="missing image")
  return path, str(path)


def load_image(source: Any, *, where: str, root: str | Path | None = None,
               max_source_pixels: int = MAX_SOURCE_PIXELS) -> Image.Image:
  """Loads an image into memory, upright (EXIF orientation applied), in its own mode.

  Args:
    source: a PIL image (returned as is), a local path (``str``/``Path``/``file://``), raw bytes, a
      ``data:image/...;base64,...`` URL, or a ``{"bytes", "path"}`` dict (a Hugging Face datasets image).
    where: prefix of error messages: the record's ``file:line`` and key.
    root: directory that relative paths are read from (default: the current directory).
    max_source_pixels: images with more pixels are refused from their header, before decoding.

  Raises:
    DataError: naming ``where`` and the file: missing (``missing image``), not decodable (``unreadable
      image``), or too large (``oversized image``). ``http(s)`` URLs are refused (no network at run time).
  """
  if isinstance(source, Image.Image):
    return source
  handle, what = _open_source(source, where, root)
  try:
    with Image.open(handle) as im:
      if im.width * im.height > max_source_pixels:
        raise DataError(f"{where}: image {what} has {im.width}x{im.height} = {im.width * im.height} pixels, "
                        f"more than max_source_pixels={max_source_pixels}", reason="oversized image")
      im.load()
      return ImageOps.exif_transpose(im)
  except DataError:
    raise
  except Image.DecompressionBombError as e:
    raise DataError(f"{where}: image {what} is too large to decode ({e})", reason="oversized image") from None
  except (OSError, SyntaxError, ValueError) as e:
    raise DataError(f"{where}: cannot read image {what}: {e}", reason="unreadable image") from None
