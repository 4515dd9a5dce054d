"""Hugging Face interop: fixture logits, save/load round trips, transformers loading, bad inputs."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from model_testlib import FIXTURE_NAMES, HF_FIXTURES, arange_positions, cached_step, forward
from safetensors.numpy import load_file, save_file

from jaxrl import models
from jaxrl.models import ModelConfig
from jaxrl.models._hf import _BLOCK_LAYOUTS, _Layout


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_transformers_reference(fixture_models, name):
  ref = np.load(HF_FIXTURES / name / "reference.npz")
  tokens = ref["tokens"]
  got = forward(fixture_models[name], tokens, arange_positions(tokens), np.ones_like(tokens))
  assert got.dtype == jnp.float32 and got.shape == ref["logits"].shape
  np.testing.assert_allclose(np.asarray(got), ref["logits"], rtol=0, atol=1e-4)


def test_fixtures_cover_each_checkpoint_variant(fixture_models):
  llama, qwen2, qwen3 = (fixture_models[n].cfg for n in FIXTURE_NAMES)
  assert (HF_FIXTURES / "llama_gqa" / "model.safetensors.index.json").exists()  # sharded
  assert "rope_scaling" in json.loads((HF_FIXTURES / "llama_gqa" / "config.json").read_text())  # v4 layout
  assert llama.rope_scaling is not None and llama.num_heads == 3 * llama.num_kv_heads and not llama.tie_word_embeddings
  assert "rope_parameters" in json.loads((HF_FIXTURES / "qwen2_tied" / "config.json").read_text())  # v5 layout
  header = load_file(HF_FIXTURES / "qwen2_tied" / "model.safetensors")
  assert {str(v.dtype) for v in header.values()} == {"bfloat16"}
  assert qwen2.attention_bias and qwen2.tie_word_embeddings and fixture_models["qwen2_tied"].lm_head is None
  assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size


def test_llama3_scaling_moves_rope_angles_in_the_fixture(fixture_models):
  import dataclasses
  cfg = fixture_models["llama_gqa"].cfg
  t = np.load(HF_FIXTURES / "llama_gqa" / "reference.npz")["tokens"].shape[1]
  scaled = models.rope_frequencies(cfg)
  plain = models.rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
  # the reference positions turn the scaled and unscaled angles apart by radians, so the logit test sees it
  assert (t - 1) * np.abs(scaled - plain).max() > 1.0
  assert (scaled != plain).sum() >= 2 and (scaled == plain).any()


def test_default_compute_dtype_follows_the_checkpoint_over_float32_weights():
  model = models.load_pretrained(HF_FIXTURES / "qwen2_tied")  # a bf16 checkpoint
  assert (model.cfg.dtype, model.cfg.param_dtype) == ("bfloat16", "float32")
  assert model.embed.get_value().dtype == jnp.float32
  model = models.load_pretrained(HF_FIXTURES / "qwen3")
  assert (model.cfg.dtype, model.cfg.param_dtype) == ("float32", "float32")


def test_greedy_decode_through_cache_matches_transformers_generate():
  """Teacher-forced on HF's greedy tokens, cached decoding (loop layers) reproduces HF's per-step logits."""
  ref = np.load(HF_FIXTURES / "qwen3" / "generate.npz")
  prompt, new, hf_logits = ref["prompt"], ref["tokens"], ref["logits"]
  model = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32", scan_layers=False)
  b, p = prompt.shape
  cache = models.KVCache.init(model.cfg, b, 32)
  seq = np.concatenate([prompt, new], axis=1)
  logits, cache = cached_step(model, cache, prompt, arange_positions(prompt), np.ones_like(prompt), np.zeros(b))
  ours = [np.asarray(logits[:, -1])]
  for t in range(new.shape[1] - 1):
    pos = np.full((b, 1), p + t, np.int32)
    logits, cache = cached_step(model, cache, seq[:, p + t:p + t + 1], pos, np.ones_like(pos), pos[:, 0])
    ours.append(np.asarray(logits[:, 0]))
  ours = np.stack(ours, axis=1)
  np.testing.assert_allclose(ours, hf_logits, rtol=0, atol=1e-4)
  np.testing.assert_array_equal(ours.argmax(-1), new)


def _flat_params(model) -> dict:
  from flax import nnx
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_save_then_load_is_bit_exact(fixture_models, tmp_path):
  model = fixture_models["llama_gqa"]
  models.save_pretrained(model, tmp_path, max_shard_bytes=50_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
  assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
  reloaded = models.load_pretrained(tmp_path, dtype="float32")
  assert reloaded.cfg == model.cfg
  want, got = _flat_params(model), _flat_params(reloaded)
  assert want.keys() == got.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg="/".join(map(str, path)))


def test_save_matches_the_original_hf_tensors(fixture_models, tmp_path):
  models.save_pretrained(fixture_models["qwen3"], tmp_path)
  ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(HF_FIXTURES / "qwen3" / "model.safetensors")
  assert ours.keys() == theirs.keys()
  for key in theirs:
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_bfloat16_save_rounds_each_parameter(fixture_models, tmp_path):
  model = fixture_models["qwen3"]
  models.save_pretrained(model, tmp_path, dtype="bfloat16")
  reloaded = models.load_pretrained(tmp_path, param_dtype="bfloat16")
  assert (reloaded.cfg.dtype, reloaded.cfg.param_dtype) == ("bfloat16", "bfloat16")
  want, got = _flat_params(model), _flat_params(reloaded)
  for path in want:
    np.testing.assert_array_equal(got[path], want[path].astype(jnp.bfloat16), err_msg="/".join(map(str, path)))


def test_loop_model_saves_the_same_checkpoint_as_scan(fixture_models, tmp_path):
  loop = models.load_pretrained(HF_FIXTURES / "qwen2_tied", dtype="float32", scan_layers=False)
  models.save_pretrained(loop, tmp_path / "loop")
  models.save_pretrained(fixture_models["qwen2_tied"], tmp_path / "scan")
  a, b = load_file(tmp_path / "loop" / "model.safetensors"), load_file(tmp_path / "scan" / "model.safetensors")
  assert a.keys() == b.keys() and "lm_head.weight" not in a
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_saved_directory_is_read_by_transformers(fixture_models, tmp_path):
  tok = models.load_tokenizer(HF_FIXTURES / "llama_gqa")
  models.save_pretrained(fixture_models["llama_gqa"], tmp_path, tokenizer=tok,
                         generation_config={"do_sample": False, "eos_token_id": tok.eos_token_id})
  hf = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
  assert type(hf).__name__ == "LlamaConfig"
  assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["original_max_position_embeddings"] == 64
  assert hf.eos_token_id == tok.eos_token_id
  assert models.load_tokenizer(tmp_path).encode("What is 12 + 30?") == tok.encode("What is 12 + 30?")
  assert json.loads((tmp_path / "generation_config.json").read_text())["do_sample"] is False


def test_transformers_loads_jaxrl_checkpoints_to_identical_logits(source_digest):
  """Recorded by tests/fixtures/make_hf_fixtures.py, which has torch: jaxrl save -> HF from_pretrained."""
  meta = json.loads((HF_FIXTURES / "jaxrl_to_hf.json").read_text())
  script = HF_FIXTURES.parent / "make_hf_fixtures.py"
  assert meta.get("source_sha256") == source_digest(script), (
      f"{HF_FIXTURES / 'jaxrl_to_hf.json'} was written by another version of {script.name}: regenerate it "
      "(the script's docstring says how)")
  results = meta["results"]
  assert set(results) == {f"{n}/{v}" for n in FIXTURE_NAMES for v in ("plain", "sharded", "bfloat16", "loop_layers")}
  for key, r in results.items():
    assert r["max_abs_diff"] <= 1e-4, (key, r)
    assert r["max_abs_logit"] > 1.0, (key, r)  # logits large enough for the comparison to mean something
    assert (r["safetensors_files"] > 1) == key.endswith("/sharded"), (key, r)


@pytest.mark.parametrize("layout_key", sorted(_BLOCK_LAYOUTS, key=str))
def test_layout_slices_equal_slices_of_the_full_conversion(layout_key):
  layout: _Layout = _BLOCK_LAYOUTS[layout_key]
  ours_shape = {(0,): (8,), (0, 1): (6, 8), (1, 0): (6, 8), (2, 0, 1): (12, 6, 8), (1, 2, 0): (6, 8, 12)}[layout.perm]
  rng = np.random.default_rng(0)
  ours = rng.normal(size=ours_shape).astype(np.float32)
  hf = layout.to_hf(ours)
  assert hf.shape == layout.hf_shape(ours_shape)
  for _ in range(5):
    index = []
    for n in ours_shape:
      a = int(rng.integers(0, n))
      b = int(rng.integers(a + 1, n + 1))
      index.append(slice(a, b))
    got = layout.read(lambda i: hf[i], ours_shape, index)
    np.testing.assert_array_equal(got, ours[tuple(index)])


# ------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.fixture
def qwen3_copy(tmp_path):
  dst = tmp_path / "qwen3"
  shutil.copytree(HF_FIXTURES / "qwen3", dst)
  return dst


def test_missing_shard_named_in_index_is_an_error(tmp_path):
  dst = tmp_path / "llama"
  shutil.copytree(HF_FIXTURES / "llama_gqa", dst)
  (dst / "model-00002-of-00005.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json maps tensor '.*' to shard "
                                               r"'model-00002-of-00005\.safetensors', but .* does not exist"):
    models.load_pretrained(dst)


def test_shape_mismatch_names_key_expected_and_got(qwen3_copy):
  cfg = json.loads((qwen3_copy / "config.json").read_text())
  cfg["intermediate_size"] = 64
  (qwen3_copy / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"qwen3/model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' "
                                       r"has shape \[48, 96\], expected \[48, 64\] from config\.json"):
    models.load_pretrained(qwen3_copy)


def test_missing_tensor_key_is_named(qwen3_copy):
  tensors = load_file(qwen3_copy / "model.safetensors")
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  save_file(tensors, qwen3_copy / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(KeyError, match=r"no tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
    models.load_pretrained(qwen3_copy)


def test_unused_tensor_is_an_error(qwen3_copy):
  tensors = load_file(qwen3_copy / "model.safetensors")
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(48, np.float32)
  save_file(tensors, qwen3_copy / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"not used by a qwen3 model: \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
    models.load_pretrained(qwen3_copy)


def test_unknown_model_type_names_the_file(qwen3_copy):
  cfg = json.loads((qwen3_copy / "config.json").read_text())
  cfg["model_type"] = "gemma3"
  (qwen3_copy / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"qwen3/config\.json: model_type 'gemma3' is not supported"):
    models.load_pretrained(qwen3_copy)


def test_missing_checkpoint_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    models.load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_config()))
  with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
    models.load_pretrained(tmp_path)


def test_tokenizer_larger_than_embedding_is_refused(tmp_path):
  tok = models.load_tokenizer(HF_FIXTURES / "qwen3")
  assert len(tok) <= 256
  models.check_tokenizer(tok, ModelConfig.tiny(vocab_size=len(tok)))
  small = ModelConfig.tiny(vocab_size=len(tok) - 1)
  with pytest.raises(ValueError, match=rf"tokenizer has {len(tok)} tokens .* vocab_size={len(tok) - 1} rows"):
    models.check_tokenizer(tok, small)
  with pytest.raises(ValueError, match="vocab_size=64 rows"):
    models.load_pretrained(HF_FIXTURES / "qwen3", tokenizer=models.load_tokenizer(HF_FIXTURES / "qwen3"),
                           vocab_size=64)
  model = models.abstract_model(small)
  with pytest.raises(ValueError, match="tokenizer has"):
    models.save_pretrained(model, tmp_path, tokenizer=tok)
  assert not any(tmp_path.iterdir())


def test_load_tokenizer_without_files_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer files"):
    models.load_tokenizer(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    models.load_tokenizer(tmp_path / "nope")
