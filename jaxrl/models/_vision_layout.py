"""Host-side (numpy) patch layout of the vision tower: window order, attention segments, rotary positions.

:func:`vision_layout` builds one row's :class:`VisionLayout` from its images' ``grid_thw``,
:func:`batch_vision_inputs` a batch's :class:`VisionInputs` (per token row, stacked), which
:class:`jaxrl.models._vision.VisionTower` takes. Computed on the host so jitted shapes stay fixed per
patch bucket (see :mod:`jaxrl.models._vision` for the tower and the HF references).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl.models._vision_config import VisionConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionLayout:
  """Where each patch goes and what it attends to; numpy from :func:`vision_layout`, arrays inside jit.

  ``P`` patches (a bucket, padding at the end), ``U = P / m²`` merged units. Per-patch fields are in
  window order (the order the blocks see). :func:`vision_layout` gives one row's (no leading axis); the
  tower takes a batch's, every field with a leading ``[R]`` axis (:func:`stack_layouts`).
  """

  window_index: Any  # [R, U] int32: merged units in window order (HF get_vision_window_index); padding maps to itself
  window_segments: Any  # [R, P] int32: segment of each patch in window-attention blocks; 0 = padding
  image_segments: Any  # [R, P] int32: segment (one per image frame) in full-attention blocks; 0 = padding
  rotary: Any  # [R, P, 2] int32: (row, column) of each patch for the 2-D rotary embedding


VISION_LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(VisionLayout))
"""The :class:`VisionLayout` fields, as a VL batch names its arrays (``jaxrl.data.stack_vl_rows``)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionInputs:
  """A batch's images for the tower, per token row: row ``r``'s images' patches concatenated in token
  order and zero-padded to ``P``, and their (stacked) layout. Rows shard and split like the tokens."""

  pixel_values: Any  # [R, P, patch_dim] float (padding patches are ignored)
  layout: VisionLayout  # fields [R, ...]
  token_mask: Any = None  # [R, T] int/bool or None: the image tokens images replace (None = all of them)

  @classmethod
  def from_batch(cls, batch: Mapping[str, Any]) -> VisionInputs | None:
    """The images of a VL batch dict (``pixel_values`` and the :data:`VISION_LAYOUT_KEYS` arrays, as
    ``jaxrl.data.stack_vl_rows`` writes them with ``per_row`` and a model config); None without them."""
    if "pixel_values" not in batch:
      return None
    missing = [k for k in VISION_LAYOUT_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch has pixel_values but not the vision layout arrays {missing} (build it with "
                       "VisionPackingConfig(per_row=True) and a model config, or batch_vision_inputs)")
    return cls(batch["pixel_values"], VisionLayout(**{k: batch[k] for k in VISION_LAYOUT_KEYS}),
               batch.get("image_token_mask"))


def vision_layout(grid_thw, cfg: VisionConfig, *, num_patches: int | None = None) -> VisionLayout:
  """The tower's window order, attention segments and rotary positions for images of ``grid_thw``.

  Images are in ``pixel_values`` order; each is ``t`` frames of ``h x w`` patches, its patches laid out as
  the processor does (``m x m`` blocks of a merged unit consecutive, units row-major). Per frame, the
  merged ``(h/m) x (w/m)`` grid is cut into windows of ``window_units`` a side, row-major, the last row
  and column partial; ``window_index`` lists the units window by window (row-major inside a window),
  exactly HF ``get_vision_window_index`` (which pads a grid that the window divides with one empty window
  row/column and drops it again). Window segments number the non-empty windows from 1, image segments the
  frames from 1 (HF ``get_vision_cu_seqlens``). ``rotary`` is each patch's (row, column) in its frame
  (HF ``get_vision_position_ids``). Qwen2-VL has no windows: ``window_index`` is the identity.

  Args:
    grid_thw: ``[I, 3]`` ints (t, h, w) in patches; ``h`` and ``w`` multiples of ``m``.
    cfg: the tower's config.
    num_patches: pad to this many patches (a multiple of ``m²``, at least ``Σ t·h·w``) so jitted shapes
      stay fixed; default: no padding.

  Returns:
    A :class:`VisionLayout` of numpy int32 arrays.
  """
  grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3) if np.size(grid_thw) else np.zeros((0, 3), np.int64)
  m, m2 = cfg.spatial_merge_size, cfg.spatial_merge_size ** 2
  bad = [i for i, (t, h, w) in enumerate(grid.tolist()) if t < 1 or h < m or w < m or h % m or w % m]
  if bad:
    raise ValueError(f"grid_thw: image {bad[0]} has grid {grid[bad[0]].tolist()}; t must be >= 1 and h, w "
                     f"positive multiples of spatial_merge_size {m}")
  total = int(np.prod(grid, axis=1).sum())
  num_patches = total if num_patches is None else int(num_patches)
  if num_patches < total or num_patches % m2:
    raise ValueError(f"num_patches: {num_patches} must be a multiple of {m2} and >= the images' "
                     f"{total} patches (grid_thw {grid.tolist()})")
  order, windows, frames = [], [], []  # per real unit in window order: unit index, window id, frame id
  base = n_windows = n_frames = 0
  for t, h, w in grid.tolist():
    gh, gw = h // m, w // m
    for _ in range(t):
      units = np.arange(gh * gw).reshape(gh, gw) + base
      idx, win = _frame_windows(units, cfg.window_units if cfg.kind == "qwen2_5_vl" else max(gh, gw))
      order.append(idx)
      windows.append(win + n_windows)
      frames.append(np.full(idx.shape, n_frames + 1))
      n_windows, n_frames, base = n_windows + int(win.max()), n_frames + 1, base + gh * gw
  n_units = num_patches // m2
  order = np.concatenate(order + [np.arange(base, n_units)]).astype(np.int32)
  pad = np.zeros(n_units - base, np.int64)
  window_segments = np.repeat(np.concatenate(windows + [pad]), m2).astype(np.int32)
  image_segments = np.repeat(np.concatenate(frames + [pad]), m2).astype(np.int32)
  rotary = np.zeros((num_patches, 2), np.int32)
  rotary[:total] = _unit_rotary(grid, m).reshape(-1, m2, 2)[order[:base]].reshape(-1, 2)
  return VisionLayout(window_index=order, window_segments=window_segments, image_segments=image_segments,
                      rotary=rotary)


def _frame_windows(units: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
  """Units ``[gh, gw]`` in window order and each one's window id (1-based, non-empty windows only)."""
  gh, gw = units.shape
  nh, nw = -(-gh // size), -(-gw // size)
  padded = np.full((nh * size, nw * size), -1, np.int64)
  padded[:gh, :gw] = units
  ids = np.broadcast_to(np.arange(1, nh * nw + 1).reshape(nh, 1, nw, 1), (nh, size, nw, size))
  tiles = padded.reshape(nh, size, nw, size).transpose(0, 2, 1, 3).reshape(-1)
  tile_ids = ids.transpose(0, 2, 1, 3).reshape(-1)
  keep = tiles >= 0
  return tiles[keep], tile_ids[keep]


def _unit_rotary(grid: np.ndarray, m: int) -> np.ndarray:
  """(row, column) of every patch in processor order, ``[Σ t·h·w, 2]`` (HF ``get_vision_position_ids``)."""
  out = []
  for t, h, w in grid.tolist():
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocks = [a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)]
    out.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
  return np.concatenate(out) if out else np.zeros((0, 2), np.int64)


def stack_layouts(layouts) -> VisionLayout:
  """One-row layouts (:func:`vision_layout`, all with the same ``num_patches``) stacked on a leading ``[R]``."""
  layouts = list(layouts)
  sizes = {len(lay.image_segments) for lay in layouts}
  if len(sizes) != 1:
    raise ValueError(f"stack_layouts: rows must share num_patches, got {sorted(sizes)}")
  return VisionLayout(**{k: np.stack([getattr(lay, k) for lay in layouts]) for k in VISION_LAYOUT_KEYS})


def batch_vision_inputs(pixel_values, grid_thw, image_rows, cfg: VisionConfig) -> VisionInputs:
  """A batch's :class:`VisionInputs` on the host (numpy) from per-row patches and the images' grids.

  Args:
    pixel_values: ``[R, P, patch_dim]``; row ``r`` holds its images' patches in token order, then zeros.
    grid_thw: ``[I, 3]`` every image's grid, rows in order, each row's images in token order.
    image_rows: ``[I]`` the row of each image (non-decreasing).
    cfg: the tower's config.

  Rows without images get an all-padding layout (segment 0, zero tower output).
  """
  pixel_values = np.asarray(pixel_values, np.float32)
  if pixel_values.ndim != 3 or pixel_values.shape[2] != cfg.patch_dim:
    raise ValueError(f"pixel_values must be [R, P, patch_dim={cfg.patch_dim}], got {pixel_values.shape}")
  grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
  rows = np.asarray(image_rows, np.int64).reshape(-1)
  num_rows, num_patches = pixel_values.shape[:2]
  if len(rows) != len(grid) or (len(rows) and (rows.min() < 0 or rows.max() >= num_rows or np.any(np.diff(rows) < 0))):
    raise ValueError(f"image_rows {rows.tolist()} must give a row in [0, {num_rows}) for each of the {len(grid)} "
                     "images, in order")
  layouts = [vision_layout(grid[rows == r], cfg, num_patches=num_patches) for r in range(num_rows)]
  return VisionInputs(pixel_values, stack_layouts(layouts))


def pad_patch_rows(arrays: Mapping[str, Any], num_patches: int, merge_size: int) -> dict[str, Any]:
  """Per-row VL batch arrays with their patch bucket raised to ``num_patches`` (same values otherwise).

  ``pixel_values [..., P, patch_dim]`` and ``rotary [..., P, 2]`` get zero patches, ``window_segments`` /
  ``image_segments [..., P]`` segment 0 (padding), ``window_index [..., U]`` the padding units mapped to
  themselves (``U..U'-1``): exactly what :func:`vision_layout` gives with the larger ``num_patches``, so the
  tower's output on the real units is unchanged. Used where processes pack their own rows and must agree on
  one bucket (every process compiles and feeds the same shapes). Other arrays pass through.
  """
  m2 = merge_size * merge_size
  have = int(np.shape(arrays["window_segments"])[-1])
  if num_patches < have or num_patches % m2:
    raise ValueError(f"num_patches: {num_patches} must be a multiple of {m2} and >= the batch's bucket {have}")
  out = dict(arrays)
  if num_patches == have:
    return out
  extra = num_patches - have

  def pad(x, axis: int):  # zeros appended on `axis` (counted from the end)
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + axis] = (0, extra)
    return np.pad(np.asarray(x), widths)

  out["pixel_values"], out["rotary"] = pad(arrays["pixel_values"], -2), pad(arrays["rotary"], -2)
  out["window_segments"], out["image_segments"] = pad(arrays["window_segments"], -1), pad(arrays["image_segments"], -1)
  index = np.asarray(arrays["window_index"])  # [..., U]
  tail = np.arange(have // m2, num_patches // m2, dtype=index.dtype)
  out["window_index"] = np.concatenate([index, np.broadcast_to(tail, (*index.shape[:-1], len(tail)))], axis=-1)
  return out
