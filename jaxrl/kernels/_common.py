"""Shared pieces of the attention kernels: argument normalisation, tiling, padding, masks."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.kernels._reference import MASK_VALUE, pair  # noqa: F401  (pair: re-exported)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Log-sum-exp stored for a query that sees no key: exp(s - EMPTY_LSE) is 0 for any finite logit,
# and EMPTY_LSE · log2(e) still fits in float32.
EMPTY_LSE = -0.25 * MASK_VALUE

# ``lax.dot_general`` dimension numbers of the kernels' 2-D tile products.
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b
NN = (((1,), (0,)), ((), ()))  # a @ b


def dot_f32(a, b, dims):
  """``a·b`` accumulated in float32 inside a kernel, with the precision stated so that a global
  ``jax_default_matmul_precision`` cannot change it: Mosaic refuses an fp32-precision dot on bf16
  operands ("Bad lhs type"). Narrow operands multiply exactly into the float32 accumulator at
  ``DEFAULT``; float32 operands keep full precision with ``HIGHEST``."""
  wide = jnp.float32 in (a.dtype, b.dtype)
  precision = lax.Precision.HIGHEST if wide else lax.Precision.DEFAULT
  return lax.dot_general(a, b, dims, precision=(precision, precision), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Kernel tiling, in tokens (``None`` picks a backend default).

  The Triton kernels process a kv head's whole query-head group per program, so a query tile holds
  ``block_q × group`` rows. The backward pass (dq and dk/dv kernels) uses its own pair of sizes.
  """
  block_q: int | None = None
  """Query positions per forward tile."""
  block_kv: int | None = None
  """Key positions per forward tile."""
  block_q_bwd: int | None = None
  """Query positions per backward tile."""
  block_kv_bwd: int | None = None
  """Key positions per backward tile."""
  num_warps: int | None = None
  """Triton only: warps per program."""
  num_stages: int | None = None
  """Triton only: software-pipelining stages."""

  def __post_init__(self):
    for f in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      val = getattr(self, f)
      if val is not None and (val < 1 or val & (val - 1)):
        raise ValueError(f"BlockSizes.{f} must be a power of two, got {val}")


@dataclasses.dataclass(frozen=True)
class Config:
  """Static configuration of one kernel call (hashable: a ``custom_vjp`` nondiff argument)."""
  causal: bool
  sm_scale: float
  softcap: float | None
  window: int | None
  blocks: BlockSizes
  interpret: Any = False
  debug: bool = False


def as_block_sizes(block_sizes) -> BlockSizes:
  """Accept ``None``, a :class:`BlockSizes` or a dict of its fields."""
  if block_sizes is None:
    return BlockSizes()
  if isinstance(block_sizes, BlockSizes):
    return block_sizes
  if isinstance(block_sizes, dict):
    return BlockSizes(**block_sizes)
  raise TypeError(f"block_sizes must be None, a dict or a BlockSizes, got {type(block_sizes)}")


def next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


def round_up(x: int, m: int) -> int:
  return (x + m - 1) // m * m


def normalise_ids(
    segment_ids, positions, b: int, t: int, s: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Segment ids and positions as four int32 arrays ``q_seg [B,T], kv_seg [B,S], q_pos, kv_pos``."""
  q_seg, kv_seg = pair(segment_ids, "segment_ids")
  if positions is None:
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  else:
    q_pos, kv_pos = pair(positions, "positions")
  out = [jnp.asarray(x).astype(jnp.int32) for x in (q_seg, kv_seg, q_pos, kv_pos)]
  for name, x, n in zip(("q segment_ids", "kv segment_ids", "q positions", "kv positions"),
                        out, (t, s, t, s)):
    if x.shape != (b, n):
      raise ValueError(f"{name} must have shape {(b, n)}, got {x.shape}")
  return tuple(out)


def pad_axis(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
  if x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def visible(
    q_seg: jax.Array,  # [M] or [M, 1]
    q_pos: jax.Array,
    kv_seg: jax.Array,  # [S] or [1, S]
    kv_pos: jax.Array,
    *,
    causal: bool,
    window: int | None,
) -> jax.Array:  # [M, S] bool
  """The element-wise rule of :func:`make_mask` on one tile (inside kernels)."""
  if q_seg.ndim == 1:
    q_seg, q_pos = q_seg[:, None], q_pos[:, None]
  if kv_seg.ndim == 1:
    kv_seg, kv_pos = kv_seg[None, :], kv_pos[None, :]
  mask = (q_seg == kv_seg) & (q_seg != 0)
  if causal or window is not None:
    delta = q_pos - kv_pos
    if causal:
      mask &= delta >= 0
    if window is not None:
      mask &= delta < window
      if not causal:
        mask &= delta > -window
  return mask
