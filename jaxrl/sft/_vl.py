"""SFT of vision-language models: image records in, per-row vision inputs out, held-out image accuracy.

A VLM (``model.cfg.vision``) trains through the same :class:`jaxrl.sft.SFTTrainer` loop as a text model;
only the data path differs: records with images (chat messages with image parts, TRL/verl layouts; see
docs/vlm.md) are validated without loading images (:func:`jaxrl.data.vl_record_messages`), encoded and
packed by :func:`jaxrl.data.vl_batches` with per-row patches, so every array the step takes has the rows'
leading axis and shards and splits into micro-batches with the tokens. The built-in image task
(``data.image_task``) is written to ``out_dir/data`` as JSONL with inline PNG images and read like any file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl import data as data_lib
from jaxrl import sampling

HOST_ONLY_KEYS = ("grid_thw", "image_rows")
"""VL batch arrays that are per image, not per row: kept on the host (the layout arrays carry what the
tower needs)."""


def check_image_config(images: data_lib.ImageConfig, vision) -> None:
  """The processor's patch geometry must be the tower's (``data.images`` against ``model.vision``)."""
  for key, want in (("patch_size", vision.patch_size), ("temporal_patch_size", vision.temporal_patch_size),
                    ("merge_size", vision.spatial_merge_size)):
    if getattr(images, key) != want:
      raise ValueError(f"data.images.{key}={getattr(images, key)} differs from the model's vision tower ({want})")


def write_image_task(task: data_lib.BuiltinImageTask | data_lib.BuiltinCaptionTask,
                     out_dir: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The built-in image (or caption) task's train and held-out splits as JSONL files under ``out_dir/data``."""
  if jax.process_index():  # every process writes its own (identical) copy
    out_dir = out_dir / "processes" / str(jax.process_index())
  paths = task.write_splits(out_dir / "data")
  return (str(paths["train"]),), (str(paths["heldout"]),)


def vl_batch_iter(paths, *, tokenizer, model_cfg, images: data_lib.ImageConfig, packing: data_lib.PackingConfig,
                  num_patches: int | None, min_patches: int, seed: int, epochs: int | None, max_bad_records: int,
                  end_of_turn: str | None = None, zero_pixels: bool = False):
  """The global stream of per-row VL batches (every process reads it whole, as the text path does);
  the iterator's ``source`` is the record source (bad records, fingerprint, ``where``). ``zero_pixels``:
  every batch's ``pixel_values`` zeroed (the image-ablated control; tokens and layouts unchanged)."""
  source = data_lib.open_source(paths, max_bad_records=max_bad_records, validate=data_lib.vl_record_messages)
  root = Path(paths[0]).parent if paths else None
  vision = data_lib.VisionPackingConfig(num_patches=num_patches, min_patches=min_patches, per_row=True,
                                        merge_size=model_cfg.vision.spatial_merge_size,
                                        patch_dim=model_cfg.vision.patch_dim)
  ds = data_lib.vl_batches(source, tokenizer, images=images, packing=packing, vision=vision, model_config=model_cfg,
                           seed=seed, shuffle=epochs != 1, num_epochs=epochs, image_root=root,
                           end_of_turn=end_of_turn)
  if zero_pixels:
    ds = ds.map(_ZeroPixels())
  ds.source = source
  return ds


class _ZeroPixels:
  """``batch -> batch`` with ``pixel_values`` zeroed (picklable, for Grain)."""

  def __call__(self, batch):
    return batch._replace(arrays=dict(batch.arrays, pixel_values=np.zeros_like(batch.arrays["pixel_values"])))


def device_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The row-aligned arrays of a batch (text or VL): what goes to the devices."""
  return {k: v for k, v in arrays.items() if k not in HOST_ONLY_KEYS}


def image_heldout_accuracy(model, tokenizer, paths, *, n: int, max_new_tokens: int,
                           images: data_lib.ImageConfig, mesh=None, zero_pixels: bool = False) -> float:
  """Fraction of the first ``n`` held-out image records whose greedy completion has the right answer
  (:func:`jaxrl.data.image_answer_match` on the record's ``answer``): prompts with their images through
  :func:`jaxrl.data.encode_vl_prompt` and the sampler (the tower runs once per prompt at prefill)."""
  records = []
  for p in paths:
    with open(p, encoding="utf-8") as f:
      records += [dict(json.loads(line), _where=f"{p}:{i}") for i, line in enumerate(f, 1) if line.strip()]
  records = [r for r in records if "answer" in r][:n]
  if not records:
    return float("nan")
  if jax.process_count() > 1:
    raise NotImplementedError("held-out image accuracy runs on one process; set eval.exact_match: 0")
  root = Path(paths[0]).parent
  prompts = [data_lib.encode_vl_prompt(tokenizer, r, images=images, image_root=root) for r in records]
  if zero_pixels:
    prompts = [dict(p, pixel_values=np.zeros_like(p["pixel_values"])) for p in prompts]
  longest = max(len(p["tokens"]) for p in prompts)
  sampler = sampling.Sampler(model, tokenizer, mesh=mesh, max_len=longest + max_new_tokens)
  out = sampler.generate(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
  hits = [data_lib.image_answer_match(text, r["answer"]) for text, r in zip(out.texts, records)]
  return float(np.mean(hits))


def vl_skips(report: data_lib.SkipReport, batch: Any, source, seq_len: int) -> None:
  """Adds the image samples packing dropped (never truncated) to ``report``."""
  vision = getattr(batch, "vision", None) if batch is not None else None
  if vision is not None:
    data_lib.vl_skip_report(vision, seq_len=seq_len, where=source.where, report=report)

