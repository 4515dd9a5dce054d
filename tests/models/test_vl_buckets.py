"""``models.pad_patch_rows``: raising a batch's per-row patch bucket equals laying it out at that bucket directly
(``models.batch_vision_inputs``), for the SFT ``[R, P, ...]`` and the RL ``[M, R, P, ...]`` layouts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl import data as data_lib
from jaxrl import models

VISION = models.ModelConfig.tiny_vl().vision


def _inputs(num_patches: int):
  """Two rows: two images (grids 1x4x4, 1x4x8) in row 0, none in row 1, padded to ``num_patches``."""
  rng = np.random.default_rng(0)
  grid = np.asarray([[1, 4, 4], [1, 4, 8]], np.int32)
  pixels = np.zeros((2, num_patches, VISION.patch_dim), np.float32)
  pixels[0, :48] = rng.normal(size=(48, VISION.patch_dim))
  inputs = models.batch_vision_inputs(pixels, grid, np.zeros(2, np.int32), VISION)
  return {"pixel_values": inputs.pixel_values, **{k: getattr(inputs.layout, k) for k in models.VISION_LAYOUT_KEYS}}


def test_padding_the_bucket_equals_the_layout_at_that_bucket():
  small, big = _inputs(64), _inputs(256)
  padded = models.pad_patch_rows({**small, "tokens": np.ones((2, 5))}, 256, VISION.spatial_merge_size)
  assert padded["tokens"].shape == (2, 5)
  for k in big:
    np.testing.assert_array_equal(padded[k], big[k], err_msg=k)
  stacked = models.pad_patch_rows({k: v[None] for k, v in small.items()}, 256, VISION.spatial_merge_size)  # [M, R, ..]
  for k in big:
    np.testing.assert_array_equal(stacked[k][0], big[k], err_msg=k)
  with pytest.raises(ValueError, match="num_patches: 32 must be a multiple of 4 and >= the batch's bucket 64"):
    models.pad_patch_rows(small, 32, VISION.spatial_merge_size)
  with pytest.raises(ValueError, match="num_patches: 66 must be a multiple of 4"):
    models.pad_patch_rows(small, 66, VISION.spatial_merge_size)


def test_per_row_batches_sharded_over_processes_need_a_fixed_bucket():
  """Each process's own ``min_patches * 2**k`` bucket would differ: sharded per-row VL batches are refused without
  a fixed ``num_patches`` (jaxrl sft reads the global stream on every process, so its buckets agree)."""
  records = data_lib.BuiltinImageTask(n_train=4, difficulty=0, image_size=56, seed=0).records("train")
  cfg = models.ModelConfig.tiny_vl()
  with pytest.raises(ValueError, match="vision.num_patches: set a fixed per-row bucket to shard batches over 2"):
    data_lib.vl_batches(records, None, images=data_lib.ImageConfig(), model_config=cfg,
                        packing=data_lib.PackingConfig(seq_len=64, global_rows=2),
                        vision=data_lib.VisionPackingConfig(per_row=True), process_index=0, process_count=2)
