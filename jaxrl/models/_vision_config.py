"""The Qwen2.5-VL / Qwen2-VL vision tower's configuration (HF ``vision_config``): shapes, kinds, presets.

The tower itself is :mod:`jaxrl.models._vision`; the host-side patch layout :mod:`jaxrl.models._vision_layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

VISION_KINDS = ("qwen2_5_vl", "qwen2_vl")
"""Tower kinds: ``qwen2_5_vl`` (RMSNorm, SwiGLU with bias, windows), ``qwen2_vl`` (LayerNorm, QuickGELU)."""
_ACTIVATIONS = {"qwen2_5_vl": "silu", "qwen2_vl": "quick_gelu"}


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
