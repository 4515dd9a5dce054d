"""LoRA on vision-language models: adapters on the decoder, the vision tower's blocks and the merger; PEFT export
that loads in ``peft`` with the same logits; merging, switching off, unstacking; SFT that trains only adapters.

References: ``tests/fixtures/make_vl_peft_fixture.py`` (jaxrl's adapter loaded by ``peft.PeftModel`` into
transformers' Qwen2.5-VL / Qwen2-VL, float32 logits of the left-padded reference batch), and jaxrl's own base
model (adapters with B = 0, switched off, merged) for the invariants.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module", params=KINDS)
def adapted(request):
  """(kind, base model with the fixture's PEFT adapter loaded, reference batch, model inputs)."""
  kind = request.param
  model = models.load_peft(models.load_pretrained(FIXTURES / "hf" / kind, dtype="float32"),
                           FIXTURES / "peft" / f"jaxrl_{kind}")
  ref = dict(np.load(FIXTURES / "hf" / kind / "reference.npz"))
  inputs, _ = _inputs(model, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  return kind, model, ref, inputs


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


def test_save_peft_round_trip_keys_and_target_regex(adapted, tmp_path):
  """save_peft writes transformers 5's module paths and a regex that names exactly the adapted modules; a looped
  (scan_layers=False) base reads the file back to the same logits; hub-style keys (``visual.*``,
  ``model.layers.*``) read too."""
  kind, model, ref, inputs = adapted
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


def test_merge_unmerge_switch_off_and_unstack_keep_the_tower_exact(adapted):
  """merge_lora folds the tower's adapters too (same logits, once: no double count), lora_disabled runs the base
  tower, unstack_layers of a merged model keeps them folded, unmerge_lora restores the adapter forward."""
  kind, model, ref, inputs = adapted
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
