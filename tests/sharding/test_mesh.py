"""Mesh construction and logical-axis rules."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl import sharding


def test_free_axis_takes_remaining_devices():
  mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
  assert mesh.devices.size == jax.device_count() == 8


@pytest.mark.parametrize("shape,match", [
    ({"data": 3}, "needs 3 devices"),
    ({"data": -1, "fsdp": -1}, "at most one"),
    ({"data": -1, "fsdp": 3}, "not divisible"),
    ({"pipeline": 2}, "unknown mesh axes"),
    ({"data": 0}, "positive int"),
])
def test_bad_mesh_shapes_are_named(shape, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(shape)


def test_default_rules_shard_weights_fsdp_and_tensor():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  rules = sharding.LogicalRules.default()
  assert rules.spec(("embed", "mlp"), mesh, (16, 32)) == P("fsdp", "tensor")
  assert rules.spec(("layers", "embed", "heads", "head_dim"), mesh, (2, 16, 8, 4)) == P(None, "fsdp", "tensor", None)
  assert rules.spec(("batch", "seq"), mesh, (8, 4)) == P("fsdp", None)


def test_size_one_axes_are_dropped_from_specs():
  mesh = sharding.make_mesh({"data": 8})
  assert sharding.LogicalRules.default().spec(("embed", "vocab"), mesh, (16, 32)) == P(None, None)


def test_indivisible_dimension_is_replicated_and_reported():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  rules = sharding.LogicalRules.default()
  assert rules.spec(("embed", "kv_heads", "head_dim"), mesh, (16, 2, 8)) == P("fsdp", None, None)
  assert rules.fallbacks(("embed", "kv_heads", "head_dim"), mesh, (16, 2, 8)) == [
      "kv_heads=2 not divisible by tensor=4: replicated"]


def test_one_mesh_axis_used_twice_in_an_array_is_refused():
  mesh = sharding.make_mesh({"tensor": 8})
  with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
    sharding.LogicalRules.default().spec(("heads", "mlp"), mesh)


def test_rules_reject_unknown_mesh_axis_and_duplicates():
  with pytest.raises(ValueError, match="unknown mesh axis"):
    sharding.LogicalRules(rules=(("embed", "pipeline"),))
  with pytest.raises(ValueError, match="appears twice"):
    sharding.LogicalRules(rules=(("embed", "fsdp"), ("embed", None)))


def test_unknown_logical_axis_names_itself():
  with pytest.raises(KeyError, match="'qkv'"):
    sharding.LogicalRules.default().spec(("qkv",), sharding.make_mesh({"data": 8}))


def test_mesh_config_overrides_rules_from_yaml_keys():
  cfg = config_lib.from_dict(sharding.MeshConfig, {"shape": {"fsdp": 8}, "rules": {"embed": None}}, prefix="mesh")
  mesh = cfg.build()
  assert cfg.logical_rules().spec(("embed", "mlp"), mesh, (16, 16)) == P(None, None)
  with pytest.raises(config_lib.ConfigError, match="unknown logical axes"):
    config_lib.from_dict(sharding.MeshConfig, {"rules": {"qkv": "fsdp"}}, prefix="mesh")


def test_initialize_is_a_no_op_without_settings_and_checks_partial_ones():
  assert sharding.initialize(env={}) is False
  with pytest.raises(ValueError, match="missing"):
    sharding.initialize(env={"JAXRL_COORDINATOR": "127.0.0.1:1"})
  with pytest.raises(ValueError, match="not an integer"):
    sharding.initialize(env={"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "two", "JAXRL_PROCESS_ID": "0"})
