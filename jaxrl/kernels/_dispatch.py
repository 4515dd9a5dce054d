"""One entry point per attention kind, dispatching to an implementation by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl import _compile_target
from jaxrl.kernels import _decode, _flash
from jaxrl.kernels._common import normalise_ids
from jaxrl.kernels._reference import attention_reference, make_mask

IMPLS = ("auto", "reference", "pallas_triton", "pallas_tpu", "pallas_mosaic_gpu", "cudnn")
DECODE_IMPLS = ("auto", "reference", "pallas_triton", "pallas_tpu")


def auto_impl() -> str:
  """The kernel ``impl="auto"`` runs on the platform compiled for (:func:`jaxrl._compile_target.compile_platform`:
  a plan's target, else this process's backend): Pallas TPU on TPU, Pallas Triton on GPU, else the reference."""
  platform = _compile_target.compile_platform()
  if platform == "tpu":
    return "pallas_tpu"
  if platform == "gpu":
    return "pallas_triton"
  return "reference"


def resolve_impl(impl: str) -> str:
  """The implementation :func:`attention` runs for ``impl`` on the platform compiled for (``"auto"`` resolved)."""
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
  return auto_impl() if impl == "auto" else impl


def _unavailable(impl: str):
  raise NotImplementedError(
      f"attention impl {impl!r} is not built in jaxrl.kernels; use 'pallas_triton' on GPU "
      "(or 'cudnn', 'reference')")


def _cudnn(q, k, v, segment_ids, positions, *, causal, sm_scale, softcap, window):
  """cuDNN flash attention via ``jax.nn.dot_product_attention`` with a dense ``[B, T, S]`` mask."""
  if softcap is not None:
    raise ValueError("impl='cudnn' cannot express a logit soft-cap; use 'pallas_triton'")
  if jax.default_backend() not in ("gpu", "cuda"):
    raise RuntimeError(f"impl='cudnn' needs an NVIDIA GPU backend, not {jax.default_backend()!r}")
  b, t, _, _ = q.shape
  q_seg, kv_seg, q_pos, kv_pos = normalise_ids(segment_ids, positions, b, t, k.shape[1])
  mask = make_mask(q_seg, kv_seg, q_pos, kv_pos, causal=causal, window=window)  # [B, T, S]
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=sm_scale,
                                     implementation="cudnn")
  # A padding query sees no key; cuDNN would average all values, the contract says 0.
  return jnp.where((q_seg != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def attention(
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
    impl: str = "auto",
    interpret=False,
) -> jax.Array:  # [B, T, N, H]
  """Packed-sequence attention; see :func:`attention_reference` for the exact semantics.

  ``out[b, t, n] = Σ_s softmax_s(mask · cap(q·k·scale)) v[b, s, n // G]`` where ``mask`` keeps same
  non-zero segment, causal and windowed pairs (by position); a padding query (segment 0) gets 0.

  Args:
    q: queries ``[B, T, N, H]``; ``N`` a multiple of the kv heads ``K`` (GQA/MQA).
    k, v: keys and values ``[B, S, K, H]``.
    segment_ids: ``[B, T]`` int (0 = padding), or a ``(q_ids [B, T], kv_ids [B, S])`` pair.
    positions: ``[B, T]`` int or a ``(q_pos, kv_pos)`` pair; causality and windows use these.
    causal: mask keys at later positions.
    sm_scale: logit scale, default ``H ** -0.5``.
    softcap: if set, logits become ``softcap * tanh(logits / softcap)``.
    window: if set, a key is visible only when ``pos_q - pos_k < window`` (and, non-causal,
      ``pos_k - pos_q < window``).
    block_sizes: kernel tiling, a :class:`BlockSizes` or a dict of its fields (Pallas only).
    impl: ``"auto"`` (Pallas TPU on TPU, Pallas Triton on GPU, reference on CPU) or one of
      :data:`IMPLS`. ``"cudnn"`` uses ``jax.nn.dot_product_attention`` with a dense mask and rejects
      ``softcap``; ``"pallas_mosaic_gpu"`` is not built and raises.
    interpret: run Pallas kernels in interpret mode (CPU); for ``"pallas_tpu"`` ``True`` means
      ``pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")``, or pass your own.

  Returns:
    ``[B, T, N, H]`` in ``q.dtype``.
  """
  impl = resolve_impl(impl)
  kw = dict(segment_ids=segment_ids, positions=positions, causal=causal, sm_scale=sm_scale,
            softcap=softcap, window=window)
  if impl == "reference":
    return attention_reference(q, k, v, **kw)
  if impl == "pallas_triton":
    return _flash.flash_attention(q, k, v, **kw, block_sizes=block_sizes, backend="triton",
                                  interpret=interpret)
  if impl == "pallas_tpu":
    return _flash.flash_attention(q, k, v, **kw, block_sizes=block_sizes, backend="tpu",
                                  interpret=interpret)
  if impl == "cudnn":
    return _cudnn(q, k, v, segment_ids, positions, causal=causal, sm_scale=sm_scale,
                  softcap=softcap, window=window)
  _unavailable(impl)


def decode_attention(
    q: jax.Array,  # [B, N, H]
    k_cache: jax.Array,  # [B, S, K, H]
    v_cache: jax.Array,  # [B, S, K, H]
    lengths: jax.Array,  # [B] int
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    impl: str = "auto",
    interpret=False,
) -> jax.Array:  # [B, N, H]
  """One query token per row against its first ``lengths[b]`` cache entries (ragged batch).

  Equivalent to :func:`attention` with ``segment_ids=(q_ids, kv_ids)``, ``q_ids = [lengths > 0]``,
  ``kv_ids[b, s] = s < lengths[b]`` and the query at position ``lengths[b] - 1``.

  Args:
    q: ``[B, N, H]``, the new token's queries; ``N`` a multiple of ``K``.
    k_cache, v_cache: ``[B, S, K, H]``.
    lengths: ``[B]`` valid cache entries per row (including the new token's key).
    sm_scale, softcap, window: as in :func:`attention`.
    impl: ``"auto"`` or one of :data:`DECODE_IMPLS`.
    interpret: Pallas interpret mode (CPU).

  Returns:
    ``[B, N, H]`` in ``q.dtype``; 0 for rows with ``lengths == 0``.
  """
  if impl not in DECODE_IMPLS:
    raise ValueError(f"unknown decode impl {impl!r}; choose one of {DECODE_IMPLS}")
  if impl == "auto":
    impl = auto_impl()
  kw = dict(sm_scale=sm_scale, softcap=softcap, window=window)
  if impl == "reference":
    return _decode.decode_attention_reference(q, k_cache, v_cache, lengths, **kw)
  if impl == "pallas_triton":
    return _decode.decode_attention_triton(q, k_cache, v_cache, lengths, **kw, interpret=interpret)
  return _decode.decode_attention_tpu(q, k_cache, v_cache, lengths, **kw, interpret=interpret)
