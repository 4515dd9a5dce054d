"""Per-row VLM batch shapes: ``models.pad_patch_rows`` (raising the patch bucket equals laying rows out at that
bucket directly, SFT ``[R, P, ...]`` and RL ``[M, R, P, ...]`` layouts), the fixed bucket sharded batches need, and
``jaxrl plan``'s abstract VLM rows against the RL packer."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl import data as data_lib
from jaxrl import models, plan, rl

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


def test_plan_vision_batch_has_the_rl_packers_image_keys():
  """``jaxrl plan``'s abstract VLM rows (``plan.vision_batch``) hold every image key the RL packer writes for a
  VLM rollout (``rl.pack_sequences`` + ``interleaved``), ``image_token_mask`` included, with its shape and dtype."""
  cfg = models.ModelConfig.tiny_vl()
  rng = np.random.default_rng(0)
  n = 8 + 16 // 4
  seq = {"tokens": np.ones(n, np.int32), "targets": np.ones(n, np.int32), "loss_mask": np.ones(n, np.float32),
         "rope_positions": np.zeros((n, 3), np.int32), "image_token_mask": np.zeros(n, np.int32),
         "pixel_values": rng.normal(size=(16, cfg.vision.patch_dim)).astype(np.float32),
         "grid_thw": np.asarray([[1, 4, 4]], np.int32)}
  want = rl.pack_sequences([seq], row_len=32, rows=2, bucket="exact", vision=cfg.vision).interleaved()
  got = plan.vision_batch(cfg, rows=2, row_len=32, num_patches=want["pixel_values"].shape[1], mesh=None, rules=None)
  keys = {"pixel_values", "rope_positions", "image_token_mask", *models.VISION_LAYOUT_KEYS}
  assert keys == set(got)
  for k in sorted(keys):
    assert (got[k].shape, got[k].dtype) == (want[k].shape, want[k].dtype), k
