"""``scripts/deepen_hf.py``: appended identity blocks leave the logits unchanged (the deeper reward-model trunk)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl import data, models

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "deepen_hf.py"
TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "dtype": "float32", "param_dtype": "float32"}


def _script():
  spec = importlib.util.spec_from_file_location("deepen_hf", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _logits(path, tokens):
  model = models.load_pretrained(path, dtype="float32", param_dtype="float32")
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(model(tokens, positions=positions, segment_ids=np.ones_like(tokens)), np.float64)


def test_deepened_checkpoint_computes_the_same_logits(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  model = models.ModelSource(preset="tiny", seed=3, overrides=TINY).build()
  models.save_pretrained(model, src, tokenizer=models.load_tokenizer(data.tiny_tokenizer_dir()))
  assert _script().deepen(src, dst, 2) == 4
  assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 4
  w = load_file(str(next(dst.glob("*.safetensors"))))
  layer = "model.layers.{}.{}.weight".format
  assert not np.any(w[layer(3, "mlp.down_proj")]) and not np.any(w[layer(2, "self_attn.o_proj")])
  np.testing.assert_array_equal(w[layer(3, "self_attn.q_proj")], w[layer(1, "self_attn.q_proj")])
  tokens = np.random.default_rng(0).integers(3, 128, size=(2, 12)).astype(np.int32)
  before, after = _logits(src, tokens), _logits(dst, tokens)
  assert np.std(before) > 0.01  # a random model: logits that would move if a block were not the identity
  np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="--extra must be >= 1"):
    _script().deepen(src, tmp_path / "x", 0)
