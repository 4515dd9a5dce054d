"""The model on the 8-device mesh: parameters sharded as the rules say, numbers equal to one device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_testlib import HF_FIXTURES, TEST_CFG, arange_positions, flat_arrays, forward, logits_and_grads, packed_batch

from jaxrl import models, sharding

MESHES = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp2_tensor4": {"fsdp": 2, "tensor": 4},
}
# Expected specs of: mlp gate_proj [L, D, F], embed [V, D], attn q_proj [L, D, N, H], lm_head [D, V].
EXPECTED_SPECS = {
    "data8": (P(None, None, None), P(None, None), P(None, None, None, None), P(None, None)),
    "fsdp8": (P(None, "fsdp", None), P(None, "fsdp"), P(None, "fsdp", None, None), P("fsdp", None)),
    "data2_fsdp2_tensor2": (P(None, "fsdp", "tensor"), P("tensor", "fsdp"), P(None, "fsdp", "tensor", None),
                            P("fsdp", "tensor")),
    "fsdp2_tensor4": (P(None, "fsdp", "tensor"), P("tensor", "fsdp"), P(None, "fsdp", "tensor", None),
                      P("fsdp", "tensor")),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_logits_and_grads_equal_single_device(grad_reference, mesh_name):
  single, want_logits, want_grads = grad_reference
  mesh = sharding.make_mesh(MESHES[mesh_name])
  model = models.shard_model(single, mesh)
  specs = (model.layers.mlp.gate_proj.get_value().sharding.spec, model.embed.get_value().sharding.spec,
           model.layers.attn.q_proj.get_value().sharding.spec, model.lm_head.get_value().sharding.spec)
  assert specs == EXPECTED_SPECS[mesh_name]
  if mesh_name == "fsdp2_tensor4":
    assert model.layers.mlp.gate_proj.get_value().addressable_shards[0].data.shape == (2, 32, 32)
  batch = [jax.device_put(x, sharding.batch_sharding(mesh)) for x in packed_batch()]
  assert batch[0].sharding.spec == P(("data", "fsdp") if mesh_name == "data2_fsdp2_tensor2" else
                                     "data" if mesh_name == "data8" else "fsdp", None)
  logits, grads = logits_and_grads(model, *batch)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-5)
  got = flat_arrays(grads)
  assert got.keys() == want_grads.keys()
  for path in want_grads:
    np.testing.assert_allclose(got[path], want_grads[path], rtol=1e-5, atol=1e-6, err_msg="/".join(map(str, path)))


def test_init_model_on_a_mesh_equals_single_device_init():
  mesh = sharding.make_mesh(MESHES["fsdp2_tensor4"])
  sharded, single = models.init_model(TEST_CFG, mesh=mesh, seed=0), models.init_model(TEST_CFG, seed=0)
  assert sharded.layers.attn.k_proj.get_value().sharding.spec == P(None, "fsdp", "tensor", None)
  assert sharded.layers.attn.o_proj.get_value().sharding.spec == P(None, "tensor", None, "fsdp")
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(single))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


def test_state_shardings_follow_the_rules():
  mesh = sharding.make_mesh(MESHES["data2_fsdp2_tensor2"])
  shardings = models.state_shardings(models.abstract_model(TEST_CFG), mesh)
  flat = {path: v.get_value() for path, v in nnx.to_flat_state(shardings)}
  assert flat[("layers", "attn", "q_norm", "scale")].spec == P(None, None)
  assert flat[("layers", "mlp", "down_proj")].spec == P(None, "tensor", "fsdp")
  assert flat[("final_norm", "scale")].spec == P(None)
  assert all(s.mesh is mesh for s in flat.values())


def test_load_pretrained_on_a_mesh_places_each_slice(fixture_models):
  """llama_gqa on data2_fsdp2_tensor2: heads (6 over 2 kv) and the (heads, head_dim) HF rows are split."""
  mesh = sharding.make_mesh(MESHES["data2_fsdp2_tensor2"])
  model = models.load_pretrained(HF_FIXTURES / "llama_gqa", mesh=mesh, dtype="float32")
  q = model.layers.attn.q_proj.get_value()
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (2, 24, 3, 8)
  assert model.layers.attn.o_proj.get_value().sharding.spec == P(None, "tensor", None, "fsdp")
  single = fixture_models["llama_gqa"]
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(single))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
  ref = np.load(HF_FIXTURES / "llama_gqa" / "reference.npz")
  tokens = ref["tokens"]
  logits = forward(model, tokens, arange_positions(tokens), np.ones_like(tokens))
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=0, atol=1e-4)


def test_loop_layers_load_sharded_per_layer(fixture_models):
  mesh = sharding.make_mesh(MESHES["fsdp2_tensor4"])
  model = models.load_pretrained(HF_FIXTURES / "qwen3", mesh=mesh, dtype="float32", scan_layers=False)
  gate = model.layers[1].mlp.gate_proj.get_value()
  assert gate.sharding.spec == P("fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(gate), np.asarray(fixture_models["qwen3"].layers.mlp.gate_proj.get_value())[1])


def test_saving_a_sharded_model_writes_the_original_tensors(tmp_path):
  from safetensors.numpy import load_file

  mesh = sharding.make_mesh(MESHES["fsdp2_tensor4"])
  model = models.load_pretrained(HF_FIXTURES / "qwen3", mesh=mesh, dtype="float32")
  assert model.layers.mlp.up_proj.get_value().sharding.spec == P(None, "fsdp", "tensor")
  models.save_pretrained(model, tmp_path)
  ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(HF_FIXTURES / "qwen3" / "model.safetensors")
  assert ours.keys() == theirs.keys()
  for key in theirs:
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_kv_cache_shardings_follow_the_cache_rules():
  mesh = sharding.make_mesh(MESHES["data2_fsdp2_tensor2"])
  cache = jax.eval_shape(lambda: models.KVCache.init(TEST_CFG, batch=4, max_len=32))
  specs = cache.shardings(mesh)
  assert specs.k.spec == P(None, ("data", "fsdp"), None, "tensor", None)
  assert specs.segment_ids.spec == P(("data", "fsdp"), None)
  placed = jax.device_put(models.KVCache.init(TEST_CFG, batch=4, max_len=32), specs)
  assert placed.v.addressable_shards[0].data.shape == (2, 1, 32, 2, 8)
