"""Token-budget micro-batching of variable-length sequences (AReaL dynamic batching, Algorithm 1).

A micro-batch is ``R`` packed rows of ``T`` tokens (budget ``R·T``). Sequences are placed longest
first; each goes to the micro-batch with the *fewest* tokens that still has a row it fits in (the
fullest such row: best fit), and a new micro-batch is opened only when none has room. Long and short
responses share rows, so little of the budget is padding, and the micro-batches carry balanced token
counts, which minimises the number of forward/backward passes under a fixed memory bound.

Rows hold whole sequences back to back with ``segment_ids`` 1, 2, ... (0 = padding) and ``positions``
restarting at 0, so attention never crosses sequences. Loss normalisers are computed on the whole
mini-batch (``prepare`` of :func:`jaxrl.train.make_train_step`), never per micro-batch, so the
gradient does not depend on the packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl import models, sharding

FLOAT_KEYS = ("loss_mask", "advantages", "sampler_logprobs")
OPTIONAL_FLOAT_KEYS = ("teacher_logprobs",)  # distill.server's teacher log-probs (jaxrl.rl.sequence_fields)
IMAGE_KEYS = ("pixel_values", "grid_thw")  # per sample, not per token: packed per row by _pack_images


def assign_micro_batches(lengths: Sequence[int], *, row_len: int, rows: int) -> list[list[list[int]]]:
  """Places sequences into micro-batches of ``rows`` rows of ``row_len`` tokens.

  Args:
    lengths: tokens of each sequence, each in ``[1, row_len]``.
    row_len: row capacity ``T``.
    rows: rows per micro-batch ``R``.

  Returns:
    ``micro_batches[m][r]`` = sequence indices in row ``r`` of micro-batch ``m``, in placement order.

  References: Fu et al. 2025, "AReaL", Algorithm 1 (seeds 000 "AReaL", dynamic batching).
  """
  lengths = [int(x) for x in lengths]
  bad = [x for x in lengths if not 1 <= x <= row_len]
  if bad:
    raise ValueError(f"sequence lengths must be in [1, row_len={row_len}], got {bad[:5]}")
  if rows < 1:
    raise ValueError(f"rows must be >= 1, got {rows}")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  micro: list[list[list[int]]] = []
  fill: list[list[int]] = []  # tokens per row
  total: list[int] = []  # tokens per micro-batch
  for i in order:
    n = lengths[i]
    best = None
    for m in sorted(range(len(micro)), key=lambda m: (total[m], m)):
      free = [r for r in range(rows) if fill[m][r] + n <= row_len]
      if free:
        best = (m, max(free, key=lambda r: (fill[m][r], -r)))
        break
    if best is None:
      micro.append([[] for _ in range(rows)])
      fill.append([0] * rows)
      total.append(0)
      best = (len(micro) - 1, 0)
    m, r = best
    micro[m][r].append(i)
    fill[m][r] += n
    total[m] += n
  return micro


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """One mini-batch as ``[M, R, T]`` arrays (``M`` micro-batches after bucketing)."""

  arrays: dict[str, np.ndarray]
  num_micro: int  # micro-batches with sequences (before bucketing)
  tokens: int  # real tokens
  assignment: list[list[list[int]]]

  @property
  def shape(self) -> tuple[int, int, int]:
    return self.arrays["tokens"].shape

  @property
  def efficiency(self) -> float:
    return self.tokens / float(np.prod(self.shape))

  def micro_batch(self, m: int) -> dict[str, np.ndarray]:
    return {k: v[m] for k, v in self.arrays.items()}

  def interleaved(self) -> dict[str, np.ndarray]:
    """``[R·M, T]`` with row ``r·M + m`` = row ``r`` of micro-batch ``m``.

    :func:`jaxrl.train.split_micro_batches` takes rows ``m, m+M, ...`` as micro-batch ``m``, so this
    layout gives back exactly the packed micro-batches.
    """
    return {k: np.ascontiguousarray(np.swapaxes(v, 0, 1)).reshape(-1, *v.shape[2:])
            for k, v in self.arrays.items()}


def _bucket(m: int, mode: str) -> int:
  if mode == "exact":
    return m
  return 1 << (m - 1).bit_length()


def _row_patch_bucket(patches: int, merge: int) -> int:
  """Per-row patch bucket: the power of two ``>= patches`` (at least ``4·m²``), a multiple of ``m²`` (as the
  sampler's ``jaxrl.sampling`` patch bucket, so few distinct shapes compile)."""
  m2 = merge * merge
  b = 1 << (max(int(patches), 4 * m2) - 1).bit_length()
  return -(-b // m2) * m2


def _pack_images(seqs, assignment, arrays: dict[str, np.ndarray], vision) -> None:
  """Adds ``pixel_values [M, R, P, patch_dim]`` (each row's samples' patches in row order, zero-padded to the
  per-row bucket ``P``) and the :data:`jaxrl.models.VISION_LAYOUT_KEYS` arrays ``[M, R, ...]`` of each row
  (:func:`jaxrl.models.batch_vision_inputs`), as ``jaxrl.data.stack_vl_rows(per_row=True)`` lays them out."""
  m, rows = arrays["tokens"].shape[:2]
  per_row = [[seqs[i] for i in row if "pixel_values" in seqs[i]] for micro in assignment for row in micro]
  per_row += [[]] * (m * rows - len(per_row))  # bucketing micro-batches: no images
  counts = [sum(len(s["pixel_values"]) for s in row) for row in per_row]
  pixels = np.zeros((m * rows, _row_patch_bucket(max(counts), vision.spatial_merge_size), vision.patch_dim),
                    np.float32)
  grids, image_rows = [], []
  for r, row in enumerate(per_row):
    o = 0
    for s in row:
      p = np.asarray(s["pixel_values"], np.float32)
      pixels[r, o:o + len(p)] = p
      o += len(p)
      g = np.asarray(s["grid_thw"], np.int32).reshape(-1, 3)
      grids.append(g)
      image_rows += [r] * len(g)
  grid_thw = np.concatenate(grids) if grids else np.zeros((0, 3), np.int32)
  inputs = models.batch_vision_inputs(pixels, grid_thw, np.asarray(image_rows, np.int32), vision)
  arrays["pixel_values"] = pixels.reshape(m, rows, *pixels.shape[1:])
  for k in models.VISION_LAYOUT_KEYS:
    v = np.asarray(getattr(inputs.layout, k))
    arrays[k] = v.reshape(m, rows, *v.shape[1:])


def pack_sequences(seqs: Sequence[dict[str, np.ndarray]], *, row_len: int, rows: int,
                   bucket: str = "pow2", vision=None) -> PackedBatch:
  """Packs per-sequence arrays (``tokens``, ``targets``, ``loss_mask``, ...) into micro-batches.

  Adds ``positions``, ``segment_ids`` and ``mb_index`` (``[M, R]``: the micro-batch of each row).
  Micro-batches added by bucketing are all padding (zero loss mask).

  A VLM rollout's samples (:func:`jaxrl.rl.sequence_fields`) carry ``rope_positions [n, 3]`` (packed as
  ``[M, R, T, 3]``, TAKEN from the samples: never recomputed over prompt + response), ``image_token_mask [n]``
  (the prompt's tokens: only there do image embeddings replace ``<|image_pad|>``; a sampled one is text, as
  the sampler embeds it) and, for an image prompt, ``pixel_values``/``grid_thw``, packed per row with
  ``vision`` (the policy's ``VisionConfig``) by :func:`_pack_images`.
  """
  lengths = [len(s["tokens"]) for s in seqs]
  assignment = assign_micro_batches(lengths, row_len=row_len, rows=rows)
  m_real = max(len(assignment), 1)
  m = _bucket(m_real, bucket)
  keys = [k for k in seqs[0] if k not in IMAGE_KEYS] if seqs else ["tokens", "targets", *FLOAT_KEYS, "group_ids"]
  missing = sorted({k for s in seqs for k in keys if k not in s} | {k for s in seqs for k in s
                                                                    if k not in keys and k not in IMAGE_KEYS})
  if missing:
    raise ValueError(f"pack_sequences: samples disagree on the keys {missing} (a VLM rollout gives every sample "
                     "rope_positions and image_token_mask)")
  with_images = any("pixel_values" in s for s in seqs)
  if with_images and vision is None:
    raise ValueError("pack_sequences: samples carry pixel_values but no vision config was given (pass the "
                     "policy's model config .vision)")
  arrays = {k: np.zeros((m, rows, row_len, *np.shape(seqs[0][k])[1:]) if seqs else (m, rows, row_len),
                        np.float32 if k in FLOAT_KEYS + OPTIONAL_FLOAT_KEYS else np.int32) for k in keys}
  arrays["positions"] = np.zeros((m, rows, row_len), np.int32)
  arrays["segment_ids"] = np.zeros((m, rows, row_len), np.int32)
  for mi, micro in enumerate(assignment):
    for r, row in enumerate(micro):
      o = 0
      for seg, i in enumerate(row, start=1):
        n = lengths[i]
        for k in keys:
          arrays[k][mi, r, o:o + n] = seqs[i][k]
        arrays["positions"][mi, r, o:o + n] = np.arange(n)
        arrays["segment_ids"][mi, r, o:o + n] = seg
        o += n
  arrays["mb_index"] = np.broadcast_to(np.arange(m, dtype=np.int32)[:, None], (m, rows)).copy()
  if with_images:
    _pack_images(seqs, assignment, arrays, vision)
  return PackedBatch(arrays=arrays, num_micro=len(assignment), tokens=int(sum(lengths)), assignment=assignment)


def loss_column_capacity(most: int, row_len: int) -> int:
  """``K``, the per-row loss-column capacity for a batch whose fullest row has ``most`` loss tokens: ``most``
  rounded up to a granule of ``row_len / 8`` (a multiple of 8), so a run compiles at most 8 widths; ``row_len``
  when that is no narrower (the head then runs on every column, as without the gather)."""
  granule = max(8, -(-row_len // 64) * 8)
  return min(row_len, -(-max(int(most), 1) // granule) * granule)


def with_loss_columns(pb: PackedBatch, width: int) -> PackedBatch:
  """``pb`` with ``loss_columns [M, R, width]``: each row's loss positions (``loss_mask > 0``) in order, padded
  with ``row_len`` (out of range: dropped where :func:`jaxrl.rl._loss.head_logprobs` scatters the head's output
  back).

  The log-prob head (the ``[D, V]`` unembedding, float32 softmax) then runs on ``width`` columns per row, not on
  every packed position: a prompt's tokens are never scored (TRL's ``logits_to_keep``). Every process must pass
  the same ``width`` (:func:`loss_column_capacity` of the largest count over processes)."""
  mask = pb.arrays["loss_mask"] > 0  # [M, R, T]
  most = int(mask.sum(-1).max(initial=0))
  if most > width:
    raise ValueError(f"with_loss_columns: a row has {most} loss tokens, more than width={width}")
  row_len = mask.shape[-1]
  # A stable argsort of "not a loss position" puts each row's loss columns first, in order.
  cols = np.argsort(~mask, axis=-1, kind="stable")[..., :width].astype(np.int32)
  cols[np.arange(width) >= mask.sum(-1, keepdims=True)] = row_len
  return dataclasses.replace(pb, arrays={**pb.arrays, "loss_columns": cols})


def agree_patch_bucket(pb: PackedBatch, vision) -> PackedBatch:
  """``pb`` with its per-row patch bucket ``P`` raised to the largest over processes.

  Each process packs its own groups, so its own bucket (:func:`_row_patch_bucket` of its fullest row), or no
  image arrays at all when its samples have no images; the global batch needs one set of arrays of one shape
  on every process. Padding is exact (:func:`jaxrl.models.pad_patch_rows`); a process without images gets
  all-padding rows (:func:`jaxrl.models.batch_vision_inputs` of no images: segment 0, zero tower output).
  Every process must call this for the same mini-batches (it gathers one scalar). No-op for a text model.
  """
  if vision is None:
    return pb
  have = pb.arrays["pixel_values"].shape[2] if "pixel_values" in pb.arrays else 0
  want = int(sharding.allgather_scalar(have).max())
  if want == 0:
    return pb
  arrays = dict(pb.arrays)
  if not have:
    m, rows = arrays["tokens"].shape[:2]
    pixels = np.zeros((m * rows, want, vision.patch_dim), np.float32)
    inputs = models.batch_vision_inputs(pixels, np.zeros((0, 3), np.int32), np.zeros((0,), np.int32), vision)
    arrays["pixel_values"] = pixels.reshape(m, rows, want, vision.patch_dim)
    for k in models.VISION_LAYOUT_KEYS:
      v = np.asarray(getattr(inputs.layout, k))
      arrays[k] = v.reshape(m, rows, *v.shape[1:])
  return dataclasses.replace(pb, arrays=models.pad_patch_rows(arrays, want, vision.spatial_merge_size))


def pad_micro_batches(pb: PackedBatch, m: int) -> PackedBatch:
  """``pb`` with all-padding micro-batches appended up to ``m`` (processes agree on one count)."""
  have = pb.shape[0]
  if m < have:
    raise ValueError(f"cannot pad {have} micro-batches down to {m}")
  if m == have:
    return pb
  arrays = {k: np.concatenate([v, np.zeros((m - have, *v.shape[1:]), v.dtype)]) for k, v in pb.arrays.items()}
  idx = arrays["mb_index"]
  idx[have:] = np.arange(have, m, dtype=np.int32).reshape(-1, *([1] * (idx.ndim - 1)))
  return dataclasses.replace(pb, arrays=arrays)
