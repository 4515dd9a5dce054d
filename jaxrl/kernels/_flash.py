"""Flash attention with a custom VJP around the Pallas backends (Triton GPU, Mosaic TPU).

The forward pass saves ``o`` and the float32 log-sum-exp; the backward pass computes
``delta = Σ_h o·do`` and runs a dq pass and a dk/dv pass (see the backend modules). Sequences are
padded here to a multiple of the tiles with segment id 0 (padding), so any ``T``/``S`` is exact.
"""

from __future__ import annotations

import functools

import jax

from jaxrl.kernels import _common
from jaxrl.kernels._common import Config, pad_axis, round_up


def _backend(name: str):
  if name == "triton":
    from jaxrl.kernels import _triton  # lazy: the Triton lowering is only needed on a GPU backend
    return _triton
  if name == "tpu":
    from jaxrl.kernels import _tpu  # lazy: the Mosaic TPU lowering is only needed on a TPU backend
    return _tpu
  raise ValueError(f"unknown flash backend {name!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(backend, cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  return _backend(backend).forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]


def _flash_fwd(backend, cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  o, lse = _backend(backend).forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return o, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse)


def _flash_bwd(backend, cfg, res, do):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse = res
  dq, dk, dv = _backend(backend).backward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse, do)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def prepare(
    backend: str,
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    segment_ids,
    positions,
    *,
    causal: bool,
    sm_scale: float | None,
    softcap: float | None,
    window: int | None,
    block_sizes,
    interpret,
    debug: bool = False,
):
  """Validate, resolve tiles and pad; returns ``(cfg, padded arrays, T)``."""
  b, t, n, h = q.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[3] != h or v.shape != k.shape:
    raise ValueError(f"k and v must be [B, S, K, {h}] with B={b}, got {k.shape} and {v.shape}")
  s, kh = k.shape[1], k.shape[2]
  if n % kh:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kh})")
  if window is not None and window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  if softcap is not None and softcap <= 0:
    raise ValueError(f"softcap must be > 0, got {softcap}")
  q_seg, kv_seg, q_pos, kv_pos = _common.normalise_ids(segment_ids, positions, b, t, s)
  mod = _backend(backend)
  blocks = mod.resolve_blocks(_common.as_block_sizes(block_sizes), t=t, s=s, head_dim=h,
                              group=n // kh)
  tp = round_up(t, max(blocks.block_q, blocks.block_q_bwd))
  sp = round_up(s, max(blocks.block_kv, blocks.block_kv_bwd))
  if interpret is True and hasattr(mod, "default_interpret"):
    interpret = mod.default_interpret()
  cfg = Config(causal=bool(causal), sm_scale=float(h**-0.5 if sm_scale is None else sm_scale),
               softcap=None if softcap is None else float(softcap),
               window=None if window is None else int(window), blocks=blocks,
               interpret=interpret, debug=debug)
  arrays = (pad_axis(q, 1, tp), pad_axis(k, 1, sp), pad_axis(v, 1, sp), pad_axis(q_seg, 1, tp),
            pad_axis(kv_seg, 1, sp), pad_axis(q_pos, 1, tp), pad_axis(kv_pos, 1, sp))
  return cfg, arrays, t


def flash_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids,
    positions=None,
    causal: bool = True,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_sizes=None,
    backend: str = "triton",
    interpret=False,
) -> jax.Array:  # [B, T, N, H]
  """Pallas flash attention (differentiable); same semantics as :func:`attention_reference`.

  Args:
    q, k, v: ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, H]``; float32 or bfloat16.
    segment_ids: ``[B, T]`` or ``(q_ids [B, T], kv_ids [B, S])``, 0 = padding.
    positions: ``[B, T]`` or a ``(q_pos, kv_pos)`` pair; default ``arange``.
    causal, sm_scale, softcap, window: see :func:`attention_reference`.
    block_sizes: a :class:`BlockSizes`, a dict of its fields, or ``None``.
    backend: ``"triton"`` (GPU) or ``"tpu"`` (Mosaic).
    interpret: run the kernels in Pallas interpret mode (CPU); for ``"tpu"`` also an
      ``pltpu.InterpretParams``.

  Returns:
    ``[B, T, N, H]`` in ``q.dtype``.
  """
  cfg, arrays, t = prepare(backend, q, k, v, segment_ids, positions, causal=causal,
                           sm_scale=sm_scale, softcap=softcap, window=window,
                           block_sizes=block_sizes, interpret=interpret)
  return _flash(backend, cfg, *arrays)[:, :t]


def visited_tile_counts(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids,
    positions=None,
    causal: bool = True,
    window: int | None = None,
    block_sizes=None,
    backend: str = "triton",
    interpret=False,
) -> jax.Array:  # [B, K, T / block_q] int32
  """Debug: run the forward kernel and return the key tiles each program actually computed.

  The count is accumulated inside the kernel's loops (not derived from the metadata), so tests can
  check block skipping end to end.
  """
  cfg, arrays, _ = prepare(backend, q, k, v, segment_ids, positions, causal=causal, sm_scale=None,
                           softcap=None, window=window, block_sizes=block_sizes,
                           interpret=interpret, debug=True)
  return _backend(backend).forward(cfg, *arrays)[2]


def tiles(backend: str, *, t: int, s: int, head_dim: int, group: int, block_sizes=None):
  """The resolved :class:`BlockSizes` a backend uses for these shapes."""
  return _backend(backend).resolve_blocks(_common.as_block_sizes(block_sizes), t=t, s=s,
                                          head_dim=head_dim, group=group)

