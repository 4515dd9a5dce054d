"""LoRA on vision-language models: adapters on the decoder, the vision tower's blocks and the merger; PEFT export
that loads in ``peft`` with the same logits; merging, switching off, unstacking; SFT that trains only adapters.

References: ``tests/fixtures/make_vl_peft_fixture.py`` (jaxrl's adapter loaded by ``peft.PeftModel`` into
transformers' Qwen2.5-VL / Qwen2-VL, float32 logits of the left-padded reference batch), and jaxrl's own base
model (adapters with B = 0, switched off, merged) for the invariants.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_vlm import _inputs

from jaxrl import config as config_lib
from jaxrl import models, sampling, sft

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPORT = json.loads((FIXTURES / "peft" / "vl_peft_logits.json").read_text())
KINDS = ("qwen2_5_vl", "qwen2_vl")


def _digest() -> str:
  spec = importlib.util.spec_from_file_location("fixture_digest", FIXTURES / "fixture_digest.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.source_digest(FIXTURES / "make_vl_peft_fixture.py")


@functools.cache
def _load(kind: str):
  """(kind, base model with the fixture's PEFT adapter loaded, reference batch, model inputs), once per kind."""
  model = models.load_peft(models.load_pretrained(FIXTURES / "hf" / kind, dtype="float32"),
                           FIXTURES / "peft" / f"jaxrl_{kind}")
  ref = dict(np.load(FIXTURES / "hf" / kind / "reference.npz"))
  inputs, _ = _inputs(model, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  return kind, model, ref, inputs


@pytest.fixture(params=KINDS)
def adapted(request):
  return _load(request.param)


def _logits(model, ref, inputs) -> np.ndarray:
  return np.asarray(model(jnp.asarray(ref["input_ids"], jnp.int32), **inputs))  # [B, T, V]


def _rel_to_peft(kind: str, logits: np.ndarray) -> float:
  """max |ours - peft| / max |peft| over the recorded positions of every row."""
  rep = REPORT[kind]
  diffs = [np.abs(logits[r, row["positions"]] - np.asarray(row["logits"])).max() for r, row in enumerate(rep["rows"])]
  return float(max(diffs) / rep["max_abs_logit"])


def test_fixture_is_current():
  assert REPORT["source_sha256"] == _digest(), "regenerate tests/fixtures/peft/vl_peft_logits.json"


def test_adapter_on_decoder_tower_and_merger_gives_the_peft_logits(adapted):
  """peft.PeftModel with jaxrl's adapter (decoder + every tower projection + merger) on transformers' VLM."""
  kind, model, ref, inputs = adapted
  assert model.lora_config.vision_modules and models.has_lora(model)
  assert hasattr(model.visual.blocks, "qkv_lora_a") and hasattr(model.visual.merger, "fc2_lora_b")
  logits = _logits(model, ref, inputs)
  assert _rel_to_peft(kind, logits) <= 1e-4
  # The tower's adapters matter: without them (B = 0) the image rows move far beyond the tolerance.
  graphdef, adapters, base = models.split_lora(model)
  no_tower = nnx.map_state(lambda path, v: v.replace(jnp.zeros_like(v[...])) if "visual" in map(str, path)
                           and str(path[-1]).endswith("lora_b") else v, adapters)
  assert _rel_to_peft(kind, _logits(nnx.merge(graphdef, no_tower, base), ref, inputs)) > 1e-2


def test_save_peft_round_trip_keys_and_target_regex(tmp_path):
  """save_peft writes transformers 5's module paths and a regex that names exactly the adapted modules; a looped
  (scan_layers=False) base reads the file back to the same logits; hub-style keys (``visual.*``,
  ``model.layers.*``) read too."""
  kind, model, ref, inputs = _load("qwen2_5_vl")
  models.save_peft(model, tmp_path / "a")
  src = FIXTURES / "peft" / f"jaxrl_{kind}"
  ours = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
  theirs = load_file(str(src / "adapter_model.safetensors"))
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in ours)
  assert "base_model.model.model.visual.merger.mlp.0.lora_A.weight" in ours
  assert "base_model.model.model.language_model.layers.1.mlp.down_proj.lora_B.weight" in ours
  regex = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"]
  assert re.fullmatch(regex, "model.visual.blocks.3.attn.qkv") and re.fullmatch(regex, "model.visual.merger.mlp.2")
  assert re.fullmatch(regex, "model.language_model.layers.0.mlp.gate_proj") and not re.fullmatch(regex, "lm_head")
  hub = tmp_path / "hub"
  hub.mkdir()
  shutil.copy(src / "adapter_config.json", hub)
  renamed = {k.replace("model.model.visual.", "model.visual.").replace("model.language_model.", "model."): v
             for k, v in theirs.items()}
  save_file(renamed, str(hub / "adapter_model.safetensors"))
  looped = models.load_pretrained(FIXTURES / "hf" / kind, dtype="float32", scan_layers=False)
  models.load_peft(looped, hub)
  assert _rel_to_peft(kind, _logits(looped, ref, inputs)) <= 1e-4


def test_merge_unmerge_switch_off_and_unstack_keep_the_tower_exact():
  """merge_lora folds the tower's adapters too (same logits, once: no double count), lora_disabled runs the base
  tower, unstack_layers of a merged model keeps them folded, unmerge_lora restores the adapter forward (on
  Qwen2-VL; its fc1/fc2 tower and Qwen2.5-VL's share the site code)."""
  kind, model, ref, inputs = _load("qwen2_vl")
  want = _logits(model, ref, inputs)
  base = models.load_pretrained(FIXTURES / "hf" / kind, dtype="float32")
  with models.lora_disabled(model):
    off = _logits(model, ref, inputs)
  np.testing.assert_allclose(off, _logits(base, ref, inputs), rtol=0, atol=1e-5)
  models.merge_lora(model)
  try:
    scale = float(np.abs(want).max())
    assert np.abs(_logits(model, ref, inputs) - want).max() <= 1e-4 * scale
    flat = sampling.unstack_layers(model)
    assert np.abs(_logits(flat, ref, inputs) - want).max() <= 1e-4 * scale
    plain = models.merged_base(models.unmerge_lora(model))
    assert not hasattr(plain.visual.blocks, "qkv_lora_a")
    assert np.abs(_logits(plain, ref, inputs) - want).max() <= 1e-4 * scale
  finally:
    if models.has_merged_lora(model):
      models.unmerge_lora(model)
  np.testing.assert_allclose(_logits(model, ref, inputs), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def test_vision_targets_select_modules_and_bad_ones_are_refused():
  cfg = models.LoraConfig(rank=2, targets=(), vision_targets=("attn", "merger.fc2"))
  assert cfg.modules == () and cfg.vision_modules == ("qkv", "proj", "merger.fc2")
  assert models.LoraConfig(vision_targets="mlp").vision_modules == ("gate", "up", "down", "fc1", "fc2")
  with pytest.raises(ValueError, match=r"lora\.vision_targets: unknown names \['blocks'\]"):
    models.LoraConfig(vision_targets=("blocks",))
  with pytest.raises(ValueError, match="lora.targets: empty list"):
    models.LoraConfig(targets=())
  text = models.load_pretrained(FIXTURES / "hf" / "qwen3", dtype="float32")
  with pytest.raises(ValueError, match=r"lora\.vision_targets=\['all'\]: model_type 'qwen3' has no vision tower"):
    models.apply_lora(text, models.LoraConfig(vision_targets="all"))
  vlm = models.abstract_model(models.load_pretrained(FIXTURES / "hf" / "qwen2_vl", dtype="float32").cfg)
  models.apply_lora(vlm, cfg)
  assert hasattr(vlm.visual.blocks, "qkv_lora_a") and hasattr(vlm.visual.merger, "fc2_lora_b")
  assert not hasattr(vlm.visual.merger, "fc1_lora_a") and not hasattr(vlm.visual.blocks, "fc1_lora_a")
  assert not hasattr(vlm.layers.attn, "q_proj_lora_a")


def test_sft_with_tower_adapters_trains_only_adapters_and_exports_them(tmp_path):
  """`jaxrl sft` with `lora.vision_targets`: the optimizer holds adapters only (decoder, tower blocks, merger),
  every base weight (the tower's included) stays bit-equal, the adapters' B leave zero, and the PEFT adapter
  (save_peft, as the run's export) holds the tower's modules."""
  tiny_vl = {"preset": "tiny_vl", "overrides": {"vocab_size": 128, "vision_start_token_id": 4,
                                                 "vision_end_token_id": 5, "image_token_id": 6, "video_token_id": 7}}
  base = {
      "model": tiny_vl, "tokenizer": str(FIXTURES / "hf" / "qwen2_5_vl"),
      "data": {"image_task": {"n_train": 32, "n_heldout": 2, "difficulty": 0, "image_size": 56, "seed": 0},
               "num_patches": 32},
      "packing": {"seq_len": 128, "global_rows": 8, "buffer_size": 8},
      "optim": {"lr": 3e-3, "warmup_steps": 0}, "steps": 1, "eval": {"every": 0, "exact_match": 0},
      "lora": {"rank": 2, "targets": "attn", "vision_targets": ["attn", "merger"]},
      "out_dir": str(tmp_path / "run"), "export_hf": False, "tensorboard": False,
  }
  with pytest.raises(ValueError, match=r"freeze_vision: true contradicts lora.vision_targets=\['attn', 'merger'\]"):
    config_lib.from_dict(sft.SFTConfig, {**base, "freeze_vision": True})
  trainer = sft.SFTTrainer(config_lib.from_dict(sft.SFTConfig, base))
  trained = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(trainer.state.params)}
  assert trained and all(p.endswith(("_lora_a", "_lora_b")) for p in trained)
  assert {"visual/blocks/qkv_lora_b", "visual/merger/fc1_lora_a", "layers/attn/q_proj_lora_b"} <= trained
  assert not any("up_lora" in p or "gate_lora" in p for p in trained)  # the tower's MLP was not targeted
  frozen = jax.tree.map(np.array, nnx.to_pure_dict(trainer.frozen[0]))
  trainer.run()
  for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(frozen),
                                   jax.tree.leaves(nnx.to_pure_dict(trainer.frozen[0]))):
    np.testing.assert_array_equal(before, np.asarray(after), err_msg=jax.tree_util.keystr(path))
  params = nnx.to_pure_dict(trainer.state.params)
  for b in (params["visual"]["blocks"]["proj_lora_b"], params["visual"]["merger"]["fc2_lora_b"],
            params["layers"]["attn"]["o_proj_lora_b"]):
    assert np.abs(np.asarray(b)).max() > 0
  models.save_peft(trainer.current_model(), tmp_path / "adapter")  # what the run's export writes
  keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  assert "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight" in keys
  assert "base_model.model.model.visual.merger.mlp.2.lora_A.weight" in keys
