"""The vision tower against transformers (tests/fixtures/make_vlm_fixtures.py) and its host-side layout."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testlib import HF_FIXTURES
from safetensors import safe_open

from jaxrl import models
from jaxrl.models import VisionConfig, VisionTower, batch_vision_inputs, stack_layouts, vision_layout
from jaxrl.sharding import make_mesh
from jaxrl.models._vision import VISION_HF_LAYOUTS
from jaxrl.models._vl_config import vision_flops_per_patch

KINDS = ("qwen2_5_vl", "qwen2_vl")
PREFIX = {"qwen2_5_vl": "model.visual.", "qwen2_vl": "visual."}  # transformers-5 module keys | hub keys


def tiny(kind: str) -> VisionConfig:
  """The fixtures' towers, read back from their config.json (nested transformers-5 | flat hub layout)."""
  return VisionConfig.from_hf(json.loads((HF_FIXTURES / kind / "config.json").read_text())["vision_config"],
                              source=f"{kind}/config.json")


def load_tower(kind: str, *, scan_layers: bool = True) -> VisionTower:
  """A float32 tower with the fixture's (bf16) weights, mapped through VISION_HF_LAYOUTS by hand."""
  cfg = tiny(kind)
  tower = VisionTower(cfg, param_dtype=jnp.float32, dtype=jnp.float32, scan_layers=scan_layers, rngs=nnx.Rngs(0))
  used = set()
  with safe_open(HF_FIXTURES / kind / "model.safetensors", "flax") as f:
    def read(name, shape):
      name = PREFIX[kind] + name
      used.add(name)
      hf = np.asarray(f.get_tensor(name), np.float32)
      return hf.reshape(split).transpose(perm) if (split := _split(shape, perm)) else hf

    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
      if path[0] == "blocks":
        rel = path[1:] if scan_layers else path[2:]
        hf_name, _, perm = VISION_HF_LAYOUTS[tuple(rel)]
        layers = range(cfg.depth) if scan_layers else [int(path[1])]
        shape = var.shape[1:] if scan_layers else var.shape
        value = np.stack([read(hf_name.format(i=i), shape) for i in layers])
        var.set_value(jnp.asarray(value if scan_layers else value[0]))
      else:
        hf_name, _, perm = VISION_HF_LAYOUTS[tuple(path)]
        var.set_value(jnp.asarray(read(hf_name, var.shape)))
    assert used == {k for k in f.keys() if k.startswith(PREFIX[kind])}, "unused or missing tower tensors"
  return tower


def _split(ours, perm):
  split = [0] * len(ours)
  for j, p in enumerate(perm):
    split[p] = ours[j]
  return tuple(split)


def one_row(pixels, layout):
  """One row's patches ``[P, D]`` and layout as a batch of one row (device arrays)."""
  return jnp.asarray(pixels)[None], jax.tree.map(jnp.asarray, stack_layouts([layout]))


def run(tower, pixels, layout):
  """The tower on one row's images: ``[U, D_out]``."""
  graphdef, state = nnx.split(tower)
  return np.asarray(_run_static(graphdef)(state, *one_row(pixels, layout)))[0]


def _run_static(graphdef):
  return jax.jit(lambda state, pixels, layout: nnx.merge(graphdef, state)(pixels, layout))


def rel_err(ours, ref) -> float:
  return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=KINDS)
def case(request):
  kind = request.param
  return kind, load_tower(kind), dict(np.load(HF_FIXTURES / kind / "vision.npz"))


def test_fixtures_match_their_script():
  spec = importlib.util.spec_from_file_location("fixture_digest", HF_FIXTURES.parent / "fixture_digest.py")
  digest = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(digest)
  want = digest.source_digest(HF_FIXTURES.parent / "make_vlm_fixtures.py")
  for kind in KINDS:
    assert json.loads((HF_FIXTURES / kind / "meta.json").read_text())["source_sha256"] == want, (
        f"{kind}/ was written by another version of make_vlm_fixtures.py: regenerate it")


def test_tower_equals_transformers_all_images_in_one_call(case):
  kind, tower, ref = case
  ours = run(tower, ref["pixel_values"], vision_layout(ref["grid_thw"], tower.cfg))
  assert ours.shape == ref["tower_all"].shape == (25, 64)
  assert rel_err(ours, ref["tower_all"]) <= 1e-4, (kind, rel_err(ours, ref["tower_all"]))


def test_tower_equals_transformers_each_image_alone(case):
  kind, tower, ref = case
  offsets = np.concatenate([[0], np.cumsum(np.prod(ref["grid_thw"], axis=1))])
  for k in range(3):
    grid, pixels = ref["grid_thw"][k:k + 1], ref["pixel_values"][offsets[k]:offsets[k + 1]]
    ours = run(tower, pixels, vision_layout(grid, tower.cfg))
    assert rel_err(ours, ref[f"tower_{k}"]) <= 1e-4, (kind, k, rel_err(ours, ref[f"tower_{k}"]))


def test_bfloat16_compute_stays_close_to_transformers_float32(case):
  kind, tower, ref = case
  bf16 = VisionTower(tower.cfg, param_dtype=jnp.float32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  nnx.update(bf16, nnx.state(tower, nnx.Param))
  out = bf16(*one_row(ref["pixel_values"], vision_layout(ref["grid_thw"], tower.cfg)))[0]
  assert out.dtype == jnp.bfloat16
  assert rel_err(np.asarray(out, np.float32), ref["tower_all"]) <= 2e-2  # measured 0.85% on both kinds


def test_a_batch_of_rows_gives_each_rows_images_alone(case):
  """Rows [image 0], [images 2, 1], [no image] in one call: each row's output equals transformers on its own
  images, the image-less row is all zero (padding segments, no dummy image)."""
  kind, tower, ref = case
  offsets = np.concatenate([[0], np.cumsum(np.prod(ref["grid_thw"], axis=1))])
  patches = [ref["pixel_values"][offsets[k]:offsets[k + 1]] for k in range(3)]
  rows = [[0], [2, 1], []]
  pixels = np.zeros((3, 80, ref["pixel_values"].shape[1]), np.float32)
  for r, ks in enumerate(rows):
    if ks:
      row = np.concatenate([patches[k] for k in ks])
      pixels[r, :len(row)] = row
  order = [k for ks in rows for k in ks]
  images = batch_vision_inputs(pixels, ref["grid_thw"][order], [0, 1, 1], tower.cfg)
  assert images.layout.window_index.shape == (3, 20) and images.layout.rotary.shape == (3, 80, 2)
  graphdef, state = nnx.split(tower)
  out = np.asarray(_run_static(graphdef)(state, jnp.asarray(images.pixel_values),
                                         jax.tree.map(jnp.asarray, images.layout)))  # [3, 20, 64]
  assert rel_err(out[0, :15], ref["tower_0"]) <= 1e-4
  want = np.concatenate([ref["tower_2"], ref["tower_1"]])
  assert rel_err(out[1, :10], want) <= 1e-4, rel_err(out[1, :10], want)
  np.testing.assert_array_equal(out[0, 15:], 0.0)
  np.testing.assert_array_equal(out[1, 10:], 0.0)
  np.testing.assert_array_equal(out[2], 0.0)
  with pytest.raises(ValueError, match="image_rows"):
    batch_vision_inputs(pixels, ref["grid_thw"][order], [1, 0, 1], tower.cfg)


def test_padding_to_a_bigger_bucket_keeps_the_real_rows(case):
  kind, tower, ref = case
  pixels = np.concatenate([ref["pixel_values"], np.full((28, ref["pixel_values"].shape[1]), 7.0, np.float32)])
  ours = run(tower, pixels, vision_layout(ref["grid_thw"], tower.cfg, num_patches=128))
  assert ours.shape == (32, 64)
  assert rel_err(ours[:25], ref["tower_all"]) <= 1e-4
  np.testing.assert_array_equal(ours[25:], 0.0)


def test_scanned_and_unscanned_towers_agree(case):
  kind, tower, ref = case
  layout = vision_layout(ref["grid_thw"], tower.cfg, num_patches=112)
  pixels = np.pad(ref["pixel_values"], ((0, 12), (0, 0)))
  looped = run(load_tower(kind, scan_layers=False), pixels, layout)
  np.testing.assert_allclose(looped, run(tower, pixels, layout), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_load_pretrained_tower_on_a_mesh_equals_transformers(kind):
  """The VLM's tower as ``load_pretrained`` places it (fsdp x tensor), run with its placement."""
  model = models.load_pretrained(HF_FIXTURES / kind, dtype="float32", mesh=make_mesh({"fsdp": 4, "tensor": 2}))
  mlp_in = model.visual.blocks.fc1 if kind == "qwen2_vl" else model.visual.blocks.gate  # [layers, E, F]
  assert tuple(mlp_in[...].sharding.spec) == (None, "fsdp", "tensor")
  ref = dict(np.load(HF_FIXTURES / kind / "vision.npz"))
  graphdef, state = nnx.split(model.visual)
  out = jax.jit(lambda s, x, lay: nnx.merge(graphdef, s)(x, lay, placement=model.placement))(
      state, *one_row(ref["pixel_values"], vision_layout(ref["grid_thw"], model.visual.cfg)))
  assert rel_err(np.asarray(out)[0], ref["tower_all"]) <= 1e-4


def test_pallas_attention_in_the_tower_equals_transformers():
  """Window and full-attention segments through the Pallas Triton kernel (interpret mode), padded bucket."""
  tower = load_tower("qwen2_5_vl")
  ref = dict(np.load(HF_FIXTURES / "qwen2_5_vl" / "vision.npz"))
  pixels, layout = one_row(np.pad(ref["pixel_values"], ((0, 28), (0, 0))),
                           vision_layout(ref["grid_thw"], tower.cfg, num_patches=128))
  out = np.asarray(tower(pixels, layout, attention_impl="pallas_triton", interpret=True))[0]
  assert rel_err(out[:25], ref["tower_all"]) <= 1e-4
  np.testing.assert_array_equal(out[25:], 0.0)


def test_rematerialised_blocks_give_the_same_gradients():
  tower = load_tower("qwen2_5_vl")
  ref = dict(np.load(HF_FIXTURES / "qwen2_5_vl" / "vision.npz"))
  pixels, layout = one_row(ref["pixel_values"], vision_layout(ref["grid_thw"], tower.cfg))
  graphdef, params = nnx.graphdef(tower), nnx.state(tower, nnx.Param)
  cotangent = jax.random.normal(jax.random.key(0), (1, 25, 64))

  def loss(params, policy):
    return jnp.sum(nnx.merge(graphdef, params)(pixels, layout, remat_policy=policy) * cotangent)

  grads = {}
  for name, policy in (("plain", None), ("remat", jax.checkpoint_policies.nothing_saveable)):
    traced = jax.jit(jax.grad(loss), static_argnums=1).trace(params, policy)
    assert ("remat" in str(traced.jaxpr)) == (policy is not None), name
    grads[name] = traced.lower().compile()(params)
  for a, b in zip(jax.tree.leaves(grads["plain"]), jax.tree.leaves(grads["remat"])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_dropping_the_window_permutation_or_its_inverse_is_caught():
  """Image 0 spans 2 x 3 windows: without the window order (or without undoing it) rows move far."""
  tower = load_tower("qwen2_5_vl")
  ref = dict(np.load(HF_FIXTURES / "qwen2_5_vl" / "vision.npz"))
  layout = vision_layout(ref["grid_thw"], tower.cfg)
  unpermuted = dataclasses.replace(layout, window_index=np.arange(25, dtype=np.int32),
                                   rotary=vision_layout(ref["grid_thw"], dataclasses.replace(
                                       tower.cfg, kind="qwen2_vl")).rotary)
  assert rel_err(run(tower, ref["pixel_values"], unpermuted), ref["tower_all"]) > 0.1
  ours = run(tower, ref["pixel_values"], layout)
  assert rel_err(ours[layout.window_index], ref["tower_all"]) > 0.1  # the rows as they leave the merger
  assert rel_err(ours, ref["tower_all"]) <= 1e-4


def test_layout_equals_transformers_window_index_segments_and_rotary(case):
  kind, tower, ref = case
  grid, m2 = ref["grid_thw"], 4
  layout = vision_layout(grid, tower.cfg)
  window = ref.get("hf_window_index", np.arange(25))
  np.testing.assert_array_equal(layout.window_index, window)
  patch_order = (window[:, None] * m2 + np.arange(m2)).reshape(-1)
  np.testing.assert_array_equal(layout.rotary, ref["hf_position_ids"][patch_order])
  bounds = lambda seg: np.concatenate([[0], np.flatnonzero(np.diff(seg)) + 1, [len(seg)]])  # noqa: E731
  np.testing.assert_array_equal(bounds(layout.image_segments), ref["hf_cu_seqlens"])
  if kind == "qwen2_5_vl":
    np.testing.assert_array_equal(bounds(layout.window_segments), ref["hf_cu_window_seqlens"])
    assert layout.window_segments.max() == len(ref["hf_cu_window_seqlens"]) - 1 == 10
  else:
    np.testing.assert_array_equal(layout.window_segments, layout.image_segments)


def test_layout_hand_worked_example():
  """A 3 x 3-unit image (windows of 2 x 2 units: one full, two partial, one single), a 1 x 2-unit image
  and a two-frame 1-unit clip, padded by one unit."""
  cfg = VisionConfig(kind="qwen2_5_vl", depth=1, hidden_size=16, intermediate_size=8, num_heads=1,
                     out_hidden_size=8, window_size=56)
  layout = vision_layout([[1, 6, 6], [1, 2, 4], [2, 2, 2]], cfg, num_patches=4 * 14)
  # units of image 0:  0 1 2 / 3 4 5 / 6 7 8 ; image 1: 9 10 ; clip: 11 (frame 0), 12 (frame 1) ; pad 13
  np.testing.assert_array_equal(layout.window_index, [0, 1, 3, 4, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13])
  np.testing.assert_array_equal(layout.window_segments[::4], [1, 1, 1, 1, 2, 2, 3, 3, 4, 5, 5, 6, 7, 0])
  np.testing.assert_array_equal(layout.image_segments[::4], [1] * 9 + [2, 2, 3, 4, 0])
  assert np.all(layout.window_segments.reshape(-1, 4) == layout.window_segments[::4, None])
  # unit 3 (row 1, column 0) is 3rd in window order: patches (2,0) (2,1) (3,0) (3,1); unit 2 is 5th
  np.testing.assert_array_equal(layout.rotary[8:12], [[2, 0], [2, 1], [3, 0], [3, 1]])
  np.testing.assert_array_equal(layout.rotary[16:20], [[0, 4], [0, 5], [1, 4], [1, 5]])
  np.testing.assert_array_equal(layout.rotary[44:52], [[0, 0], [0, 1], [1, 0], [1, 1]] * 2)  # both frames
  np.testing.assert_array_equal(layout.rotary[52:], 0)


@pytest.mark.parametrize("bad, match", [
    (dict(grid=[[1, 3, 4]]), "multiples of spatial_merge_size 2"),
    (dict(grid=[[0, 2, 2]]), "t must be >= 1"),
    (dict(grid=[[1, 4, 4]], num_patches=12), "num_patches: 12"),
    (dict(grid=[[1, 4, 4]], num_patches=18), "multiple of 4"),
])
def test_layout_rejects_bad_grids(bad, match):
  with pytest.raises(ValueError, match=match):
    vision_layout(bad["grid"], tiny("qwen2_5_vl"), num_patches=bad.get("num_patches"))


def test_config_reads_both_hf_layouts_and_round_trips():
  a, b = tiny("qwen2_5_vl"), tiny("qwen2_vl")
  assert (a.kind, a.hidden_size, a.intermediate_size, a.out_hidden_size, a.window_units, a.fullatt_block_indexes) \
      == ("qwen2_5_vl", 32, 64, 64, 2, (1, 3))
  assert (b.kind, b.hidden_size, b.intermediate_size, b.out_hidden_size, b.full_attention) \
      == ("qwen2_vl", 32, 64, 64, (True,) * 4)
  for cfg in (a, b, VisionConfig.qwen2p5_vl_7b(), VisionConfig.qwen2_vl_2b()):
    assert VisionConfig.from_hf(cfg.to_hf(), source="x") == cfg
  with pytest.raises(ValueError, match="cfg.json: hidden_act 'gelu'"):
    VisionConfig.from_hf(dict(b.to_hf(), hidden_act="gelu"), source="cfg.json")
  with pytest.raises(ValueError, match="cfg.json: missing 'out_hidden_size'"):
    VisionConfig.from_hf({k: v for k, v in a.to_hf().items() if k != "out_hidden_size"}, source="cfg.json")


def test_num_params_equals_the_checkpoints_and_a_hand_count():
  for kind in KINDS:
    with safe_open(HF_FIXTURES / kind / "model.safetensors", "np") as f:
      stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(PREFIX[kind]))
    tower = load_tower(kind)
    ours = sum(v.size for v in jax.tree.leaves(nnx.state(tower, nnx.Param)))
    assert tiny(kind).num_params == stored == ours, (kind, tiny(kind).num_params, stored, ours)
  # Qwen2.5-VL-7B by hand: patch 1176·1280; per block 2 norms, qkv 1280·3840 + 3840, proj 1280² + 1280,
  # SwiGLU 3·1280·3420 + 2·3420 + 1280; merger ln 1280, 5120² + 5120, 5120·3584 + 3584.
  block = 2 * 1280 + (1280 * 3840 + 3840) + (1280 * 1280 + 1280) + (3 * 1280 * 3420 + 2 * 3420 + 1280)
  hand = 1176 * 1280 + 32 * block + 1280 + 5120 * 5120 + 5120 + 5120 * 3584 + 3584
  assert VisionConfig.qwen2p5_vl_7b().num_params == hand == 676_550_144


def _dot_flops(jaxpr) -> int:
  """``2 · (contracted size) · (output size)`` summed over every dot_general, scan bodies times their length."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(lhs[i] for i in contract) * math.prod(eqn.outvars[0].aval.shape)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += eqn.params.get("length", 1) * _dot_flops(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += _dot_flops(sub)
  return total


@pytest.mark.parametrize("kind", KINDS)
def test_flops_per_patch_equals_the_towers_matmuls(kind):
  """``vision_flops_per_patch`` (jaxrl plan) against the matmuls in the tower's jaxpr. The reference attention
  multiplies every key and masks, so the count matches where every key is visible (one frame, one window);
  over 2 x 2 windows it exceeds the formula by exactly the masked keys of the window block."""
  cfg = VisionConfig(kind=kind, depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
                     window_size=56, fullatt_block_indexes=(1,) if kind == "qwen2_5_vl" else ())
  graphdef, state = nnx.split(VisionTower(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  for side in (4, 8):
    layout, p = vision_layout([[1, side, side]], cfg), side * side
    jaxpr = jax.make_jaxpr(lambda s, x, lay: nnx.merge(graphdef, s)(x, lay))(
        state, *one_row(np.zeros((p, cfg.patch_dim), np.float32), layout))
    masked = 4 * 64 * (p - 16) if kind == "qwen2_5_vl" else 0  # one window block: 16 of p keys visible
    assert _dot_flops(jaxpr.jaxpr) / p == vision_flops_per_patch(cfg, p) + masked, (kind, side)
