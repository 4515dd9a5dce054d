"""Multimodal packing: each packed sequence equals its unpacked sample (tokens, masks, patches, grids, M-RoPE),
image samples are never truncated (dropped and counted), fixed patch buckets hold, state restores."""

import json
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxrl.data import (BuiltinImageTask, ImageConfig, ImageTaskConfig, PackingConfig, VisionPackingConfig, VLPackedBatchIterDataset,
                        encode_vl_record, generate_image_task, image_task_record, pack_vl_samples, stack_vl_rows,
                        vl_batches, vl_skip_report)
from jaxrl import models
from jaxrl.models import ModelConfig, mrope_positions

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen2_5_vl"
CFG = ImageConfig(min_pixels=3136, max_pixels=50176)


@pytest.fixture(scope="module")
def tok():
  return AutoTokenizer.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def model_config():
  return ModelConfig.from_hf_config(json.loads((FIXTURE / "config.json").read_text()))


def _samples(tok, n=12, seed=0):
  """Image-task records (56-112 px images, 1-2 images each) mixed with text-only records."""
  examples = generate_image_task(2 * n, seed=seed, config=ImageTaskConfig(image_size=56, max_value=9))
  examples += generate_image_task(n, seed=seed, config=ImageTaskConfig.level(3))  # 112 px
  out = []
  for i in range(n):
    if i % 4 == 3:
      rec = {"prompt": "What is 2+2?", "completion": "4"}
    else:
      rec = image_task_record(examples[i])
      if i % 3 == 1:  # a second image in a later turn
        extra = image_task_record(examples[n + i])["messages"]
        rec["messages"] = rec["messages"] + extra
    out.append(encode_vl_record(tok, {**rec, "_index": i}, images=CFG))
  return out


def _segments(arrays, row):
  seg = arrays["segment_ids"][row]
  return [np.flatnonzero(seg == s) for s in range(1, seg.max() + 1)]


def _check_packed_equals_unpacked(batch, samples, order, model_config=None):
  """Walks the batch's rows and segments in order; ``order`` is the sample index of each segment."""
  arrays = batch.arrays
  k, patch_at, image_at = 0, 0, 0
  for row in range(len(arrays["tokens"])):
    for where in _segments(arrays, row):
      s = samples[order[k]]
      np.testing.assert_array_equal(arrays["tokens"][row, where], s["tokens"])
      np.testing.assert_array_equal(arrays["targets"][row, where[:-1]], s["tokens"][1:])
      np.testing.assert_array_equal(arrays["loss_mask"][row, where[:-1]], s["loss_mask"][1:])
      np.testing.assert_array_equal(arrays["positions"][row, where], np.arange(len(where)))
      n_img, n_patch = len(s["grid_thw"]), len(s["pixel_values"])
      np.testing.assert_array_equal(arrays["grid_thw"][image_at:image_at + n_img], s["grid_thw"])
      np.testing.assert_array_equal(arrays["image_rows"][image_at:image_at + n_img], row)
      np.testing.assert_array_equal(arrays["pixel_values"][patch_at:patch_at + n_patch], s["pixel_values"])
      if model_config is not None:
        rope, deltas = mrope_positions(s["tokens"][None], np.ones((1, len(where)), np.int32), s["grid_thw"],
                                       model_config)
        np.testing.assert_array_equal(arrays["rope_positions"][row, where], rope[0])
        np.testing.assert_array_equal(arrays["rope_deltas"][row, where], deltas[0])
      k, patch_at, image_at = k + 1, patch_at + n_patch, image_at + n_img
  assert k == len(order) and image_at == len(arrays["grid_thw"])
  assert not arrays["pixel_values"][patch_at:].any()  # zero padding after the real patches
  return patch_at


def test_packed_equals_unpacked(tok, model_config):
  samples = _samples(tok)
  assert {len(s["grid_thw"]) for s in samples} == {0, 1, 2}
  vision = VisionPackingConfig(min_patches=64)
  rows = pack_vl_samples(samples, 160, method="best_fit")
  assert len(rows) < len(samples)  # rows really hold several samples
  batch = stack_vl_rows(rows, num_rows=len(rows) + 1, seq_len=160, vision=vision, model_config=model_config)
  order = []
  for r in rows:  # recover which sample each segment is, from its tokens
    for where in _segments({"segment_ids": r["segment_ids"][None]}, 0):
      order.append(next(i for i, s in enumerate(samples) if i not in order
                        and np.array_equal(s["tokens"], r["tokens"][where])))
  real = _check_packed_equals_unpacked(batch, samples, order, model_config)
  assert real == sum(len(s["pixel_values"]) for s in samples) == batch.vision.patches
  bucket = batch.arrays["pixel_values"].shape[0]
  assert bucket == batch.vision.num_patches and bucket >= real > bucket // 2 and bucket % 64 == 0
  assert batch.vision.images == sum(len(s["grid_thw"]) for s in samples)
  assert not batch.arrays["segment_ids"][-1].any()  # the empty padding row


def _forward(model, tokens, segment_ids, positions, rope, images):
  images = None if images is None else jax.tree.map(jnp.asarray, images)
  return np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segment_ids),
                          rope_positions=jnp.asarray(rope), images=images))


def test_packed_batch_gives_the_logits_of_separate_samples(tok):
  """The data path end to end: a packed batch through the fixture VLM equals each sample run alone."""
  model = models.load_pretrained(FIXTURE, dtype="float32")
  samples = _samples(tok, n=6)
  rows = pack_vl_samples(samples, 160, method="best_fit")
  batch = stack_vl_rows(rows, num_rows=len(rows), seq_len=160,
                        vision=VisionPackingConfig(min_patches=64, per_row=True), model_config=model.cfg)
  a = batch.arrays
  images = models.VisionInputs.from_batch(a)  # the batch carries the per-row layout the model takes
  assert images.pixel_values.shape[0] == images.layout.window_index.shape[0] == len(rows)
  packed = _forward(model, a["tokens"], a["segment_ids"], a["positions"], a["rope_positions"], images)  # [R, T, V]
  checked = 0
  for row in range(len(rows)):
    for where in _segments(a, row):
      s = next(s for s in samples if np.array_equal(s["tokens"], a["tokens"][row, where]))
      n, bucket = len(s["tokens"]), a["pixel_values"].shape[1]
      # alone: one row of the same shapes as the batch's (right padding, patches padded to the same bucket)
      tokens = np.pad(s["tokens"], (0, 160 - n))[None]
      seg = (np.arange(160) < n).astype(np.int32)[None]
      rope, _ = mrope_positions(tokens, seg, s["grid_thw"], model.cfg)
      pixels = np.pad(s["pixel_values"], ((0, bucket - len(s["pixel_values"])), (0, 0)))[None]
      alone_images = models.batch_vision_inputs(pixels, s["grid_thw"], np.zeros(len(s["grid_thw"])), model.cfg.vision)
      alone = _forward(model, tokens, seg, np.arange(160)[None] * seg, rope, alone_images)[0, :n]
      got = packed[row, where]
      assert np.abs(got - alone).max() <= 1e-4 * np.abs(alone).max()
      checked += 1
  assert checked == len(samples) and len(rows) < len(samples)


def _dataset(samples):
  return grain.MapDataset.source(samples).to_iter_dataset()


def test_image_rows_are_never_truncated_and_are_counted(tok, model_config):
  samples = _samples(tok, n=8)
  long_text = {k: np.concatenate([v] * 12) for k, v in samples[3].items() if k not in ("pixel_values", "grid_thw")}
  long_text |= {"pixel_values": samples[3]["pixel_values"], "grid_thw": samples[3]["grid_thw"],
                "sample_id": np.full(len(long_text["tokens"]), 99, np.int32)}
  seq_len = max(len(s["tokens"]) for s in samples) - 1  # the longest image sample does not fit
  too_long = [i for i, s in enumerate(samples) if len(s["tokens"]) > seq_len]
  assert too_long and all(len(samples[i]["grid_thw"]) for i in too_long)
  cfg = PackingConfig(seq_len=seq_len, global_rows=2, buffer_size=16, overlong="truncate")
  ds = VLPackedBatchIterDataset(_dataset(samples + [long_text]), config=cfg, vision=VisionPackingConfig(),
                                model_config=model_config)
  batches = list(ds)
  last = batches[-1]
  assert last.vision.image_overlong == len(too_long)
  assert last.vision.image_overlong_examples == tuple(too_long[:3])
  assert last.stats.truncated == 1 and last.stats.truncated_examples == (99,)  # the text-only one, as configured
  kept = [s for i, s in enumerate(samples) if i not in too_long]
  images = np.concatenate([b.arrays["grid_thw"] for b in batches])
  assert len(images) == sum(len(s["grid_thw"]) for s in kept)  # every kept image, whole
  for b in batches:
    for row in range(2):
      for where in _segments(b.arrays, row):
        toks = b.arrays["tokens"][row, where]
        if (toks == model_config.image_token_id).any():
          assert any(np.array_equal(toks, s["tokens"]) for s in kept)
  lines = vl_skip_report(last.vision, seq_len=seq_len, where=lambda i: f"d.jsonl:{i + 1}").lines()
  assert lines == [f"sample with images longer than packing.seq_len={seq_len} dropped (never truncated): "
                   f"{len(too_long)} (e.g. {', '.join(f'd.jsonl:{i + 1}' for i in too_long[:3])})"]


def test_fixed_num_patches_caps_rows_and_counts_refusals(tok):
  samples = _samples(tok, n=12)
  per_sample = [len(s["pixel_values"]) for s in samples]
  cap = sorted(set(per_sample))[-2]  # the largest samples do not fit a row's share
  vision = VisionPackingConfig(num_patches=2 * cap)
  cfg = PackingConfig(seq_len=256, global_rows=2, buffer_size=5)
  batches = list(VLPackedBatchIterDataset(_dataset(samples), config=cfg, vision=vision))
  refused = [i for i, p in enumerate(per_sample) if p > cap]
  assert batches[-1].vision.image_patches == len(refused) > 0
  for b in batches:
    assert b.arrays["pixel_values"].shape == (2 * cap, vision.patch_dim)
    per_row = np.zeros(2, np.int64)
    np.add.at(per_row, b.arrays["image_rows"], np.prod(b.arrays["grid_thw"], axis=1))
    assert (per_row <= cap).all()
  assert sum(b.vision.images for b in batches) == sum(len(s["grid_thw"]) for i, s in enumerate(samples)
                                                       if i not in refused)


def test_state_restores_the_same_batches(tok):
  samples = _samples(tok, n=10)
  cfg = PackingConfig(seq_len=200, global_rows=2, buffer_size=4)
  ds = VLPackedBatchIterDataset(_dataset(samples), config=cfg, vision=VisionPackingConfig(min_patches=64))
  it = iter(ds)
  next(it)
  state = it.get_state()
  rest = list(it)
  it2 = iter(ds)
  it2.set_state(json.loads(json.dumps(state)))
  again = list(it2)
  assert len(rest) == len(again) > 0
  for a, b in zip(rest, again):
    for k in a.arrays:
      np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def test_bucket_rules():
  v = VisionPackingConfig(min_patches=64)
  assert [v.bucket(n) for n in (0, 64, 65, 300)] == [64, 64, 128, 512]
  assert VisionPackingConfig(num_patches=100).bucket(100) == 100
  with pytest.raises(ValueError, match="more than num_patches=100"):
    VisionPackingConfig(num_patches=100).bucket(104)
  with pytest.raises(ValueError, match="multiple of merge_size"):
    VisionPackingConfig(num_patches=102)


def test_per_row_layout_holds_each_rows_own_patches(tok, model_config):
  samples = _samples(tok, n=12)
  rows = pack_vl_samples(samples, 160, method="best_fit")
  flat = stack_vl_rows(rows, num_rows=len(rows) + 1, seq_len=160, vision=VisionPackingConfig(min_patches=64))
  per = stack_vl_rows(rows, num_rows=len(rows) + 1, seq_len=160,
                      vision=VisionPackingConfig(min_patches=8, per_row=True))
  sizes = np.prod(flat.arrays["grid_thw"], axis=1)  # patches per image, in token order
  starts = np.concatenate([[0], np.cumsum(sizes)])
  row_patches = [int(sizes[flat.arrays["image_rows"] == r].sum()) for r in range(len(rows) + 1)]
  bucket = per.arrays["pixel_values"].shape[1]
  assert per.arrays["pixel_values"].shape == (len(rows) + 1, bucket, 1176) and bucket == per.vision.num_patches
  assert bucket >= max(row_patches) > bucket // 2 and bucket % 8 == 0
  for r in range(len(rows) + 1):
    mine = np.flatnonzero(flat.arrays["image_rows"] == r)
    want = np.concatenate([flat.arrays["pixel_values"][starts[i]:starts[i + 1]] for i in mine] or
                          [np.zeros((0, 1176), np.float32)])
    np.testing.assert_array_equal(per.arrays["pixel_values"][r, :row_patches[r]], want)
    assert not per.arrays["pixel_values"][r, row_patches[r]:].any()
  for k in ("tokens", "grid_thw", "image_rows"):
    np.testing.assert_array_equal(per.arrays[k], flat.arrays[k])
  assert not set(models.VISION_LAYOUT_KEYS) & set(per.arrays)  # layouts need the model's tower config
  laid = stack_vl_rows(rows, num_rows=len(rows) + 1, seq_len=160,
                       vision=VisionPackingConfig(min_patches=8, per_row=True), model_config=model_config).arrays
  for r in range(len(rows) + 1):  # each row's layout is vision_layout of that row's own images
    want = models.vision_layout(flat.arrays["grid_thw"][flat.arrays["image_rows"] == r], model_config.vision,
                                num_patches=bucket)
    for k in models.VISION_LAYOUT_KEYS:
      np.testing.assert_array_equal(laid[k][r], getattr(want, k), err_msg=f"{k} row {r}")
  assert laid["image_segments"][-1].max() == 0 and laid["image_segments"][0].max() >= 1
  cap = 100  # a fixed per-row bucket caps every row
  cfg = PackingConfig(seq_len=256, global_rows=2, buffer_size=5)
  vision = VisionPackingConfig(num_patches=cap, per_row=True)
  for b in VLPackedBatchIterDataset(_dataset(samples), config=cfg, vision=vision):
    assert b.arrays["pixel_values"].shape == (2, cap, 1176)
    per_row = np.zeros(2, np.int64)
    np.add.at(per_row, b.arrays["image_rows"], np.prod(b.arrays["grid_thw"], axis=1))
    assert (per_row <= cap).all()


def test_patch_width_mismatch_is_an_error(tok):
  rows = pack_vl_samples(_samples(tok, n=2), 200, method="best_fit")
  with pytest.raises(ValueError, match=r"patch_dim=588\], got \(\d+, 1176\)"):
    stack_vl_rows(rows, num_rows=len(rows), seq_len=200, vision=VisionPackingConfig(patch_dim=588))


def test_vl_batches_shards_records_and_keeps_every_image(tok, model_config):
  records = BuiltinImageTask(n_train=24, difficulty=2, image_size=56, seed=0).records("train")
  records = [{**r, "_index": i, "_where": f"task:{i + 1}"} for i, r in enumerate(records)]
  packing = PackingConfig(seq_len=256, global_rows=4, buffer_size=8)
  samples, read = 0, []
  for pi in range(2):
    ds = vl_batches(records, tok, images=CFG, packing=packing, vision=VisionPackingConfig(min_patches=64),
                    model_config=model_config, seed=3, process_index=pi, process_count=2, num_threads=0)
    for b in ds:
      assert b.arrays["tokens"].shape == (2, 256)  # this process's share of global_rows
      pads = b.arrays["tokens"] == model_config.image_token_id
      assert len(b.arrays["grid_thw"]) == int(pads.sum()) // 4  # 56 px images: 4 tokens each, all whole
      samples += b.stats.samples
    read.append(b.stats.samples_read)
  assert read == [12, 12] and samples == 24  # each process its half of the records, every one packed
