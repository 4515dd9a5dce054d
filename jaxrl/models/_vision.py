"""The Qwen2.5-VL and Qwen2-VL vision towers: config, host-side patch layout and the NNX module.

The tower turns each batch row's patches ``[R, P, C·T·P·P]`` (the processor's ``pixel_values`` of the
row's images, concatenated in token order and zero-padded to a per-row bucket ``P``) into merged
embeddings ``[R, P / m², D_out]`` that replace the row's image placeholder tokens in the language model:

* patch embedding: a linear map over ``C·T·P·P`` (HF's ``Conv3d`` with stride = kernel);
* ``depth`` pre-norm blocks ``x += proj(attn(norm1(x))); x += mlp(norm2(x))`` with 2-D rotary
  embeddings (row, column of each patch) and bidirectional attention through
  :func:`jaxrl.kernels.attention` (``causal=False``);
* Qwen2.5-VL: RMSNorm, a SwiGLU MLP with biases, and window attention: merged units are reordered into
  windows of ``window_size / (m·P)`` units a side, every block but those in ``fullatt_block_indexes``
  attends within a window; the full-attention blocks attend within an image frame;
* Qwen2-VL: LayerNorm, a QuickGELU ``fc1``/``fc2`` MLP, every block attends within an image frame;
* patch merger: norm, then the ``m²`` patches of each merged unit concatenated and sent through
  ``Linear -> GELU(exact) -> Linear``; the window permutation is undone so rows come out in image-token
  order.

Both attention kinds are segment-id masks over each row's packed patch sequence, so the tower runs a
batch of ``R`` patch sequences (one per token row, sharded and micro-batched with the rows) in one call
with fixed (bucketed) shapes; :func:`vision_layout` builds one row's masks, window order and rotary
positions on the host, :func:`batch_vision_inputs` a batch's. A row without images is all padding
(segment 0, zero output) and needs no dummy image: every parameter's gradient comes from the same jitted
program on every device, zero where unused, so there is no FSDP-style gradient hook to keep in step.

Reference: transformers 5 ``modeling_qwen2_5_vl.py`` (``Qwen2_5_VisionTransformerPretrainedModel``),
``modeling_qwen2_vl.py`` (``Qwen2VisionTransformerPretrainedModel``) and ``vision_utils.py``
(``get_vision_window_index``, ``get_vision_position_ids``, ``get_vision_cu_seqlens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import kernels

VISION_KINDS = ("qwen2_5_vl", "qwen2_vl")
"""Tower kinds: ``qwen2_5_vl`` (RMSNorm, SwiGLU with bias, windows), ``qwen2_vl`` (LayerNorm, QuickGELU)."""
_ACTIVATIONS = {"qwen2_5_vl": "silu", "qwen2_vl": "quick_gelu"}
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Shapes of a Qwen2.5-VL / Qwen2-VL vision tower (HF ``vision_config``)."""

  kind: str
  "``qwen2_5_vl`` or ``qwen2_vl``."
  depth: int
  "Number of blocks."
  hidden_size: int
  "Width ``E`` of the blocks (Qwen2-VL's ``embed_dim``)."
  intermediate_size: int
  "MLP width (Qwen2-VL: ``embed_dim · mlp_ratio``)."
  num_heads: int
  "Attention heads; head_dim = hidden_size / num_heads."
  out_hidden_size: int
  "Merger output width = the language model's hidden size (Qwen2-VL's ``hidden_size``)."
  in_channels: int = 3
  "Image channels ``C``."
  patch_size: int = 14
  "Patch side ``P`` in pixels."
  temporal_patch_size: int = 2
  "Frames per patch ``T`` (a still image is repeated T times by the processor)."
  spatial_merge_size: int = 2
  "The merger concatenates ``m x m`` patches into one token."
  window_size: int = 112
  "Window side in pixels (Qwen2.5-VL); merged units per window side = window_size // m // P."
  fullatt_block_indexes: tuple[int, ...] = ()
  "Blocks with full (per-frame) attention (Qwen2.5-VL); the others attend within windows."
  norm_eps: float = 1e-6
  "Epsilon of every norm in the tower (HF hard-codes 1e-6)."
  rope_theta: float = 10000.0
  "Base of the 2-D rotary embedding (HF ``rope_parameters.rope_theta``, default 10000)."
  tokens_per_second: int = 2
  "Temporal rope scale of videos (Qwen2.5-VL); carried for config round trips."

  def __post_init__(self):
    if self.kind not in VISION_KINDS:
      raise ValueError(f"vision.kind: {self.kind!r} is not one of {list(VISION_KINDS)}")
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "in_channels",
                 "patch_size", "temporal_patch_size", "spatial_merge_size"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"vision.{name}: must be positive, got {getattr(self, name)!r}")
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
      raise ValueError(f"vision.hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a head_dim "
                       "divisible by 4 (the 2-D rotary embedding splits it into row and column halves)")
    object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
    bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
    if bad:
      raise ValueError(f"vision.fullatt_block_indexes: {bad} outside [0, depth={self.depth})")
    if self.kind == "qwen2_5_vl" and self.window_units < 1:
      raise ValueError(f"vision.window_size: {self.window_size} px is smaller than one merged unit "
                       f"({self.spatial_merge_size * self.patch_size} px)")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    """Length ``C·T·P·P`` of one flattened patch (a row of ``pixel_values``)."""
    return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

  @property
  def window_units(self) -> int:
    """Merged units per window side (HF ``vit_merger_window_size``)."""
    return self.window_size // self.spatial_merge_size // self.patch_size

  @property
  def full_attention(self) -> tuple[bool, ...]:
    """Per block: attends within the whole frame (True) or within its window (False)."""
    if self.kind == "qwen2_vl":
      return (True,) * self.depth
    return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

  @property
  def num_params(self) -> int:
    """Parameter count: patch embedding, blocks and merger (weights and biases)."""
    e, f, m2, out = self.hidden_size, self.intermediate_size, self.spatial_merge_size ** 2, self.out_hidden_size
    norm = e if self.kind == "qwen2_5_vl" else 2 * e  # RMSNorm scale | LayerNorm scale + bias
    mlp = 3 * e * f + 2 * f + e if self.kind == "qwen2_5_vl" else 2 * e * f + f + e
    block = 2 * norm + (3 * e * e + 3 * e) + (e * e + e) + mlp
    merger = norm + (m2 * e) ** 2 + m2 * e + m2 * e * out + out
    return self.patch_dim * e + self.depth * block + merger

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], *, source: str) -> VisionConfig:
    """From an HF ``vision_config`` (transformers 5 or the hub layout); errors name ``source``."""
    if not isinstance(hf, Mapping):
      raise ValueError(f"{source}: vision_config must be a mapping, got {type(hf).__name__}")
    kind = "qwen2_vl" if "embed_dim" in hf else "qwen2_5_vl"
    act = hf.get("hidden_act", _ACTIVATIONS[kind])
    if act != _ACTIVATIONS[kind]:
      raise ValueError(f"{source}: hidden_act {act!r} is not supported for a {kind} tower "
                       f"(expected {_ACTIVATIONS[kind]!r})")
    rope = hf.get("rope_parameters") or {}
    common = dict(
        kind=kind, in_channels=int(hf.get("in_channels", hf.get("in_chans", 3))),
        patch_size=int(hf.get("patch_size", hf.get("spatial_patch_size", 14))),
        temporal_patch_size=int(hf.get("temporal_patch_size", 2)),
        spatial_merge_size=int(hf.get("spatial_merge_size", 2)), depth=int(_need(hf, "depth", source)),
        num_heads=int(_need(hf, "num_heads", source)), rope_theta=float(rope.get("rope_theta", 10000.0)))
    try:
      if kind == "qwen2_vl":
        e = int(hf["embed_dim"])
        return cls(hidden_size=e, intermediate_size=int(e * float(hf.get("mlp_ratio", 4))),
                   out_hidden_size=int(_need(hf, "hidden_size", source)), **common)
      return cls(hidden_size=int(_need(hf, "hidden_size", source)),
                 intermediate_size=int(_need(hf, "intermediate_size", source)),
                 out_hidden_size=int(_need(hf, "out_hidden_size", source)),
                 window_size=int(hf.get("window_size", 112)),
                 fullatt_block_indexes=tuple(hf.get("fullatt_block_indexes", ())),
                 tokens_per_second=int(hf.get("tokens_per_second", 2)), **common)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None

  def to_hf(self) -> dict[str, Any]:
    """The hub-layout ``vision_config`` dict (what the Qwen checkpoints on the hub carry)."""
    out = dict(depth=self.depth, num_heads=self.num_heads, in_chans=self.in_channels, patch_size=self.patch_size,
               spatial_patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
               spatial_merge_size=self.spatial_merge_size, hidden_act=_ACTIVATIONS[self.kind])
    if self.rope_theta != 10000.0:
      out["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
    if self.kind == "qwen2_vl":
      ratio = self.intermediate_size / self.hidden_size
      return dict(out, embed_dim=self.hidden_size, mlp_ratio=int(ratio) if ratio.is_integer() else ratio,
                  hidden_size=self.out_hidden_size)
    return dict(out, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                out_hidden_size=self.out_hidden_size, window_size=self.window_size,
                fullatt_block_indexes=list(self.fullatt_block_indexes), tokens_per_second=self.tokens_per_second)

  @classmethod
  def qwen2p5_vl_3b(cls, **overrides) -> VisionConfig:
    """Qwen/Qwen2.5-VL-3B-Instruct's tower (config.json ``vision_config``: depth 32, hidden 1280,
    intermediate 3420, 16 heads, out 2048, window 112, full attention in blocks 7/15/23/31)."""
    return cls(**{**_QWEN2_5_VL_TOWER, "out_hidden_size": 2048, **overrides})

  @classmethod
  def qwen2p5_vl_7b(cls, **overrides) -> VisionConfig:
    """Qwen/Qwen2.5-VL-7B-Instruct's tower: the 3B's with out_hidden_size 3584."""
    return cls(**{**_QWEN2_5_VL_TOWER, "out_hidden_size": 3584, **overrides})

  @classmethod
  def qwen2_vl_2b(cls, **overrides) -> VisionConfig:
    """Qwen/Qwen2-VL-2B-Instruct's tower (``vision_config``: depth 32, embed_dim 1280, mlp_ratio 4,
    16 heads, hidden_size (merger output) 1536)."""
    return cls(**{**dict(kind="qwen2_vl", depth=32, hidden_size=1280, intermediate_size=5120, num_heads=16,
                         out_hidden_size=1536), **overrides})


_QWEN2_5_VL_TOWER = dict(kind="qwen2_5_vl", depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                         window_size=112, fullatt_block_indexes=(7, 15, 23, 31))


def _need(hf: Mapping[str, Any], key: str, source: str) -> Any:
  if key not in hf:
    raise ValueError(f"{source}: missing {key!r}")
  return hf[key]


# --------------------------------------------------------------------------------------------------
# Host-side layout


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


# --------------------------------------------------------------------------------------------------
# The module


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
  """A parameter annotated with logical axis names (as the language model's; placement is elsewhere)."""
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
  return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class VisionNorm(nnx.Module):
  """RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL) over the last axis, in float32.

  ``rms: x / sqrt(mean(x²) + eps) · scale``; ``layer: (x - mean) / sqrt(var + eps) · scale + bias``.
  """

  def __init__(self, dim: int, *, layer_norm: bool, eps: float, param_dtype):
    self.scale = _param(jnp.ones((dim,), param_dtype), ("norm",))
    self.bias = _param(jnp.zeros((dim,), param_dtype), ("norm",)) if layer_norm else None
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., E] -> [..., E]
    x32 = x.astype(jnp.float32)
    if self.bias is not None:
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps) * self.scale[...].astype(
        jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


class VisionBlock(nnx.Module):
  """One tower block: ``x += proj(attn(norm1(x))); x += mlp(norm2(x))`` with 2-D RoPE on q and k."""

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    e, n, h, f, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size, param_dtype
    layer_norm = cfg.kind == "qwen2_vl"
    self.dtype = dtype
    self.norm1 = VisionNorm(e, layer_norm=layer_norm, eps=cfg.norm_eps, param_dtype=pd)
    self.norm2 = VisionNorm(e, layer_norm=layer_norm, eps=cfg.norm_eps, param_dtype=pd)
    self.qkv = _param(_normal(rngs, (e, 3, n, h), pd), ("embed", None, "heads", "head_dim"))
    self.qkv_bias = _param(jnp.zeros((3, n, h), pd), (None, "heads", "head_dim"))
    self.proj = _param(_normal(rngs, (n, h, e), pd), ("heads", "head_dim", "embed"))
    self.proj_bias = _param(jnp.zeros((e,), pd), ("norm",))
    up, down = (("gate", "up"), "down") if cfg.kind == "qwen2_5_vl" else (("fc1",), "fc2")
    for name in up:
      setattr(self, name, _param(_normal(rngs, (e, f), pd), ("embed", "mlp")))
      setattr(self, name + "_bias", _param(jnp.zeros((f,), pd), ("mlp",)))
    setattr(self, down, _param(_normal(rngs, (f, e), pd), ("mlp", "embed")))
    setattr(self, down + "_bias", _param(jnp.zeros((e,), pd), ("norm",)))

  def _w(self, name: str) -> jax.Array:
    return getattr(self, name)[...].astype(self.dtype)

  def mlp(self, x: jax.Array) -> jax.Array:  # [R, P, E] -> [R, P, E]
    """SwiGLU ``(silu(x·Wg + bg) ⊙ (x·Wu + bu))·Wd + bd`` (Qwen2.5-VL) or QuickGELU
    ``g(x·W1 + b1)·W2 + b2``, ``g(z) = z·sigmoid(1.702 z)`` (Qwen2-VL)."""
    if hasattr(self, "gate"):
      gate = jnp.einsum("...e,ef->...f", x, self._w("gate")) + self._w("gate_bias")
      up = jnp.einsum("...e,ef->...f", x, self._w("up")) + self._w("up_bias")
      return jnp.einsum("...f,fe->...e", jax.nn.silu(gate) * up, self._w("down")) + self._w("down_bias")
    z = jnp.einsum("...e,ef->...f", x, self._w("fc1")) + self._w("fc1_bias")
    return jnp.einsum("...f,fe->...e", z * jax.nn.sigmoid(1.702 * z), self._w("fc2")) + self._w("fc2_bias")

  def __call__(self, x, *, cos, sin, segments, placement=None, attention_impl="auto", interpret=False):
    """``x [R, P, E]`` -> ``[R, P, E]``; ``cos``/``sin [R, P, H]`` rotary tables, ``segments [R, P]`` the
    attention mask (each row's patch sequence attends within itself)."""
    with jax.named_scope("attention"):
      qkv = jnp.einsum("rpe,ecnh->rpcnh", self.norm1(x), self._w("qkv")) + self._w("qkv_bias")  # [R, P, 3, N, H]
      q, k = (_rotate(qkv[:, :, i], cos, sin) for i in (0, 1))
      attend = kernels.attention if placement is None else placement.attention
      out = attend(q, k, qkv[:, :, 2], segment_ids=segments, causal=False, impl=attention_impl,
                   interpret=interpret)  # [R, P, N, H]
      x = x + jnp.einsum("rpnh,nhe->rpe", out, self._w("proj")) + self._w("proj_bias")
    with jax.named_scope("mlp"):
      return x + self.mlp(self.norm2(x))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:  # [R, P, N, H] -> [R, P, N, H]
  """``x·cos + rotate_half(x)·sin`` in float32 (HF ``apply_rotary_pos_emb_vision``)."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


def rotary_tables(rotary: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
  """``cos, sin [..., P, H]`` float32 of the 2-D RoPE at (row, column) ``rotary [..., P, 2]``.

  ``inv_freq_j = θ^(-2j / (H/2))`` for ``j < H/4``; angles ``[row·inv_freq, col·inv_freq]`` (H/2) repeated
  twice to cover the head (HF ``Qwen2_5_VLVisionRotaryEmbedding``).
  """
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [H/4]
  angles = (rotary.astype(jnp.float32)[..., None] * inv_freq).reshape(*rotary.shape[:-1], half)  # [..., P, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


class PatchMerger(nnx.Module):
  """``fc2(gelu(fc1(concat_{m²}(norm(x)))))``: one output row per merged unit; exact (erf) GELU."""

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    e, m2, pd = cfg.hidden_size, cfg.spatial_merge_size ** 2, param_dtype
    self.dtype = dtype
    self.norm = VisionNorm(e, layer_norm=cfg.kind == "qwen2_vl", eps=cfg.norm_eps, param_dtype=pd)
    self.fc1 = _param(_normal(rngs, (m2 * e, m2 * e), pd), ("embed", "mlp"))
    self.fc1_bias = _param(jnp.zeros((m2 * e,), pd), ("mlp",))
    self.fc2 = _param(_normal(rngs, (m2 * e, cfg.out_hidden_size), pd), ("mlp", "embed"))
    self.fc2_bias = _param(jnp.zeros((cfg.out_hidden_size,), pd), ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:  # [R, P, E] -> [R, P / m², D_out]
    e = self.fc1.shape[0]
    h = self.norm(x).reshape(x.shape[0], -1, e)  # [R, U, m²E]
    h = jnp.einsum("rue,ef->ruf", h, self.fc1[...].astype(self.dtype)) + self.fc1_bias[...].astype(self.dtype)
    h = jax.nn.gelu(h, approximate=False)
    return jnp.einsum("ruf,fd->rud", h, self.fc2[...].astype(self.dtype)) + self.fc2_bias[...].astype(self.dtype)


class VisionTower(nnx.Module):
  """The Qwen2.5-VL / Qwen2-VL vision encoder: per-row patches ``[R, P, C·T·P·P]`` -> merged rows
  ``[R, P/m², D_out]``.

  Example::

      tower = VisionTower(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
      images = batch_vision_inputs(pixels, grid_thw, image_rows, cfg)  # pixels [R, 1024, patch_dim]
      rows = tower(jnp.asarray(images.pixel_values), jax.tree.map(jnp.asarray, images.layout))  # [R, 256, D_out]
  """

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, scan_layers: bool = True, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    self.scan_layers = scan_layers
    c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
    self.patch_embed = _param(_normal(rngs, (c, t, p, p, cfg.hidden_size), param_dtype),
                              (None, None, None, None, "embed"))
    if scan_layers:
      keys = jax.random.split(rngs.params(), cfg.depth)
      make = nnx.vmap(lambda key: VisionBlock(cfg, param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(params=key)),
                      in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      self.blocks = make(keys)
    else:
      self.blocks = nnx.List([VisionBlock(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
                              for _ in range(cfg.depth)])
    self.merger = PatchMerger(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)

  def __call__(self, pixel_values, layout: VisionLayout, *, placement=None, attention_impl="auto",
               interpret=False, remat_policy=None) -> jax.Array:
    """Merged embeddings ``[R, U, D_out]`` of ``pixel_values [R, P, C·T·P·P]``, each row's in image-token
    (original) order.

    Rows of padding units (``image_segments == 0``) are zero. ``placement`` (the language model's
    :class:`~jaxrl.models.Placement`, or None) runs attention per shard; ``remat_policy`` (a
    ``jax.checkpoint_policies`` entry, e.g. ``ModelConfig.remat_policy``) rematerialises each block in
    the backward pass; None saves every activation.
    """
    cfg, m2 = self.cfg, self.cfg.spatial_merge_size ** 2
    want = (*layout.image_segments.shape, cfg.patch_dim)
    if layout.image_segments.ndim != 2 or tuple(pixel_values.shape) != want:
      raise ValueError(f"pixel_values: expected [R, P, patch_dim]={want} (the layout's rows and patches, "
                       f"C·T·P·P), got {tuple(pixel_values.shape)}; layouts need a leading row axis (stack_layouts)")
    num_rows, num_patches = want[:2]
    with jax.named_scope("patch_embed"):
      w = self.patch_embed[...].astype(self.dtype).reshape(cfg.patch_dim, cfg.hidden_size)
      x = jnp.einsum("rpk,ke->rpe", pixel_values.astype(self.dtype), w)  # [R, P, E]
      x = jnp.take_along_axis(x.reshape(num_rows, -1, m2, cfg.hidden_size), layout.window_index[:, :, None, None],
                              axis=1).reshape(num_rows, num_patches, -1)
    x = self._blocks(x, layout, remat_policy=remat_policy, placement=placement, attention_impl=attention_impl,
                     interpret=interpret)
    with jax.named_scope("merger"):
      merged = self.merger(x)  # [R, U, D_out], window order
      real = layout.image_segments.reshape(num_rows, -1, m2)[..., 0] > 0  # [R, U]
      merged = jnp.where(real[..., None], merged, 0)
      return jax.vmap(lambda m, order: jnp.zeros_like(m).at[order].set(m))(merged, layout.window_index)

  def _blocks(self, x, layout: VisionLayout, *, remat_policy, **kw) -> jax.Array:  # [R, P, E] -> [R, P, E]
    """Every block, scanned or looped; each takes the frame or the window segments (``full_attention``)."""
    cos, sin = rotary_tables(layout.rotary, self.cfg)
    full = jnp.asarray(self.cfg.full_attention)

    def block_fn(block, x, is_full):
      segments = jnp.where(is_full, layout.image_segments, layout.window_segments)
      return block(x, cos=cos, sin=sin, segments=segments, **kw)

    if remat_policy is not None:
      block_fn = nnx.remat(block_fn, policy=remat_policy, prevent_cse=not self.scan_layers)
    if self.scan_layers:
      scan = nnx.scan(lambda x, block, is_full: (block_fn(block, x, is_full), None), in_axes=(nnx.Carry, 0, 0),
                      out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
      with jax.named_scope("blocks"):
        return scan(x, self.blocks, full)[0]
    for i, block in enumerate(self.blocks):
      with jax.named_scope(f"block_{i}"):
        x = block_fn(block, x, full[i])
    return x


# --------------------------------------------------------------------------------------------------
# Hugging Face names


_VEC = ((1,), (0,))  # a 1-D tensor as is
_LINEAR = ((1, 1), (1, 0))  # HF [out, in] -> ours [in, out]
VISION_HF_LAYOUTS: dict[tuple[str, ...], tuple[str, tuple[int, ...], tuple[int, ...]]] = {
    ("patch_embed",): ("patch_embed.proj.weight", (1, 1, 1, 1, 1), (1, 2, 3, 4, 0)),  # [E, C, T, P, P]
    ("merger", "norm", "scale"): ("merger.ln_q.weight", *_VEC),
    ("merger", "norm", "bias"): ("merger.ln_q.bias", *_VEC),
    ("merger", "fc1"): ("merger.mlp.0.weight", *_LINEAR),
    ("merger", "fc1_bias"): ("merger.mlp.0.bias", *_VEC),
    ("merger", "fc2"): ("merger.mlp.2.weight", *_LINEAR),
    ("merger", "fc2_bias"): ("merger.mlp.2.bias", *_VEC),
    ("norm1", "scale"): ("blocks.{i}.norm1.weight", *_VEC),
    ("norm1", "bias"): ("blocks.{i}.norm1.bias", *_VEC),
    ("norm2", "scale"): ("blocks.{i}.norm2.weight", *_VEC),
    ("norm2", "bias"): ("blocks.{i}.norm2.bias", *_VEC),
    ("qkv",): ("blocks.{i}.attn.qkv.weight", (3, 1), (3, 0, 1, 2)),  # [3·N·H, E] -> [E, 3, N, H]
    ("qkv_bias",): ("blocks.{i}.attn.qkv.bias", (3,), (0, 1, 2)),
    ("proj",): ("blocks.{i}.attn.proj.weight", (1, 2), (1, 2, 0)),  # [E, N·H] -> [N, H, E]
    ("proj_bias",): ("blocks.{i}.attn.proj.bias", *_VEC),
    ("gate",): ("blocks.{i}.mlp.gate_proj.weight", *_LINEAR),
    ("gate_bias",): ("blocks.{i}.mlp.gate_proj.bias", *_VEC),
    ("up",): ("blocks.{i}.mlp.up_proj.weight", *_LINEAR),
    ("up_bias",): ("blocks.{i}.mlp.up_proj.bias", *_VEC),
    ("down",): ("blocks.{i}.mlp.down_proj.weight", *_LINEAR),
    ("down_bias",): ("blocks.{i}.mlp.down_proj.bias", *_VEC),
    ("fc1",): ("blocks.{i}.mlp.fc1.weight", *_LINEAR),
    ("fc1_bias",): ("blocks.{i}.mlp.fc1.bias", *_VEC),
    ("fc2",): ("blocks.{i}.mlp.fc2.weight", *_LINEAR),
    ("fc2_bias",): ("blocks.{i}.mlp.fc2.bias", *_VEC),
}
"""Our tower parameter paths -> ``(hf_name, groups, perm)`` in ``jaxrl.models._hf._Layout``'s convention
(``ours = reshape(hf, split).transpose(perm)``, HF dim ``i`` merging ``groups[i]`` split dims). Top-level
paths are relative to the tower, block paths (HF name with ``{i}``) relative to one block (``blocks``
holds them, stacked on a leading ``layers`` axis when scanned). HF names are relative to the tower: the
hub prefixes ``visual.``, transformers 5's modules ``model.visual.``. Each kind uses the subset its
modules hold (``norm*.bias`` and ``fc1``/``fc2``: Qwen2-VL; ``gate``/``up``/``down``: Qwen2.5-VL)."""
