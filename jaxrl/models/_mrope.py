"""Rotary position embeddings: plain and Llama-3-scaled RoPE, and Qwen2-VL / Qwen2.5-VL's M-RoPE.

A VLM keeps two kinds of position per token. The 1-D ``positions`` (the token's index in its sequence)
drive causality and the KV cache exactly as for a text model. Beside them, ``rope_positions [B, T, 3]``
(temporal, height, width) are what the rotary embedding rotates by: a text token has the same value on
all three axes; the ``t·h·w / m²`` tokens of an image get ``start + (frame, row, column)`` of its merged
grid; text after an image resumes at ``start + max(h, w) / m`` (``m`` = spatial merge size), so rotary
positions are not in token order and can run behind the 1-D ones.

Decoding continues a sequence with a per-sequence offset: a token appended at 1-D position ``p`` gets
rotary position ``p + delta`` on all three axes, ``delta = max(rotary positions) + 1 - length``.

:func:`mrope_positions` computes the 3-D positions on the host (numpy); :func:`apply_rope` rotates by
1-D positions or, for M-RoPE, by 3-D ones, each rotary frequency taking the axis ``mrope_section`` gives it.

Reference: transformers 5 ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen2VLModel.get_rope_index`` (images;
still images have one frame, so Qwen2.5-VL's ``second_per_grid_ts`` does not enter) and
``Qwen2_5_VLRotaryEmbedding.recomposition_frequencies``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models._config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:  # [H / 2] float32
  """RoPE inverse frequencies ``ω_i = θ^(-2i/H)``, with Llama-3 scaling when configured.

  Llama-3 scaling (``L`` = original context, ``λ_i = 2π/ω_i``): ``ω_i / factor`` when
  ``λ_i > L / low_freq_factor``; ``ω_i`` when ``λ_i < L / high_freq_factor``; in between
  ``(1 - s)·ω_i/factor + s·ω_i`` with ``s = (L/λ_i - low_freq_factor) / (high_freq_factor -
  low_freq_factor)`` (Meta's Llama 3.1 reference; HF ``_compute_llama3_parameters``).

  Returns:
    float32 numpy array of ``head_dim // 2`` frequencies (a compile-time constant).
  """
  h = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  rs = cfg.rope_scaling
  if rs is not None:
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def mrope_axes(mrope_section: tuple[int, int, int]) -> np.ndarray:  # [H / 2] int32
  """The position axis (0 temporal, 1 height, 2 width) each rotary frequency takes under M-RoPE: the
  first ``mrope_section[0]`` frequencies the temporal one, the next ``mrope_section[1]`` the height, the
  rest the width (HF ``recomposition_frequencies``)."""
  return np.repeat(np.arange(3, dtype=np.int32), mrope_section)


def apply_rope(
    x: jax.Array,  # [B, T, N, H]
    positions: jax.Array,  # [B, T] int, or [B, T, 3] int (M-RoPE)
    inv_freq: np.ndarray,  # [H / 2]
    axes: np.ndarray | None = None,  # [H / 2] int, with [B, T, 3] positions
) -> jax.Array:  # [B, T, N, H]
  """Rotary embedding in the rotate-half convention, computed in float32.

  ``x' = x·cos(pω) + rotate_half(x)·sin(pω)`` with ``rotate_half([x1, x2]) = [-x2, x1]`` over the
  two halves of the head dim and ``ω`` repeated for both halves (Su et al. 2021, RoFormer; HF
  ``apply_rotary_pos_emb``). With 3-D ``positions`` (M-RoPE) frequency ``i`` rotates by
  ``p[axes[i]]`` (:func:`mrope_axes`; Qwen2-VL, Wang et al. 2024).
  """
  if positions.ndim == 3:
    if axes is None or positions.shape[-1] != 3:
      raise ValueError(f"apply_rope: 3-D positions {positions.shape} need [B, T, 3] and the M-RoPE axes")
    picked = jnp.take(positions, jnp.asarray(axes), axis=-1)  # [B, T, H/2]
    angles = picked.astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, H/2]
  else:
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def mrope_positions(
    tokens: np.ndarray,  # [B, T] int
    segment_ids: np.ndarray,  # [B, T] int, 0 = padding
    grid_thw: np.ndarray,  # [I, 3] int
    cfg: ModelConfig,
) -> tuple[np.ndarray, np.ndarray]:  # rope_positions [B, T, 3] int32, rope_deltas [B, T] int32
  """3-D rotary positions and decode deltas of packed rows holding images.

  Each segment (a run of one non-zero id in a row; padding anywhere) is one sequence, positioned from 0
  as ``get_rope_index`` positions an unpadded prompt: text tokens count up by one on all axes; each
  image's ``t·h·w / m²`` placeholder tokens (``cfg.image_token_id``) get ``start + (i_t, i_h, i_w)``
  over its merged grid ``(t, h / m, w / m)`` in row-major order; the text after it resumes at
  ``start + max(h, w) / m``. Images are taken from ``grid_thw`` in row-major token order over ``[B, T]``;
  consecutive images may touch (each takes its own token count).

  Args:
    tokens: token ids ``[B, T]``.
    segment_ids: sequence id per token ``[B, T]`` (0 = padding); a sequence's tokens need not be adjacent
      (left padding), but an image must not straddle two sequences.
    grid_thw: ``[I, 3]`` (frames, patch rows, patch columns) of every image in the batch, in token order.
    cfg: a VLM config (``image_token_id``, ``video_token_id``, ``vision.spatial_merge_size``).

  Returns:
    ``rope_positions [B, T, 3]`` (0 at padding) and ``rope_deltas [B, T]``: for each token,
    ``max(rope positions of its sequence) + 1 - (its sequence's length)`` (0 at padding).

  Raises:
    ValueError: not a VLM config, a video token, image token counts that disagree with ``grid_thw``,
      an image split across sequences, or images left over.
  """
  if cfg.vision is None or cfg.image_token_id is None:
    raise ValueError(f"mrope_positions: model_type {cfg.model_type!r} has no vision config / image_token_id")
  tokens, segment_ids = np.asarray(tokens), np.asarray(segment_ids)
  grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
  if tokens.ndim != 2 or segment_ids.shape != tokens.shape:
    raise ValueError(f"mrope_positions: tokens and segment_ids must both be [B, T]; got {tokens.shape}, "
                     f"{segment_ids.shape}")
  merge = cfg.vision.spatial_merge_size
  if (grid_thw < 1).any() or (grid_thw[:, 1:] % merge).any():
    raise ValueError(f"mrope_positions: grid_thw rows must be positive with h, w divisible by the merge size "
                     f"{merge}; got {grid_thw.tolist()}")
  if cfg.video_token_id is not None and (tokens[segment_ids > 0] == cfg.video_token_id).any():
    raise ValueError(f"mrope_positions: video tokens (id {cfg.video_token_id}) are not supported, only images")
  b, t = tokens.shape
  rope = np.zeros((b, t, 3), np.int32)
  deltas = np.zeros((b, t), np.int32)
  image = 0
  for row in range(b):
    for seg in _segments(segment_ids[row]):
      where = np.flatnonzero(segment_ids[row] == seg)
      pos, image = _sequence_positions(tokens[row, where], grid_thw, image, merge, cfg.image_token_id,
                                       where=f"row {row}, segment {seg}")
      rope[row, where] = pos
      deltas[row, where] = pos.max() + 1 - len(where)
  if image != len(grid_thw):
    raise ValueError(f"mrope_positions: grid_thw has {len(grid_thw)} images but the tokens hold image "
                     f"placeholders for {image}")
  return rope, deltas


def _segments(seg_row: np.ndarray) -> list[int]:
  """Non-zero segment ids of a row in order of first appearance."""
  ids, first = np.unique(seg_row, return_index=True)
  return [int(s) for s in ids[np.argsort(first)] if s != 0]


def _sequence_positions(tokens: np.ndarray, grid_thw: np.ndarray, image: int, merge: int, image_token: int, *,
                        where: str) -> tuple[np.ndarray, int]:  # [n, 3], next image index
  """``get_rope_index`` on one unpadded sequence, taking images from ``grid_thw[image:]``."""
  n = len(tokens)
  out = np.zeros((n, 3), np.int64)
  is_image = tokens == image_token
  i, current = 0, 0
  while i < n:
    if not is_image[i]:
      j = i
      while j < n and not is_image[j]:
        j += 1
      out[i:j] = (current + np.arange(j - i))[:, None]
      current += j - i
      i = j
      continue
    if image >= len(grid_thw):
      raise ValueError(f"mrope_positions: {where}: an image placeholder at token {i} but grid_thw has only "
                       f"{len(grid_thw)} images")
    gt, gh, gw = (int(x) for x in grid_thw[image])
    gh, gw = gh // merge, gw // merge
    count = gt * gh * gw
    if i + count > n or not is_image[i:i + count].all():
      run = int(np.argmin(np.append(is_image[i:], False)))
      raise ValueError(f"mrope_positions: {where}: image {image} (grid_thw {grid_thw[image].tolist()}) needs "
                       f"{count} placeholder tokens from token {i}, found a run of {run} (an image split "
                       "across sequences, truncated, or grid_thw out of token order)")
    ft, fh, fw = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
    out[i:i + count] = current + np.stack([ft, fh, fw], -1).reshape(count, 3)
    current += max(gh, gw)
    i += count
    image += 1
  return out.astype(np.int32), image


def decode_rope_positions(positions, rope_deltas):  # [B, T], [B] or [B, T] -> [B, T, 3]
  """Rotary positions of tokens appended to their sequences: ``(positions + delta)`` on all three axes.

  ``positions`` are the tokens' 1-D positions (e.g. the cache length of their row); ``rope_deltas`` the
  sequence's delta from :func:`mrope_positions` (``[B]`` per row, or ``[B, T]`` per token). Works on numpy
  and JAX arrays alike (the samplers' decode step calls it inside jit).
  """
  deltas = rope_deltas if rope_deltas.ndim == positions.ndim else rope_deltas[:, None]
  p = positions + deltas
  return p[..., None].repeat(3, axis=-1)
