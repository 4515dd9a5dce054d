"""Qwen2.5-VL / Qwen2-VL through the one Transformer: M-RoPE positions, logits, cache decode, packing, checkpoints.

References: the transformers 5.24 fixtures of ``tests/fixtures/make_vlm_fixtures.py`` (``get_rope_index``
positions and deltas, float32 logits of a left-padded batch, greedy ``generate``), a hand-worked
``get_rope_index`` example, and the plain Qwen2 text model with the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors import safe_open

from jaxrl import models, sharding

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
KINDS = ("qwen2_5_vl", "qwen2_vl")


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
  """(kind, model in float32, reference.npz) for each fixture."""
  kind = request.param
  model = models.load_pretrained(FIXTURES / kind, dtype="float32")
  return kind, model, dict(np.load(FIXTURES / kind / "reference.npz"))


def _inputs(model, tokens, segment_ids, pixel_values, grid_thw):
  """Positions, M-RoPE positions, deltas and VisionInputs of packed rows."""
  seg = np.asarray(segment_ids, np.int32)
  pos = np.zeros_like(seg)
  for row in range(seg.shape[0]):
    for s in np.unique(seg[row][seg[row] > 0]):
      where = seg[row] == s
      pos[row, where] = np.arange(where.sum())
  rope, deltas = models.mrope_positions(tokens, seg, grid_thw, model.cfg)
  images = None
  if len(grid_thw):
    images = jax.tree.map(jnp.asarray, per_row_images(model.cfg, tokens, pixel_values, grid_thw))
  return dict(positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg), rope_positions=jnp.asarray(rope),
              images=images), deltas


def per_row_images(cfg, tokens, pixel_values, grid_thw, num_patches=None):
  """Per-row :class:`VisionInputs` (numpy) of images given in row-major token order: each image goes to the
  row whose image tokens it fills (``t·h·w / m²`` of them), its patches to that row's patch sequence."""
  grid = np.asarray(grid_thw).reshape(-1, 3)
  m2 = cfg.vision.spatial_merge_size ** 2
  counts = (np.asarray(tokens) == cfg.image_token_id).sum(axis=1)  # image tokens per row
  rows, r = [], 0
  for g in grid:
    while counts[r] == 0:
      r += 1
    counts[r] -= int(np.prod(g)) // m2
    assert counts[r] >= 0, "an image spans two rows"
    rows.append(r)
  sizes = np.prod(grid, axis=1)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  per_row = [[k for k in range(len(grid)) if rows[k] == row] for row in range(len(counts))]
  widest = max(int(sizes[ks].sum()) for ks in per_row)
  num_patches = num_patches or -(-widest // m2) * m2
  pixels = np.zeros((len(counts), num_patches, cfg.vision.patch_dim), np.float32)
  for row, ks in enumerate(per_row):
    row_pixels = [np.asarray(pixel_values)[starts[k]:starts[k + 1]] for k in ks]
    if row_pixels:
      joined = np.concatenate(row_pixels)
      pixels[row, :len(joined)] = joined
  return models.batch_vision_inputs(pixels, grid, rows, cfg.vision)


def _logits(model, tokens, inputs, **override):
  kw = {**inputs, **override}
  return np.asarray(model(jnp.asarray(tokens, jnp.int32), **kw))


def _rel(got, want) -> float:
  return float(np.abs(got - want).max() / np.abs(want).max())


# --------------------------------------------------------------------------------------------------
# M-RoPE positions


@pytest.mark.parametrize("kind", KINDS)
def test_mrope_positions_equal_get_rope_index(kind):
  cfg = models.config_from_dir(FIXTURES / kind)
  ref = np.load(FIXTURES / kind / "reference.npz")
  mask = ref["attention_mask"].astype(bool)
  rope, deltas = models.mrope_positions(ref["input_ids"], ref["attention_mask"], ref["image_grid_thw"], cfg)
  want = np.moveaxis(ref["position_ids"], 0, -1)  # [B, T, 3]
  np.testing.assert_array_equal(rope[mask], want[mask])
  np.testing.assert_array_equal(rope[~mask], 0)
  np.testing.assert_array_equal(deltas, np.where(mask, ref["rope_deltas"], 0))
  assert ref["rope_deltas"][0, 0] != 0  # the fixture exercises a non-trivial delta


def test_mrope_positions_hand_worked():
  cfg = models.ModelConfig.tiny_vl()
  vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
  # text, an image of 4x4 patches (2x2 merged), text; then a second sequence in the same row: text,
  # an image of 2x6 patches (1x3 merged), text.
  seq0 = [11, 12, vs, img, img, img, img, ve, 13, 14]
  seq1 = [21, vs, img, img, img, ve, 22]
  tokens = np.asarray([seq0 + seq1 + [0, 0]])
  segs = np.asarray([[1] * 10 + [2] * 7 + [0, 0]])
  rope, deltas = models.mrope_positions(tokens, segs, np.asarray([[1, 4, 4], [1, 2, 6]]), cfg)
  t0 = [0, 1, 2, 3, 3, 3, 3, 5, 6, 7]  # image at start 3: (t, h, w) = 3 + (0, i, j); text resumes at 3 + 2
  h0 = [0, 1, 2, 3, 3, 4, 4, 5, 6, 7]
  w0 = [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
  t1 = [0, 1, 2, 2, 2, 5, 6]  # image at start 2, grid 1x3: text resumes at 2 + max(1, 3)
  h1 = [0, 1, 2, 2, 2, 5, 6]
  w1 = [0, 1, 2, 3, 4, 5, 6]
  want = np.stack([t0 + t1 + [0, 0], h0 + h1 + [0, 0], w0 + w1 + [0, 0]], -1)[None]
  np.testing.assert_array_equal(rope, want)
  # delta = max + 1 - length: 7 + 1 - 10 = -2 and 6 + 1 - 7 = 0
  np.testing.assert_array_equal(deltas, [[-2] * 10 + [0] * 7 + [0, 0]])
  np.testing.assert_array_equal(models.decode_rope_positions(np.asarray([[10]]), np.asarray([-2])), [[[8, 8, 8]]])


def test_mrope_positions_refuse_inconsistent_images():
  cfg = models.ModelConfig.tiny_vl()
  img = cfg.image_token_id
  tokens = np.asarray([[1, img, img, img, 2]])
  segs = np.ones_like(tokens)
  with pytest.raises(ValueError, match="needs 4 placeholder tokens"):
    models.mrope_positions(tokens, segs, np.asarray([[1, 4, 4]]), cfg)
  with pytest.raises(ValueError, match="grid_thw has 2 images but the tokens hold image placeholders for 1"):
    models.mrope_positions(tokens, segs, np.asarray([[1, 2, 6], [1, 2, 2]]), cfg)
  with pytest.raises(ValueError, match="video tokens"):
    models.mrope_positions(np.asarray([[1, cfg.video_token_id]]), np.ones((1, 2)), np.zeros((0, 3)), cfg)
  split = np.asarray([[1, 1, 2, 2, 2]])  # the image's 3 tokens straddle two sequences
  with pytest.raises(ValueError, match="segment 1: image 0"):
    models.mrope_positions(tokens, split, np.asarray([[1, 2, 6]]), cfg)


# --------------------------------------------------------------------------------------------------
# Logits


def test_logits_equal_transformers(vlm):
  _, model, ref = vlm
  inputs, _ = _inputs(model, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  got = _logits(model, ref["input_ids"], inputs)
  mask = ref["attention_mask"].astype(bool)
  for row in range(mask.shape[0]):  # two images, an image in a later turn, text only
    assert _rel(got[row][mask[row]], ref["logits"][row][mask[row]]) <= 1e-4, row


def test_one_dimensional_rope_positions_give_different_logits(vlm):
  _, model, ref = vlm
  inputs, _ = _inputs(model, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  flat = _logits(model, ref["input_ids"], inputs, rope_positions=None)  # 1-D positions on all axes
  mask = ref["attention_mask"].astype(bool)
  for row in (0, 1):  # the rows holding images
    assert _rel(flat[row][mask[row]], ref["logits"][row][mask[row]]) > 1e-2
  assert _rel(flat[2][mask[2]], ref["logits"][2][mask[2]]) <= 1e-4  # text only: 3-D positions are 1-D


def test_text_only_prompt_equals_the_plain_qwen2_model(vlm):
  _, model, ref = vlm
  cfg = model.cfg
  text_cfg = dataclasses.replace(cfg, model_type="qwen2", mrope_section=None, vision=None, image_token_id=None,
                                 video_token_id=None, vision_start_token_id=None, vision_end_token_id=None)
  text = models.Transformer(text_cfg, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  nnx.update(text, nnx.State({k: v for k, v in state.items() if k != "visual"}))
  tokens, seg = ref["input_ids"][2:], ref["attention_mask"][2:]
  inputs, deltas = _inputs(model, tokens, seg, None, np.zeros((0, 3), np.int64))
  assert not deltas.any()
  got = _logits(model, tokens, inputs)
  want = _logits(text, tokens, {k: inputs[k] for k in ("positions", "segment_ids")})
  np.testing.assert_allclose(got[seg.astype(bool)], want[seg.astype(bool)], rtol=0, atol=1e-6)


def test_packed_multimodal_rows_equal_separate_rows(vlm):
  _, model, ref = vlm
  mask = ref["attention_mask"].astype(bool)
  seq0, seq1 = ref["input_ids"][0][mask[0]], ref["input_ids"][1][mask[1]]
  packed = np.concatenate([seq0, seq1, [1, 1, 1]])[None]
  packed_seg = np.asarray([[1] * len(seq0) + [2] * len(seq1) + [0, 0, 0]])
  grid, pixels = ref["image_grid_thw"], ref["pixel_values"]  # images of rows 0 and 1, in token order
  n = int(np.prod(grid[:2], -1).sum())
  p_inputs, _ = _inputs(model, packed, packed_seg, pixels[:n + int(np.prod(grid[2]))], grid)
  got = _logits(model, packed, p_inputs)[0]
  s_inputs, _ = _inputs(model, ref["input_ids"][:2], ref["attention_mask"][:2], pixels, grid)
  separate = _logits(model, ref["input_ids"][:2], s_inputs)
  np.testing.assert_allclose(got[:len(seq0)], separate[0][mask[0]], rtol=0, atol=2e-5)
  np.testing.assert_allclose(got[len(seq0):len(seq0) + len(seq1)], separate[1][mask[1]], rtol=0, atol=2e-5)


# --------------------------------------------------------------------------------------------------
# Decoding with a KV cache


def test_cached_greedy_decode_equals_transformers_generate(vlm):
  kind, model, _ = vlm
  gen = np.load(FIXTURES / kind / "generate.npz")
  prompt = gen["prompt"].astype(np.int32)
  steps = gen["tokens"].shape[1]
  inputs, deltas = _inputs(model, prompt, np.ones_like(prompt), gen["pixel_values"], gen["image_grid_thw"])
  assert deltas[0, 0] != 0
  cache = models.KVCache.init(model.cfg, batch=1, max_len=prompt.shape[1] + steps)
  logits, cache = model(jnp.asarray(prompt), cache=cache, cache_start=jnp.zeros((1,), jnp.int32), **inputs)
  step = jax.jit(lambda m, tok, pos, rope, cache: m(tok, positions=pos, segment_ids=jnp.ones_like(tok),
                                                     rope_positions=rope, cache=cache, cache_start=pos[:, 0]))
  last, tokens, per_step = np.asarray(logits)[:, -1], [], []
  for i in range(steps):
    per_step.append(last)
    tokens.append(int(last[0].argmax()))
    pos = np.asarray([[prompt.shape[1] + i]], np.int32)
    rope = models.decode_rope_positions(pos, deltas[:, 0])
    out, cache = step(model, jnp.asarray([[tokens[-1]]], jnp.int32), jnp.asarray(pos), jnp.asarray(rope), cache)
    last = np.asarray(out)[:, -1]
  np.testing.assert_array_equal(tokens, gen["tokens"][0])
  assert _rel(np.stack(per_step, 1), gen["logits"]) <= 1e-4


# --------------------------------------------------------------------------------------------------
# Checkpoints


def test_save_load_round_trip_writes_the_hub_layout(vlm, tmp_path):
  kind, model, ref = vlm
  models.save_pretrained(model, tmp_path, dtype="float32")
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == kind and "text_config" not in hf and "vision_config" in hf
  assert hf["rope_scaling"]["mrope_section"] == list(model.cfg.mrope_section)
  with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
    keys = set(f.keys())
  assert any(k.startswith("visual.blocks.3.") for k in keys) and any(k.startswith("model.layers.1.") for k in keys)
  assert not any(k.startswith(("model.visual.", "model.language_model.")) for k in keys)
  loaded = models.load_pretrained(tmp_path, dtype="float32")
  assert loaded.cfg == model.cfg
  inputs, _ = _inputs(model, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  np.testing.assert_array_equal(_logits(loaded, ref["input_ids"], inputs), _logits(model, ref["input_ids"], inputs))


def test_convert_keeps_every_tensor(vlm, tmp_path):
  """``jaxrl convert`` of the bf16 fixture: the same bf16 tensors under hub names, and the tokenizer."""
  kind, model, _ = vlm
  models.convert(str(FIXTURES / kind), str(tmp_path))
  with safe_open(str(FIXTURES / kind / "model.safetensors"), framework="np") as src, \
      safe_open(str(tmp_path / "model.safetensors"), framework="np") as dst:
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): k for k in src.keys()}
    assert set(dst.keys()) == set(renamed)
    for key, old in renamed.items():
      np.testing.assert_array_equal(dst.get_tensor(key), src.get_tensor(old), err_msg=key)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  assert models.load_tokenizer(tmp_path).convert_tokens_to_ids("<|image_pad|>") == model.cfg.image_token_id


@pytest.mark.parametrize("scan_layers", [True, False])
def test_sharded_load_reads_each_slice_and_keeps_the_logits(vlm, scan_layers):
  """data2 x fsdp2 x tensor2: every tensor (tower and language model, stacked or per layer) equals the one-device load."""
  kind, model, ref = vlm
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  placed = models.load_pretrained(FIXTURES / kind, mesh=mesh, dtype="float32", scan_layers=scan_layers)
  q = (placed.layers if scan_layers else placed.layers[0]).attn.q_proj.get_value()
  assert tuple(q.sharding.spec)[-3:] == ("fsdp", "tensor", None)  # [D, N, H] split over the mesh
  single = models.load_pretrained(FIXTURES / kind, dtype="float32", scan_layers=scan_layers)
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(placed)), nnx.to_flat_state(nnx.state(single))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
  inputs, _ = _inputs(placed, ref["input_ids"], ref["attention_mask"], ref["pixel_values"], ref["image_grid_thw"])
  got = _logits(placed, ref["input_ids"], inputs)
  mask = ref["attention_mask"].astype(bool)
  assert _rel(got[mask], ref["logits"][mask]) <= 1e-4


def test_rows_sharded_over_data_give_the_one_device_logits(vlm):
  """Four rows (two images, a later-turn image, text only, two images again) with their per-row vision
  inputs split over data=4 (x tensor 2): the tower and the language model per shard equal one device."""
  kind, model, ref = vlm
  rows = [0, 1, 2, 0]
  tokens, seg = ref["input_ids"][rows], ref["attention_mask"][rows]
  order = [0, 1, 2, 0, 1]  # the images in row-major token order (row 0 holds two, row 1 one)
  offsets = np.concatenate([[0], np.cumsum(np.prod(ref["image_grid_thw"], axis=1))])
  pixels = np.concatenate([ref["pixel_values"][offsets[k]:offsets[k + 1]] for k in order])
  inputs, _ = _inputs(model, tokens, seg, pixels, ref["image_grid_thw"][order])
  assert inputs["images"].pixel_values.shape[0] == 4
  want = _logits(model, tokens, inputs)
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  placed = models.load_pretrained(FIXTURES / kind, mesh=mesh, dtype="float32")
  rowwise = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = jax.tree.map(lambda x: jax.device_put(x, rowwise), inputs)
  assert len(sharded["images"].pixel_values.sharding.device_set) == 8
  graphdef, state = nnx.split(placed)
  got = jax.jit(lambda st, tok, kw: nnx.merge(graphdef, st)(tok, **kw))(
      state, jax.device_put(jnp.asarray(tokens, jnp.int32), rowwise), sharded)
  mask = seg.astype(bool)
  assert _rel(np.asarray(got)[mask], want[mask]) <= 1e-5
  assert _rel(want[mask], ref["logits"][rows][mask]) <= 1e-4


def test_vl_config_reads_both_layouts_and_transformers_reads_ours():
  for kind in KINDS:
    hf = json.loads((FIXTURES / kind / "config.json").read_text())
    cfg = models.ModelConfig.from_hf_config(hf)
    assert (cfg.model_type, cfg.mrope_section, cfg.num_layers, cfg.vision.depth) == (kind, (2, 3, 3), 2, 4)
    ours = cfg.to_hf_config()
    back = getattr(transformers, "Qwen2_5_VLConfig" if kind == "qwen2_5_vl" else "Qwen2VLConfig")(**ours)
    text = back.text_config
    assert text.rope_parameters["mrope_section"] == [2, 3, 3] and text.hidden_size == cfg.hidden_size
    assert back.vision_config.depth == 4 and back.image_token_id == cfg.image_token_id
    assert models.ModelConfig.from_hf_config(back.to_dict()) == cfg  # transformers 5's nested layout


def test_vl_config_validation():
  cfg = models.ModelConfig.tiny_vl()
  with pytest.raises(ValueError, match=r"mrope_section: \[2, 3, 4\] sums to 9"):
    dataclasses.replace(cfg, mrope_section=(2, 3, 4))
  with pytest.raises(ValueError, match="vision: required for model_type 'qwen2_5_vl'"):
    dataclasses.replace(cfg, vision=None)
  with pytest.raises(ValueError, match="only vision-language models"):
    models.ModelConfig.tiny(model_type="qwen2", attention_bias=True, mrope_section=(2, 3, 3))
  with pytest.raises(ValueError, match="image_token_id: must be an int in"):
    dataclasses.replace(cfg, image_token_id=512)
  with pytest.raises(ValueError, match="out_hidden_size"):
    dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, out_hidden_size=32))
  with pytest.raises(ValueError, match="rope_positions: model_type 'llama'"):
    m = models.Transformer(models.ModelConfig.tiny(), rngs=nnx.Rngs(0))
    m(jnp.zeros((1, 2), jnp.int32), positions=jnp.zeros((1, 2), jnp.int32), segment_ids=jnp.ones((1, 2), jnp.int32),
      rope_positions=jnp.zeros((1, 2, 3), jnp.int32))


def test_vl_presets_count_the_tower():
  for name in ("qwen2p5_vl_3b", "qwen2p5_vl_7b", "qwen2_vl_2b"):
    cfg = models.PRESETS[name]()
    text = dataclasses.replace(cfg, model_type="qwen2", mrope_section=None, vision=None, image_token_id=None,
                               video_token_id=None, vision_start_token_id=None, vision_end_token_id=None)
    assert cfg.num_params() == text.num_params() + cfg.vision.num_params
    assert cfg.flops_per_token(2048) == text.flops_per_token(2048)
    with_images = cfg.flops_per_token(2048, patches_per_token=2.0, patches_per_image=1024)
    assert with_images > cfg.flops_per_token(2048)
  # published totals: Qwen2.5-VL-3B 3.75B, 7B 8.29B, Qwen2-VL-2B 2.21B parameters
  assert abs(models.ModelConfig.qwen2p5_vl_3b().num_params() / 1e9 - 3.75) < 0.01
  assert abs(models.ModelConfig.qwen2p5_vl_7b().num_params() / 1e9 - 8.29) < 0.01
  assert abs(models.ModelConfig.qwen2_vl_2b().num_params() / 1e9 - 2.21) < 0.01
