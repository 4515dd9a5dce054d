"""SFT of a vision-language model: the loss on per-row image batches, micro-batch split invariance, the
trainer end to end (image task, held-out accuracy through the sampler, export, the image-ablated control)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, sharding, sft, train

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2_5_vl"
TINY_VL = {"preset": "tiny_vl", "overrides": {"vocab_size": 128, "vision_start_token_id": 4, "vision_end_token_id": 5,
                                              "image_token_id": 6, "video_token_id": 7}}


def _cfg(tmp_path, **over):
  base = {
      "model": TINY_VL,
      "tokenizer": str(FIXTURE),
      "data": {"image_task": {"n_train": 64, "n_heldout": 4, "difficulty": 0, "image_size": 56, "seed": 0},
               "num_patches": 32},
      "packing": {"seq_len": 128, "global_rows": 8, "buffer_size": 8},
      "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine"},
      "steps": 3,
      "eval": {"every": 0, "exact_match": 0},
      "out_dir": str(tmp_path / "run"),
      "export_hf": False,
      "tensorboard": False,
  }
  data = config_lib.apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in over.items()])
  return config_lib.from_dict(sft.SFTConfig, data)


@pytest.fixture(scope="module")
def vl_batch():
  """The fixture VLM and 4 per-row packed rows of image-task records (several samples and images a row)."""
  model = models.load_pretrained(FIXTURE, dtype="float32")
  tok = models.load_tokenizer(FIXTURE)
  records = data_lib.BuiltinImageTask(n_train=24, difficulty=0, image_size=56, seed=1).records("train")
  records = [{**r, "_index": i, "_where": f"task:{i + 1}"} for i, r in enumerate(records)]
  vision = data_lib.VisionPackingConfig(min_patches=16, per_row=True)
  ds = data_lib.vl_batches(records, tok, images=data_lib.ImageConfig(), vision=vision, model_config=model.cfg,
                           packing=data_lib.PackingConfig(seq_len=256, global_rows=4, buffer_size=24), shuffle=False,
                           num_threads=0)
  arrays = next(iter(ds)).arrays
  assert (arrays["segment_ids"].max(axis=1) >= 2).all() and len(arrays["grid_thw"]) >= 8  # really packed
  return model, arrays


def test_vl_loss_equals_a_float64_reference_of_the_logits(vl_batch):
  """Σ w·nll of the SFT loss against log-softmax in float64 of the model's own image-conditioned logits;
  the same loss without the images differs (the images reach the loss)."""
  model, arrays = vl_batch
  graphdef, params = nnx.split(model)
  loss_cfg = sft.SFTLoss(mode="token_sum", divisor="none", chunk_size=32)
  batch = sft.sft_prepare(loss_cfg)(jax.tree.map(jnp.asarray, sft.vl_device_arrays(arrays)))
  loss, metrics = sft.sft_loss_fn(graphdef, loss_cfg)(params, batch)
  logits = np.asarray(model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                            rope_positions=batch["rope_positions"], images=models.VisionInputs.from_batch(batch)),
                      np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, arrays["targets"][..., None].astype(np.int64), -1)[..., 0]
  want = float((arrays["loss_mask"] * nll).sum())
  assert abs(float(loss) - want) <= 1e-4 * want and float(metrics["loss_tokens"]) == arrays["loss_mask"].sum()
  blind = {k: v for k, v in batch.items() if k not in ("pixel_values", *models.VISION_LAYOUT_KEYS)}
  assert abs(float(sft.sft_loss_fn(graphdef, loss_cfg)(params, blind)[0]) - want) > 1e-3 * want


def test_vl_gradients_do_not_depend_on_the_split_or_the_sharding(vl_batch):
  """Per-row vision inputs split into micro-batches and over data-parallel devices with the tokens."""
  model, arrays = vl_batch
  graphdef, params = nnx.split(model)
  loss_cfg = sft.SFTLoss(mode="sample_mean", divisor="gbs_true", chunk_size=32)
  loss_fn, prepare = sft.sft_loss_fn(graphdef, loss_cfg), sft.sft_prepare(loss_cfg)
  host = sft.vl_device_arrays(arrays)

  def grads(devices, micro):
    mesh = sharding.make_mesh({"data": devices}, devices=jax.devices()[:devices])
    batch = jax.device_put(host, NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda p, b: train.accumulate_gradients(loss_fn, p, prepare(b), micro_batches=micro, mesh=mesh))
    loss, g, _ = fn(train.place_on_mesh(params, mesh), batch)
    return loss, g

  ref_loss, ref = grads(1, 1)
  tower = jax.tree.leaves(ref["visual"])
  assert all(np.abs(np.asarray(g)).max() > 0 for g in tower)  # the tower is trained through the images
  for devices, micro in [(2, 2), (4, 1)]:
    loss, g = grads(devices, micro)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_trainer_runs_a_vlm_on_the_image_task_and_exports_it(tmp_path):
  trainer = sft.SFTTrainer(_cfg(tmp_path, steps=4, export_hf=True, eval={"every": 4, "exact_match": 4,
                                                                         "max_new_tokens": 4, "batches": 1}))
  out = trainer.run()
  assert out["losses"][-1] < out["losses"][0]
  assert 0.0 <= out["eval_after"]["eval_exact_match"] <= 1.0 and out["eval_after"]["eval_loss"] > 0
  exported = models.load_pretrained(out["hf_dir"], dtype="float32")
  assert exported.cfg.vision == trainer.model.cfg.vision
  batch = next(iter(trainer._batches(trainer.heldout_paths, epochs=1))).arrays
  kw = dict(positions=jnp.asarray(batch["positions"]), segment_ids=jnp.asarray(batch["segment_ids"]),
            rope_positions=jnp.asarray(batch["rope_positions"]),
            images=jax.tree.map(jnp.asarray, models.VisionInputs.from_batch(batch)))
  trained = nnx.merge(trainer.graphdef, trainer.state.params)
  np.testing.assert_allclose(np.asarray(exported(jnp.asarray(batch["tokens"]), **kw)),
                             np.asarray(trained(jnp.asarray(batch["tokens"]), **kw)), rtol=0, atol=1e-5)


def test_freeze_vision_and_zero_pixels_and_bad_settings_are_refused(tmp_path):
  """freeze_vision: the tower is a frozen input (no gradient, no optimizer state) and stays bit-equal while the
  language model trains; zero_pixels blanks every image but keeps its tokens and layout."""
  trainer = sft.SFTTrainer(_cfg(tmp_path, steps=2, freeze_vision=True,
                                data={"image_task": {"n_train": 32, "n_heldout": 2, "image_size": 56},
                                      "zero_pixels": True, "num_patches": 32}))
  batch = next(trainer._batches(trainer.train_paths, epochs=1))
  assert len(batch.arrays["grid_thw"]) and not batch.arrays["pixel_values"].any()
  assert batch.arrays["image_segments"].any()  # the images are still laid out, only blank
  assert "visual" not in trainer.state.params and "visual" in trainer.frozen[0]
  tower = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.frozen[0]))
  embed = np.asarray(nnx.to_pure_dict(trainer.state.params)["embed"])
  trainer.run()
  for a, b in zip(jax.tree.leaves(tower), jax.tree.leaves(nnx.to_pure_dict(nnx.state(trainer.current_model().visual, nnx.Param)))):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert not np.array_equal(embed, np.asarray(nnx.to_pure_dict(trainer.state.params)["embed"]))
  with pytest.raises(ValueError, match="data.images.patch_size=16 differs from the model's vision tower"):
    sft.SFTTrainer(_cfg(tmp_path / "b", data={"images": {"patch_size": 16}}))
  with pytest.raises(ValueError, match="data.image_task: model 'tiny' has no vision tower"):
    sft.SFTTrainer(_cfg(tmp_path / "c", model={"preset": "tiny"}, tokenizer=None))


def test_caption_task_is_sft_data(tmp_path):
  """data.caption_task: the built-in caption task written as SFT records (image + prompt -> the scene's reference
  caption), its scene knobs applied; it and data.image_task are exclusive."""
  task = {"n_train": 12, "n_heldout": 2, "difficulty": 0, "image_size": 56, "max_objects": 1, "shape_scale": 3.0}
  trainer = sft.SFTTrainer(_cfg(tmp_path, data={"caption_task": task, "num_patches": 32}))
  records = [json.loads(line) for line in Path(trainer.train_paths[0]).read_text().splitlines()]
  assert len(records) == 12
  for r in records:
    assert r["messages"][1]["content"] == data_lib.scene_caption(r["scene"]) and len(r["scene"]["objects"]) == 1
  batch = next(trainer._batches(trainer.train_paths, epochs=1))
  assert batch.arrays["pixel_values"].any() and batch.arrays["image_segments"].any()
  with pytest.raises(ValueError, match="data.image_task or data.caption_task, not both"):
    _cfg(tmp_path / "b", data={"caption_task": task, "image_task": {"image_size": 56}})


def test_exported_sft_vlm_loads_in_transformers_with_the_same_logits():
  """tests/fixtures/make_vl_sft_export.py: `jaxrl sft` on configs/sft_vl_tiny.yaml, its hf/ directory through
  transformers' Qwen2_5_VLForConditionalGeneration against jaxrl on held-out image prompts."""
  fixtures = Path(__file__).parents[1] / "fixtures"
  meta = json.loads((fixtures / "hf" / "vl_sft_export.json").read_text())
  spec = importlib.util.spec_from_file_location("fixture_digest", fixtures / "fixture_digest.py")
  digest = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(digest)
  assert meta["source_sha256"] == digest.source_digest(fixtures / "make_vl_sft_export.py"), "regenerate the JSON"
  assert meta["prompts"] >= 4 and meta["max_abs_logit"] > 1.0
  assert meta["max_abs_diff"] <= 1e-4 * meta["max_abs_logit"], meta
