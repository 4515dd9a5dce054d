"""Prompts with images for the sampler and the engine (Qwen2-VL / Qwen2.5-VL): checks, M-RoPE positions,
per-row vision inputs.

A prompt's images come as :func:`jaxrl.data.encode_vl_prompt` returns them: ``pixel_values [P, patch_dim]``
(its images' patches in token order) and ``grid_thw [I, 3]``; its tokens hold ``t·h·w / m²`` image
placeholders per image. On the host each prompt gets its 3-D rotary positions and decode delta
(:func:`jaxrl.models.mrope_positions`); a VLM's text-only prompts get ``arange`` on all three axes and
delta 0, which is exactly 1-D RoPE. The device programs take a batch's images per prompt row
(:class:`jaxrl.models.VisionInputs`, ``[U, P_bucket, patch_dim]``) and run the tower once over those
``U`` rows, before prompt rows are copied to sample rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl import models
from jaxrl.sampling._requests import next_pow2


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImages:
  """One prompt's images: patches in token order and their grids (``encode_vl_prompt``'s arrays)."""

  pixel_values: np.ndarray  # [P, patch_dim] float32
  grid_thw: np.ndarray  # [I, 3] int32

  @property
  def num_patches(self) -> int:
    return int(self.pixel_values.shape[0])


def prompt_images(value, *, where: str) -> PromptImages | None:
  """``value`` (None, a :class:`PromptImages`, or a mapping with ``pixel_values`` and ``grid_thw``) checked,
  as :class:`PromptImages` (None when it holds no image)."""
  if value is None or isinstance(value, PromptImages) and not len(value.grid_thw):
    return None
  if isinstance(value, Mapping):
    missing = [k for k in ("pixel_values", "grid_thw") if k not in value]
    if missing:
      raise ValueError(f"{where}: images need {missing} (as jaxrl.data.encode_vl_prompt returns them)")
    value = PromptImages(np.asarray(value["pixel_values"], np.float32),
                         np.asarray(value["grid_thw"], np.int64).reshape(-1, 3).astype(np.int32))
  if not isinstance(value, PromptImages):
    raise ValueError(f"{where}: expected images as a dict with pixel_values and grid_thw, got {type(value).__name__}")
  if not len(value.grid_thw):
    return None
  pix, grid = value.pixel_values, value.grid_thw
  if pix.ndim != 2 or pix.shape[0] != int(np.prod(grid, axis=1).sum()):
    raise ValueError(f"{where}: pixel_values {pix.shape} must be [sum(t*h*w), patch_dim] = "
                     f"[{int(np.prod(grid, axis=1).sum())}, ...] for grid_thw {grid.tolist()}")
  return value


def split_prompts(prompts, images) -> tuple[object, list | None]:
  """Prompts given as ``encode_vl_prompt`` dicts (``tokens``, ``pixel_values``, ``grid_thw``) split into
  token lists and ``images``; other prompts and ``images`` pass through."""
  if isinstance(prompts, Mapping):
    prompts = [prompts]
  if not isinstance(prompts, (list, tuple)) or not any(isinstance(p, Mapping) for p in prompts):
    return prompts, None if images is None else list(images)
  if images is not None:
    raise ValueError("images: give images either inside the prompt dicts or as images=..., not both")
  ids, imgs = [], []
  for i, p in enumerate(prompts):
    if isinstance(p, Mapping):
      if "tokens" not in p:
        raise ValueError(f"prompts[{i}]: a prompt dict needs 'tokens' (as jaxrl.data.encode_vl_prompt returns)")
      ids.append([int(t) for t in np.asarray(p["tokens"]).reshape(-1)])
      imgs.append(p if "grid_thw" in p else None)
    else:
      ids.append(p)
      imgs.append(None)
  return ids, imgs


def is_vlm(cfg) -> bool:
  """Whether the model rotates by 3-D (M-RoPE) positions and so takes per-row rope deltas."""
  return getattr(cfg, "mrope_section", None) is not None


def check_images(cfg, ids: Sequence[Sequence[int]], images: Sequence | None) -> list[PromptImages | None]:
  """One checked :class:`PromptImages` (or None) per prompt; refuses images for a model without a tower,
  a count that is not one per prompt, and patches of the wrong width."""
  if images is None:
    return [None] * len(ids)
  images = list(images)
  if len(images) != len(ids):
    raise ValueError(f"images: expected one entry (or None) per prompt ({len(ids)}), got {len(images)}")
  out = [prompt_images(x, where=f"images[{i}]") for i, x in enumerate(images)]
  if any(x is not None for x in out):
    vision = getattr(cfg, "vision", None)
    if vision is None:
      raise ValueError(f"images: model_type {cfg.model_type!r} has no vision tower")
    for i, x in enumerate(out):
      if x is not None and x.pixel_values.shape[1] != vision.patch_dim:
        raise ValueError(f"images[{i}]: patches are {x.pixel_values.shape[1]} wide, the tower takes "
                         f"patch_dim={vision.patch_dim}")
  return out


def prompt_rope(cfg, ids: Sequence[int], images: PromptImages | None, *, where: str) -> tuple[np.ndarray, int]:
  """``(rope positions [L, 3] int32, rope delta)`` of one prompt (:func:`jaxrl.models.mrope_positions`);
  a prompt whose image placeholders disagree with its images is refused naming ``where``."""
  tokens = np.asarray(ids, np.int64)[None]
  grid = np.zeros((0, 3), np.int64) if images is None else images.grid_thw
  try:
    rope, deltas = models.mrope_positions(tokens, np.ones_like(tokens), grid, cfg)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  return rope[0], int(deltas[0, 0])


def patch_bucket(patches: int, merge: int) -> int:
  """Per-row patch bucket: the power of two ``>= patches`` (at least ``4·m²``), a multiple of ``m²``."""
  m2 = merge * merge
  b = next_pow2(max(int(patches), 4 * m2))
  return -(-b // m2) * m2


def vision_rows(cfg, images: Sequence[PromptImages | None], rows: int) -> models.VisionInputs:
  """Host :class:`jaxrl.models.VisionInputs` of ``rows`` prompt rows (``images[k]`` on row ``k``, the rest
  without images), patches zero-padded to one :func:`patch_bucket`."""
  vision = cfg.vision
  most = max([0] + [x.num_patches for x in images if x is not None])
  bucket = patch_bucket(most, vision.spatial_merge_size)
  pix = np.zeros((rows, bucket, vision.patch_dim), np.float32)
  grids, owner = [], []
  for k, x in enumerate(images):
    if x is not None:
      pix[k, :x.num_patches] = x.pixel_values
      grids.append(x.grid_thw)
      owner += [k] * len(x.grid_thw)
  grid = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
  return models.batch_vision_inputs(pix, grid, np.asarray(owner, np.int64), vision)
