"""Packing of multimodal samples: rows of whole samples, each row carrying its images' patches.

Token arrays are packed exactly as for text (:func:`jaxrl.data.pack_samples`: targets, positions, segment ids,
loss masks, turn ids). Beside them a row carries the patches of its images (``pixel_values [P_r, patch_dim]``)
and their grids (``grid_thw [I_r, 3]``) in token order. A batch concatenates its rows' patches in row-major
token order and pads them with zero rows to a fixed bucket, ``num_patches``, so the vision tower's jitted shape
is fixed per bucket; ``image_rows`` says which row each image is in. With ``VisionPackingConfig.per_row`` the
patches stay per row instead, ``[R, num_patches, patch_dim]``, so they shard and split into micro-batches with
the token rows. With a model config the batch also holds
the M-RoPE ``rope_positions [R, T, 3]`` and ``rope_deltas [R, T]`` (:func:`jaxrl.models.mrope_positions`).

A sample that holds images is never truncated (image tokens and patches would disagree): longer than
``seq_len`` it is dropped, and so is one whose patches exceed a row's share of a fixed ``num_patches``; both are
counted, with the first few source indices, for the skip report (:func:`vl_skip_report`). Text-only samples
follow ``PackingConfig.overlong`` as in text packing. Text-only and image samples mix freely in rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from jaxrl.data._images import ImageConfig
from jaxrl.data._packing import PackedBatch, PackingConfig, assign_rows, fit_sample, pack_samples, stack_rows
from jaxrl.data._skips import MAX_EXAMPLES, SkipReport
from jaxrl.data._vl_chat import encode_vl_record
from jaxrl.models import VISION_LAYOUT_KEYS, batch_vision_inputs, mrope_positions


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionPackingConfig:
  """How a batch's image patches are laid out."""

  num_patches: int | None = None
  "Patches per batch (per row with ``per_row``), fixed (a recipe's compiled shape); a row then holds at most "
  "``num_patches // rows`` (``num_patches``). None: the smallest ``min_patches * 2**k`` that holds the batch's "
  "patches (the fullest row's)."
  min_patches: int = 256
  "Smallest bucket when ``num_patches`` is None."
  merge_size: int = 2
  "The vision tower's spatial merge (buckets are multiples of ``merge_size**2``)."
  patch_dim: int = 1176
  "Values per patch (``3 * temporal_patch_size * patch_size**2``)."
  per_row: bool = False
  "Lay patches out per row, ``pixel_values [R, num_patches, patch_dim]`` (each row's own images, zero-padded), "
  "so they shard over data-parallel rows and split into micro-batches with the tokens; else one patch sequence "
  "for the batch, ``[num_patches, patch_dim]``."

  def row_cap(self, num_rows: int) -> int | None:
    """Most patches one row may hold in a batch of ``num_rows`` rows (None: unbounded)."""
    if self.num_patches is None:
      return None
    return self.num_patches if self.per_row else self.num_patches // num_rows

  def __post_init__(self):
    unit = self.merge_size ** 2
    for key in ("num_patches", "min_patches"):
      value = getattr(self, key)
      if value is not None and (value < unit or value % unit):
        raise ValueError(f"{key} must be a positive multiple of merge_size**2={unit}, got {value!r}")
    if self.patch_dim < 1:
      raise ValueError(f"patch_dim must be >= 1, got {self.patch_dim!r}")

  def bucket(self, patches: int) -> int:
    """Patch rows of a batch holding ``patches`` real patches."""
    if self.num_patches is not None:
      if patches > self.num_patches:
        raise ValueError(f"a batch holds {patches} image patches, more than num_patches={self.num_patches}")
      return self.num_patches
    size = self.min_patches
    while size < patches:
      size *= 2
    return size


def _num_patches(sample: dict[str, Any]) -> int:
  grids = sample.get("grid_thw")
  return 0 if grids is None else int(np.prod(np.asarray(grids).reshape(-1, 3), axis=1).sum())


def fit_vl_sample(sample: dict[str, Any], seq_len: int, *, overlong: str, max_row_patches: int | None = None):
  """The overlong policy with images: ``(sample or None, status)``.

  ``status``: ``"ok"``, ``"truncated"``/``"dropped"`` as :func:`jaxrl.data.fit_sample` (text-only samples, or
  nothing left to train), ``"image_overlong"`` (holds images and is longer than ``seq_len``: never truncated),
  or ``"image_patches"`` (more patches than ``max_row_patches``).
  """
  has_images = len(sample.get("grid_thw", ())) > 0
  if has_images and len(sample["tokens"]) > seq_len:
    return None, "image_overlong"
  if max_row_patches is not None and _num_patches(sample) > max_row_patches:
    return None, "image_patches"
  return fit_sample(sample, seq_len, overlong=overlong)


def assign_vl_rows(lengths: Sequence[int], patches: Sequence[int], seq_len: int, *, method: str,
                   max_row_patches: int | None = None) -> list[list[int]]:
  """:func:`jaxrl.data.assign_rows` with a second capacity: at most ``max_row_patches`` patches per row.

  Without a patch cap this is ``assign_rows``. With one, ``best_fit`` puts each sample (in arrival order) in
  the open row with the fewest free tokens that has room for both its tokens and its patches,
  ``first_fit_decreasing`` sorts by length and takes the first such row, ``none`` is one sample per row.
  """
  if max_row_patches is None or method == "none":
    return assign_rows(lengths, seq_len, method=method)
  lengths, patches = np.asarray(lengths, np.int64), np.asarray(patches, np.int64)
  if patches.size and patches.max() > max_row_patches:
    raise ValueError(f"sample patches must be <= max_row_patches={max_row_patches}, got {patches.max()}")
  order = (sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if method == "first_fit_decreasing"
           else range(len(lengths)))
  free_t = np.zeros(len(lengths), np.int64)
  free_p = np.zeros(len(lengths), np.int64)
  rows: list[list[int]] = []
  for i in order:
    n = len(rows)
    fits = (free_t[:n] >= lengths[i]) & (free_p[:n] >= patches[i])
    if not fits.any():
      rows.append([])
      r = n
      free_t[r], free_p[r] = seq_len, max_row_patches
    elif method == "best_fit":
      r = int(np.argmin(np.where(fits, free_t[:n], seq_len + 1)))
    else:
      r = int(np.argmax(fits))
    rows[r].append(i)
    free_t[r] -= lengths[i]
    free_p[r] -= patches[i]
  return rows


def pack_vl_samples(samples: Sequence[dict[str, Any]], seq_len: int, *, method: str, pad_id: int = 0,
                    max_row_patches: int | None = None, patch_dim: int = 1176) -> list[dict[str, Any]]:
  """Packs samples (each fitting a row) into rows; each row's token arrays come from
  :func:`jaxrl.data.pack_samples` over its members.

  Args:
    samples: dicts from :func:`jaxrl.data.encode_vl_record` (``tokens``, ``loss_mask``, ``turn_id``, and
      ``pixel_values``/``grid_thw``; text samples may lack the last two).

  Returns:
    One dict per row: the :data:`jaxrl.data.ROW_KEYS` arrays [seq_len], ``num_samples``, ``num_turns``,
    ``pixel_values`` [P_r, patch_dim] float32 and ``grid_thw`` [I_r, 3] int32 (the members' images in order).
  """
  groups = assign_vl_rows([len(s["tokens"]) for s in samples], [_num_patches(s) for s in samples], seq_len,
                          method=method, max_row_patches=max_row_patches)
  rows = []
  for members in groups:
    group = [samples[i] for i in members]
    packed = pack_samples(group, seq_len, method="best_fit", pad_id=pad_id)  # members fit: one row, in order
    assert len(packed["tokens"]) == 1, len(packed["tokens"])
    row = {k: v[0] for k, v in packed.items()}
    pixels = [np.asarray(s["pixel_values"], np.float32) for s in group if len(s.get("grid_thw", ()))]
    grids = [np.asarray(s["grid_thw"], np.int32).reshape(-1, 3) for s in group if len(s.get("grid_thw", ()))]
    row["pixel_values"] = np.concatenate(pixels) if pixels else np.zeros((0, patch_dim), np.float32)
    row["grid_thw"] = np.concatenate(grids) if grids else np.zeros((0, 3), np.int32)
    rows.append(row)
  return rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionBatchStats:
  """Per-batch image report; the dropped counts are cumulative over the samples read so far."""

  images: int
  "Images in the batch."
  patches: int
  "Real patches in the batch (the rest of ``num_patches`` is zero padding)."
  num_patches: int
  "The batch's patch bucket (per row with ``per_row``)."
  image_overlong: int = 0
  "Samples with images dropped for being longer than ``seq_len`` (never truncated)."
  image_overlong_examples: tuple[int, ...] = ()
  "Source indices (records' ``_index``) of the first few of them."
  image_patches: int = 0
  "Samples dropped for holding more patches than a row's share of a fixed ``num_patches``."
  image_patches_examples: tuple[int, ...] = ()
  "Source indices of the first few of them."


class VLPackedBatch(NamedTuple):
  """``arrays`` (:data:`jaxrl.data.ROW_KEYS` plus ``pixel_values`` [num_patches, patch_dim] (per row:
  [R, num_patches, patch_dim]), ``grid_thw`` [I, 3], ``image_rows`` [I], and with a model config
  ``rope_positions``/``rope_deltas`` and, per row, the tower's layout arrays (:data:`jaxrl.models.VISION_LAYOUT_KEYS`,
  each [R, ...]): ``jaxrl.models.VisionInputs.from_batch(arrays)`` is then what the model takes), the token
  :class:`jaxrl.data.PackingStats` and the :class:`VisionBatchStats`."""

  arrays: dict[str, np.ndarray]
  stats: Any
  vision: VisionBatchStats


def stack_vl_rows(rows: Sequence[dict[str, Any]], *, num_rows: int, seq_len: int, vision: VisionPackingConfig,
                  pad_id: int = 0, id_offset: int = 0, model_config=None) -> VLPackedBatch:
  """Stacks packed rows (:func:`pack_vl_samples`) into a batch: :func:`jaxrl.data.stack_rows` for the tokens,
  the rows' patches concatenated in row order and zero-padded to ``vision.bucket(...)`` (with
  ``vision.per_row``: each row's patches zero-padded to the bucket of the fullest row, ``[R, P, patch_dim]``);
  with ``model_config`` (a VLM ``ModelConfig``) the M-RoPE positions of the batch and, with ``per_row``, each
  row's tower layout (:func:`jaxrl.models.batch_vision_inputs`), so every array but ``grid_thw``/``image_rows``
  has the rows' leading axis and shards and splits with them."""
  counted = [{"samples": 0, "truncated": 0, "dropped": 0, **r} for r in rows]  # rows not from the iterator
  text: PackedBatch = stack_rows(counted, num_rows=num_rows, seq_len=seq_len, pad_id=pad_id, id_offset=id_offset)
  arrays = dict(text.arrays)
  grids = [np.asarray(r["grid_thw"], np.int32).reshape(-1, 3) for r in rows]
  pixels = [np.asarray(r["pixel_values"], np.float32) for r in rows]
  for p in pixels:
    if p.ndim != 2 or p.shape[1] != vision.patch_dim:
      raise ValueError(f"pixel_values rows must be [P, patch_dim={vision.patch_dim}], got {p.shape}; set "
                       "VisionPackingConfig.patch_dim to the images' ImageConfig.patch_dim")
  grid_thw = np.concatenate(grids) if grids else np.zeros((0, 3), np.int32)
  real = sum(len(p) for p in pixels)
  if vision.per_row:
    bucket = vision.bucket(max([len(p) for p in pixels], default=0))
    arrays["pixel_values"] = np.zeros((num_rows, bucket, vision.patch_dim), np.float32)
    for r, p in enumerate(pixels):
      arrays["pixel_values"][r, :len(p)] = p
  else:
    bucket = vision.bucket(real)
    arrays["pixel_values"] = np.concatenate(pixels + [np.zeros((bucket - real, vision.patch_dim), np.float32)])
  arrays["grid_thw"] = grid_thw
  arrays["image_rows"] = np.repeat(np.arange(len(rows), dtype=np.int32), [len(g) for g in grids])
  if model_config is not None:
    rope, deltas = mrope_positions(arrays["tokens"], arrays["segment_ids"], grid_thw, model_config)
    arrays["rope_positions"], arrays["rope_deltas"] = rope, deltas
    if vision.per_row:
      layout = batch_vision_inputs(arrays["pixel_values"], grid_thw, arrays["image_rows"], model_config.vision).layout
      arrays.update({k: getattr(layout, k) for k in VISION_LAYOUT_KEYS})
  last = rows[-1] if rows else {}
  stats = VisionBatchStats(
      images=len(grid_thw), patches=real, num_patches=bucket,
      image_overlong=int(last.get("image_overlong", 0)),
      image_overlong_examples=tuple(last.get("image_overlong_ids", ())),
      image_patches=int(last.get("image_patches", 0)),
      image_patches_examples=tuple(last.get("image_patches_ids", ())))
  return VLPackedBatch(arrays, text.stats, stats)


def vl_skip_report(stats: VisionBatchStats, *, seq_len: int, where=str,
                   report: SkipReport | None = None) -> SkipReport:
  """Adds the image samples packing dropped to ``report`` (a new one by default); ``where`` maps a source
  index to its ``file:line`` (``source.where``)."""
  report = SkipReport() if report is None else report
  report.add(f"sample with images longer than packing.seq_len={seq_len} dropped (never truncated)",
             count=stats.image_overlong, examples=map(where, stats.image_overlong_examples))
  report.add("sample with more image patches than a row's share of num_patches dropped",
             count=stats.image_patches, examples=map(where, stats.image_patches_examples))
  return report


def _note(ids: tuple[int, ...], sample: dict[str, Any]) -> tuple[int, ...]:
  index = int(sample["sample_id"][0]) if len(sample.get("sample_id", ())) else None
  return ids if index is None or index in ids or len(ids) >= MAX_EXAMPLES else (*ids, index)


_COUNTERS = ("samples", "truncated", "dropped", "image_overlong", "image_patches")
_IDS = ("truncated_ids", "dropped_ids", "image_overlong_ids", "image_patches_ids")


class _VLBatchIterator(grain.DatasetIterator):
  """Reads ``buffer_size`` samples, packs them into rows, emits batches of ``num_rows`` rows.

  State: the upstream state at the start of the current chunk, the rows of it already emitted, and the
  counters then; restoring re-reads and re-packs the chunk (packing is deterministic)."""

  def __init__(self, parent, *, config: PackingConfig, vision: VisionPackingConfig, pad_id: int, num_rows: int,
               id_offset: int, model_config):
    super().__init__(parent)
    self._cfg, self._vision, self._pad_id = config, vision, pad_id
    self._num_rows, self._id_offset, self._model_config = num_rows, id_offset, model_config
    self._max_row_patches = vision.row_cap(num_rows)
    self._counts = {k: 0 for k in _COUNTERS} | {k: () for k in _IDS}
    self._chunk_state, self._chunk_counts = parent.get_state(), dict(self._counts)
    self._rows: list[dict[str, Any]] = []
    self._emitted = 0
    self._exhausted = False

  def _fill(self) -> None:
    cfg = self._cfg
    self._chunk_state, self._chunk_counts = self._parent.get_state(), dict(self._counts)
    self._emitted = 0
    samples = []
    while len(samples) < cfg.buffer_size:
      try:
        sample = next(self._parent)
      except StopIteration:
        self._exhausted = True
        break
      self._counts["samples"] += 1
      fitted, status = fit_vl_sample(sample, cfg.seq_len, overlong=cfg.overlong,
                                     max_row_patches=self._max_row_patches)
      if status != "ok":
        self._counts[status] += 1
        self._counts[f"{status}_ids"] = _note(self._counts[f"{status}_ids"], sample)
      if fitted is not None:
        samples.append(fitted)
    self._rows = pack_vl_samples(samples, cfg.seq_len, method=cfg.method, pad_id=self._pad_id,
                                 max_row_patches=self._max_row_patches, patch_dim=self._vision.patch_dim)

  def _next_row(self) -> dict[str, Any]:
    while self._emitted >= len(self._rows):
      if self._exhausted:
        raise StopIteration
      self._fill()
    row = {**self._rows[self._emitted], **self._counts}
    self._emitted += 1
    return row

  def __next__(self) -> VLPackedBatch:
    rows = []
    for _ in range(self._num_rows):
      try:
        rows.append(self._next_row())
      except StopIteration:
        break
    if not rows or (len(rows) < self._num_rows and self._cfg.drop_remainder):
      raise StopIteration
    return stack_vl_rows(rows, num_rows=self._num_rows, seq_len=self._cfg.seq_len, vision=self._vision,
                         pad_id=self._pad_id, id_offset=self._id_offset, model_config=self._model_config)

  def get_state(self) -> dict[str, Any]:
    counts = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self._chunk_counts.items()}
    return {"parent": self._chunk_state, "emitted": self._emitted, "counters": counts}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._counts = {k: (tuple(int(i) for i in v) if k in _IDS else int(v)) for k, v in state["counters"].items()}
    self._exhausted = False
    self._rows, self._emitted = [], 0
    if state["emitted"]:
      self._fill()
      self._emitted = state["emitted"]
    else:
      self._chunk_state, self._chunk_counts = state["parent"], dict(self._counts)


class VLPackedBatchIterDataset(grain.IterDataset):
  """Grain dataset of :class:`VLPackedBatch` es from tokenised multimodal samples.

  Args:
    parent: a dataset of :func:`jaxrl.data.encode_vl_record` samples (text-only samples welcome).
    config: token packing settings (``seq_len``, ``method``, ``buffer_size``, ``overlong`` for text-only
      samples, ``drop_remainder``).
    vision: patch bucket settings.
    pad_id: padding token id.
    num_rows: rows per batch; default ``config.global_rows``.
    id_offset: as for :class:`jaxrl.data.PackedBatchIterDataset`.
    model_config: a VLM ``ModelConfig``; when given, batches hold ``rope_positions`` and ``rope_deltas``.
  """

  def __init__(self, parent: grain.IterDataset, *, config: PackingConfig, vision: VisionPackingConfig,
               pad_id: int = 0, num_rows: int | None = None, id_offset: int = 0, model_config=None):
    super().__init__(parent)
    self._kw = dict(config=config, vision=vision, pad_id=pad_id, id_offset=id_offset, model_config=model_config,
                    num_rows=config.global_rows if num_rows is None else num_rows)
    cap = vision.row_cap(self._kw["num_rows"])
    if cap is not None and cap < vision.merge_size ** 2:
      raise ValueError(f"num_patches={vision.num_patches} leaves no patches per row for {self._kw['num_rows']} rows")

  def __iter__(self) -> grain.DatasetIterator:
    return _VLBatchIterator(self._parent.__iter__(), **self._kw)


class _EncodeVL:
  """Picklable ``record -> encode_vl_record(...)`` (for Grain worker processes)."""

  def __init__(self, tokenizer, images: ImageConfig, image_root, end_of_turn):
    self.tokenizer, self.images, self.image_root, self.end_of_turn = tokenizer, images, image_root, end_of_turn

  def __call__(self, record):
    return encode_vl_record(self.tokenizer, record, images=self.images, image_root=self.image_root,
                            end_of_turn=self.end_of_turn)


def vl_batches(source, tokenizer, *, images: ImageConfig, packing: PackingConfig, vision: VisionPackingConfig,
               model_config=None, seed: int = 0, shuffle: bool = True, num_epochs: int | None = 1,
               process_index: int = 0, process_count: int = 1, image_root=None, end_of_turn: str | None = None,
               num_threads: int = 2) -> VLPackedBatchIterDataset:
  """Records with images -> :class:`VLPackedBatch` es of ``global_rows // process_count`` rows for this process:
  shuffle, shard, repeat, :func:`jaxrl.data.encode_vl_record` (images loaded and processed in Grain's reader
  threads), pack (the text pipeline's order, :func:`jaxrl.data.sft_batches`).

  Args:
    source: a random-access record source (``len`` and ``[i]``): a list of records (e.g.
      ``BuiltinImageTask().records("train")``) or a file source whose records keep ``_where``/``_index``.
    images, packing, vision, model_config: as for :func:`encode_vl_record` and :class:`VLPackedBatchIterDataset`.
  """
  if packing.global_rows % process_count:
    raise ValueError(f"global_rows={packing.global_rows} does not split over {process_count} processes")
  if len(source) < process_count:
    raise ValueError(f"{len(source)} records cannot be sharded over {process_count} processes")
  if process_count > 1 and vision.per_row and vision.num_patches is None:  # model inputs: one shape everywhere
    raise ValueError(f"vision.num_patches: set a fixed per-row bucket to shard batches over {process_count} "
                     "processes (each process's own min_patches * 2**k bucket would differ, and so would the shapes "
                     "they compile), or read the global stream on every process (process_count=1), as jaxrl sft does")
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds[process_index::process_count]
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.map(_EncodeVL(tokenizer, images, image_root, end_of_turn))
  rows = packing.global_rows // process_count
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  return VLPackedBatchIterDataset(ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads)), config=packing,
                                  vision=vision, pad_id=pad_id, num_rows=rows,
                                  id_offset=process_index * rows * packing.seq_len, model_config=model_config)
