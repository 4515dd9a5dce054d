"""LoRA: exact start, adapter-only training, merge/unmerge, PEFT files both ways, sharding, accounting."""

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_testlib import HF_FIXTURES, TEST_CFG, arange_positions, forward, o1_model, packed_batch

from jaxrl import models, sharding, train
from jaxrl.models import LoraConfig, ModelConfig

PEFT_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "peft"


def _nll(model, tokens, positions, segment_ids):
  """Mean next-token NLL over in-segment pairs."""
  logits = model(tokens, positions=positions, segment_ids=segment_ids)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  mask = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  return jnp.sum(nll * mask) / jnp.sum(mask)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _adapter_grads(graphdef, adapters, base, tokens, positions, segment_ids):
  loss = models.lora_loss(lambda params, _: _nll(nnx.merge(graphdef, params), tokens, positions, segment_ids))
  return jax.grad(loss)(adapters, None, base)


def _random_b(model, seed: int, std: float = 0.05):
  """The model with every B drawn N(0, std²) (A keeps its init), so adapters change the output."""
  graphdef, adapters, base = models.split_lora(model)
  rng = np.random.default_rng(seed)
  adapters = nnx.map_state(
      lambda path, v: v.replace(jnp.asarray(rng.normal(0.0, std, v.shape), v.get_value().dtype))
      if str(path[-1]).endswith("_lora_b") else v, adapters)
  return nnx.merge(graphdef, adapters, base)


def _lora_model(rank=4, seed=0, **kw):
  return models.apply_lora(o1_model(), LoraConfig(rank=rank, **kw), seed=seed)


def _flat(state) -> dict:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


# --------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("rank", [0, -3, 2.0, True])
def test_rank_must_be_a_positive_int(rank):
  with pytest.raises(ValueError, match=r"lora\.rank: must be an int >= 1, got " + re.escape(repr(rank))):
    LoraConfig(rank=rank)


def test_unknown_target_module_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown module names \['qproj'\] \(valid: \['q_proj', 'k_proj'"):
    LoraConfig(rank=4, targets=["q_proj", "qproj"])
  with pytest.raises(ValueError, match=r"lora\.targets: 'everything' is not one of \['all', 'attn', 'mlp'\]"):
    LoraConfig(rank=4, targets="everything")


def test_target_sets_and_scales():
  assert LoraConfig(rank=8).modules == models.LORA_MODULES
  assert LoraConfig(rank=8, targets="attn").modules == ("q_proj", "k_proj", "v_proj", "o_proj")
  assert LoraConfig(rank=8, targets="mlp").modules == ("gate_proj", "up_proj", "down_proj")
  assert LoraConfig(rank=8, targets=["down_proj", "q_proj"]).modules == ("q_proj", "down_proj")
  assert LoraConfig(rank=8).scale == 4.0  # alpha / r = 32 / 8
  assert LoraConfig(rank=16, rslora=True).scale == 8.0  # alpha / sqrt(r)
  assert LoraConfig(rank=8).lr_multiplier == 10.0


# --------------------------------------------------------------------------------------------------
# Forward, training, merging


def test_zero_b_leaves_logits_unchanged_and_a_has_peft_init():
  model = o1_model()
  batch = packed_batch()
  before = np.asarray(forward(model, *batch))
  models.apply_lora(model, LoraConfig(rank=8))
  np.testing.assert_array_equal(np.asarray(forward(model, *batch)), before)
  flat = _flat(models.lora_state(model))
  assert len(flat) == 14
  d, n, k, h, f = 64, 8, 4, 8, 128
  d_in = {"q_proj": d, "k_proj": d, "v_proj": d, "o_proj": n * h, "gate_proj": d, "up_proj": d, "down_proj": f}
  assert flat["layers/attn/q_proj_lora_a"].shape == (2, d, 8)
  assert flat["layers/attn/k_proj_lora_b"].shape == (2, 8, k, h)
  assert flat["layers/attn/o_proj_lora_a"].shape == (2, n, h, 8)
  assert flat["layers/mlp/down_proj_lora_b"].shape == (2, 8, d)
  for path, value in flat.items():
    name = path.split("/")[-1][:-len("_lora_a")]
    if path.endswith("_lora_b"):
      assert not value.any(), path
    else:  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(d_in), 1/sqrt(d_in))
      bound = 1 / math.sqrt(d_in[name])
      assert np.abs(value).max() <= bound, path
      assert abs(value.std() / (bound / math.sqrt(3)) - 1) < 0.1, path
      assert not np.array_equal(value[0], value[1]), path  # each layer draws its own A


def test_scanned_and_looped_models_get_the_same_adapters():
  cfg = dataclasses.replace(TEST_CFG, scan_layers=False)
  looped = models.apply_lora(models.init_model(cfg), LoraConfig(rank=4), seed=3)
  scanned = models.apply_lora(models.init_model(TEST_CFG), LoraConfig(rank=4), seed=3)
  np.testing.assert_array_equal(np.asarray(looped.layers[1].attn.o_proj_lora_a.get_value()),
                                np.asarray(scanned.layers.attn.o_proj_lora_a.get_value())[1])


def test_adapter_train_step_changes_only_adapters_and_merge_matches():
  model = _lora_model(rank=4)
  base_before = _flat(models.split_lora(model)[2])
  graphdef, adapters, base = models.split_lora(model)
  batch = dict(zip(("tokens", "positions", "segment_ids"), map(jnp.asarray, packed_batch())))

  def loss_fn(params, batch):
    return _nll(nnx.merge(graphdef, params), batch["tokens"], batch["positions"], batch["segment_ids"]), {}

  optimizer = train.make_optimizer(train.OptimConfig(lr=1e-2, schedule="constant"), 3)
  step = train.make_train_step(models.lora_loss(loss_fn), optimizer)
  state = train.init_train_state(adapters, optimizer)
  adapter_bytes = models.optimizer_state_bytes(adapters)
  assert models.optimizer_state_bytes(state.opt_state) == 2 * adapter_bytes + 8  # Adam mu, nu; two step counts
  before = _flat(adapters)
  losses = []
  for _ in range(3):  # B moves at step 1; A's gradient is zero until B != 0, so it moves from step 2
    state, metrics = step(state, batch, base)
    losses.append(float(metrics["loss"]))
  assert losses[2] < losses[0]
  after = _flat(state.params)
  assert after.keys() == before.keys()
  for path in before:
    assert np.all(after[path] != before[path]), f"adapter {path} did not change everywhere"
  model = nnx.merge(graphdef, state.params, base)
  for path, value in _flat(models.split_lora(model)[2]).items():
    np.testing.assert_array_equal(value, base_before[path], err_msg=f"base parameter {path} changed")

  tokens, positions, segment_ids = packed_batch()
  unmerged = np.asarray(forward(model, tokens, positions, segment_ids))
  models.merge_lora(model)
  merged = np.asarray(forward(model, tokens, positions, segment_ids))
  np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=1e-5)
  assert np.abs(merged - np.asarray(forward(o1_model(), tokens, positions, segment_ids))).max() > 1e-3
  with pytest.raises(ValueError, match="already merged"):
    models.merge_lora(model)
  plain = models.merged_base(model)  # a Transformer without adapters, as save_pretrained needs
  assert not models.has_lora(plain)
  assert _flat(nnx.state(plain)).keys() == base_before.keys()
  for path, value in _flat(nnx.state(plain)).items():
    np.testing.assert_array_equal(value, _flat(models.split_lora(model)[2])[path], err_msg=path)
  models.unmerge_lora(model)
  for path, value in _flat(models.split_lora(model)[2]).items():
    np.testing.assert_allclose(value, base_before[path], rtol=1e-6, atol=1e-6, err_msg=path)
  np.testing.assert_allclose(np.asarray(forward(model, tokens, positions, segment_ids)), unmerged,
                             rtol=1e-5, atol=1e-5)


def test_base_logits_equal_the_model_before_lora_without_gradient():
  tokens, positions, segment_ids = map(jnp.asarray, packed_batch())
  want = np.asarray(forward(o1_model(), tokens, positions, segment_ids))
  model = _random_b(_lora_model(rank=4), seed=1)
  assert np.abs(np.asarray(forward(model, tokens, positions, segment_ids)) - want).max() > 1e-2
  graphdef, adapters, base = models.split_lora(model)

  def f(params, _):
    ref = models.base_logits(nnx.merge(graphdef, params), tokens, positions=positions, segment_ids=segment_ids)
    return jnp.sum(ref ** 2), ref

  grads, ref = jax.jit(jax.grad(models.lora_loss(f), has_aux=True))(adapters, None, base)
  np.testing.assert_array_equal(np.asarray(ref), want)
  assert all(not v.any() for v in _flat(grads).values())
  models.merge_lora(model)
  with pytest.raises(ValueError, match="unmerge_lora before running the base"):
    models.base_logits(model, tokens, positions=positions, segment_ids=segment_ids)


def test_lora_plus_scales_b_updates_only():
  model = _random_b(_lora_model(rank=4), seed=2)
  graphdef, adapters, base = models.split_lora(model)
  grads = _adapter_grads(graphdef, adapters, base, *map(jnp.asarray, packed_batch()))
  scales = models.lr_scale_tree(adapters, b_lr_ratio=4.0)
  assert sorted(set(jax.tree.leaves(scales))) == [1.0, 4.0]
  cfg = train.OptimConfig(lr=1e-3, schedule="constant")
  plain = train.make_optimizer(cfg, 10)
  plus = train.make_optimizer(cfg, 10, lr_scale=scales)
  u_plain, _ = jax.jit(plain.update)(grads, plain.init(adapters), adapters)
  u_plus, _ = jax.jit(plus.update)(grads, plus.init(adapters), adapters)
  for (path, a), b in zip(_flat(u_plain).items(), _flat(u_plus).values()):
    np.testing.assert_allclose(b, a * (4.0 if path.endswith("_lora_b") else 1.0), rtol=1e-6, err_msg=path)


def test_optimizer_state_for_rank_16_is_under_5_percent_of_full_fine_tuning():
  """Shapes only (``jax.eval_shape``): Adam moments for the adapters vs for every parameter."""
  def ratio(cfg, rank=16):
    optimizer = train.make_optimizer(train.OptimConfig(), 100)
    full = nnx.state(models.abstract_model(cfg))
    adapted = nnx.eval_shape(lambda: models.apply_lora(models.Transformer(cfg, rngs=nnx.Rngs(0)),
                                                       LoraConfig(rank=rank)))
    lora = models.lora_state(adapted)
    full_bytes = models.optimizer_state_bytes(jax.eval_shape(optimizer.init, full))
    lora_bytes = models.optimizer_state_bytes(jax.eval_shape(optimizer.init, lora))
    assert lora_bytes == 2 * 4 * models.lora_param_counts(cfg, rank=rank)["total"] + 8
    return lora_bytes / full_bytes

  small = ModelConfig.tiny(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=8, head_dim=64)
  assert ratio(small) < 0.05
  assert ratio(ModelConfig.qwen2p5_0p5b()) == pytest.approx(0.01781, abs=1e-5)  # docs/benchmarks_lora.md


# --------------------------------------------------------------------------------------------------
# Sharding


def test_adapters_are_sharded_like_their_base_and_grads_equal_single_device():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  sharded = models.apply_lora(models.init_model(TEST_CFG, mesh=mesh), LoraConfig(rank=4))
  attn, mlp = sharded.layers.attn, sharded.layers.mlp
  specs = [
      (attn.q_proj_lora_a, P(None, "fsdp", None)), (attn.q_proj_lora_b, P(None, None, "tensor", None)),
      (attn.k_proj_lora_b, P(None, None, "tensor", None)), (attn.o_proj_lora_a, P(None, "tensor", None, None)),
      (attn.o_proj_lora_b, P(None, None, "fsdp")), (mlp.gate_proj_lora_a, P(None, "fsdp", None)),
      (mlp.up_proj_lora_b, P(None, None, "tensor")), (mlp.down_proj_lora_a, P(None, "tensor", None)),
      (mlp.down_proj_lora_b, P(None, None, "fsdp")),
  ]
  for var, spec in specs:
    assert var.get_value().sharding.spec == spec, var.get_metadata()["out_sharding"]
    assert var.get_value().sharding.mesh is mesh
  assert attn.o_proj_lora_b.get_metadata()["out_sharding"] == ("layers", "lora_rank", "embed")

  single = _random_b(_lora_model(rank=4), seed=3)
  batch = packed_batch()
  graphdef, adapters, base = models.split_lora(single)
  want = _flat(_adapter_grads(graphdef, adapters, base, *map(jnp.asarray, batch)))
  on_mesh = models.shard_model(single, mesh)
  assert on_mesh.layers.mlp.gate_proj_lora_b.get_value().sharding.spec == P(None, None, "tensor")
  graphdef, adapters, base = models.split_lora(on_mesh)
  placed = [jax.device_put(x, sharding.batch_sharding(mesh)) for x in batch]
  got = _flat(_adapter_grads(graphdef, adapters, base, *placed))
  assert got.keys() == want.keys()
  for path in want:
    assert np.abs(want[path]).max() > 0, path
    np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path)


# --------------------------------------------------------------------------------------------------
# PEFT files


def _peft_logits(name):
  ref = np.load(PEFT_FIXTURES / name / "peft_logits.npz")
  return ref["tokens"], ref["logits"]


def _logits(model, tokens):
  return np.asarray(forward(model, tokens, arange_positions(tokens), np.ones_like(tokens)))


def test_jaxrl_export_gives_peft_logits_and_saves_back_identically(tmp_path):
  """``jaxrl_qwen3`` was written by save_peft and loaded by peft.PeftModel.from_pretrained."""
  from safetensors.numpy import load_file

  src = PEFT_FIXTURES / "jaxrl_qwen3"
  model = models.load_peft(models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32"), src)
  assert model.lora_config.modules == models.LORA_MODULES and model.lora_config.scale == 4.0
  tokens, want = _peft_logits("jaxrl_qwen3")
  np.testing.assert_allclose(_logits(model, tokens), want, rtol=0, atol=1e-4)
  models.save_peft(model, tmp_path, base_model_name_or_path="tests/fixtures/hf/qwen3")
  assert json.loads((tmp_path / "adapter_config.json").read_text()) == json.loads(
      (src / "adapter_config.json").read_text())
  ours, theirs = load_file(tmp_path / "adapter_model.safetensors"), load_file(src / "adapter_model.safetensors")
  assert ours.keys() == theirs.keys()
  assert "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight" in ours
  for key in theirs:
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


@pytest.mark.parametrize("name,base,scan_layers", [("peft_llama_gqa", "llama_gqa", True),
                                                   ("peft_qwen2_qv", "qwen2_tied", False)])
def test_load_peft_reproduces_peft_logits(name, base, scan_layers):
  model = models.load_pretrained(HF_FIXTURES / base, dtype="float32", scan_layers=scan_layers)
  models.load_peft(model, PEFT_FIXTURES / name)
  tokens, want = _peft_logits(name)
  np.testing.assert_allclose(_logits(model, tokens), want, rtol=0, atol=1e-4)
  cfg = model.lora_config
  if name == "peft_llama_gqa":  # all-linear, rsLoRA alpha 8 at r 4
    assert (cfg.modules, cfg.rank, cfg.rslora, cfg.scale) == (models.LORA_MODULES, 4, True, 4.0)
  else:
    assert (cfg.modules, cfg.rank, cfg.scale) == (("q_proj", "v_proj"), 8, 4.0)
    assert not hasattr(model.layers[0].attn, "k_proj_lora_a")


def _copy_adapter(tmp_path, name, *, config=None, tensors=None):
  from safetensors.numpy import load_file, save_file

  src = PEFT_FIXTURES / name
  cfg = json.loads((src / "adapter_config.json").read_text())
  cfg.update(config or {})
  (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
  t = load_file(src / "adapter_model.safetensors")
  save_file(tensors(t) if tensors else t, str(tmp_path / "adapter_model.safetensors"))
  return tmp_path


@pytest.fixture(scope="module")
def qwen3_abstract_base():
  """The qwen3 fixture as shapes (errors are raised before any value is read)."""
  return lambda: nnx.eval_shape(lambda: models.Transformer(
      ModelConfig.from_hf_config(json.loads((HF_FIXTURES / "qwen3" / "config.json").read_text())),
      rngs=nnx.Rngs(0)))


def test_adapter_shape_not_matching_the_base_names_the_key_and_both_shapes(qwen3_abstract_base):
  """llama_gqa's adapter on qwen3: kv heads x head_dim is 2 x 8 there, 2 x 16 here."""
  with pytest.raises(ValueError, match=re.escape(
      "tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight' has shape [16, 4], but the base "
      "model expects [32, 4] (r=4, k_proj: d_in=48, d_out=32)")):
    models.load_peft(qwen3_abstract_base(), PEFT_FIXTURES / "peft_llama_gqa")


def test_unsupported_peft_options_are_rejected(tmp_path, qwen3_abstract_base):
  path = _copy_adapter(tmp_path, "jaxrl_qwen3", config={"use_dora": True})
  with pytest.raises(ValueError, match=r"use_dora=True is not supported"):
    models.load_peft(qwen3_abstract_base(), path)
  path = _copy_adapter(tmp_path, "jaxrl_qwen3", config={"use_dora": False, "rank_pattern": {"q_proj": 8}})
  with pytest.raises(ValueError, match=r"rank_pattern=\{'q_proj': 8\} is not supported"):
    models.load_peft(qwen3_abstract_base(), path)
  path = _copy_adapter(tmp_path, "jaxrl_qwen3", config={"rank_pattern": {}, "init_lora_weights": "pissa"})
  with pytest.raises(ValueError, match=r"init_lora_weights='pissa' modifies the base weights"):
    models.load_peft(qwen3_abstract_base(), path)


def test_adapter_tensors_jaxrl_cannot_place_are_errors(tmp_path, qwen3_abstract_base):
  head = "base_model.model.lm_head.lora_A.weight"
  path = _copy_adapter(tmp_path, "jaxrl_qwen3", tensors=lambda t: {**t, head: np.zeros((4, 48), np.float32)})
  with pytest.raises(ValueError, match=re.escape("tensors jaxrl cannot place") + r".*lm_head\.lora_A"):
    models.load_peft(qwen3_abstract_base(), path)
  drop = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
  path = _copy_adapter(tmp_path, "jaxrl_qwen3", tensors=lambda t: {k: v for k, v in t.items() if k != drop})
  with pytest.raises(ValueError, match=r"must cover every layer.*" + re.escape(drop)):
    models.load_peft(qwen3_abstract_base(), path)


# --------------------------------------------------------------------------------------------------
# Accounting and learning rates


def test_param_counts_by_hand_and_the_notes_table():
  counts = models.lora_param_counts(TEST_CFG, targets="all", rank=4)
  # D=64, N·H=64, K·H=32, F=128, L=2: r·(d_in + d_out) per layer.
  assert counts == {"q_proj": 2 * 4 * 128, "k_proj": 2 * 4 * 96, "v_proj": 2 * 4 * 96, "o_proj": 2 * 4 * 128,
                    "gate_proj": 2 * 4 * 192, "up_proj": 2 * 4 * 192, "down_proj": 2 * 4 * 192, "total": 8192}
  model = models.apply_lora(models.init_model(TEST_CFG), LoraConfig(rank=4))
  assert sum(v.size for v in jax.tree.leaves(models.lora_state(model))) == counts["total"]
  q8 = ModelConfig.qwen3_8b()
  table = {label: models.lora_param_counts(q8, targets=t, rank=r)["total"]
           for label, t, r in (("mlp256", "mlp", 256), ("attn256", "attn", 256), ("all256", "all", 256),
                               ("mlp128", "mlp", 128))}
  # The note's table (lines 347-352): attn 0.25B and all 0.70B at rank 256 match Qwen3-8B's shapes.
  assert round(table["attn256"] / 1e9, 2) == 0.25 and round(table["all256"] / 1e9, 2) == 0.70
  assert 2 * table["mlp128"] == table["mlp256"] and table["all256"] == table["mlp256"] + table["attn256"]
  assert round(table["attn256"] / table["mlp128"], 2) == 1.08  # "about the same" parameters (line 331)


def test_flops_follow_the_notes_2n2_plus_6nr_vs_3n2():
  n, r, layers, vocab = 256, 8, 3, 1000
  square = ModelConfig.tiny(hidden_size=n, intermediate_size=n, num_heads=4, num_kv_heads=4, head_dim=n // 4,
                            num_layers=layers, vocab_size=vocab)
  got = models.lora_flops_per_token(square, r, "all")
  assert got["full"] == 2 * (7 * layers * 3 * n * n + 3 * n * vocab)
  assert got["lora"] == 2 * (7 * layers * (2 * n * n + 6 * n * r) + 2 * n * vocab)
  attn = models.lora_flops_per_token(square, r, "attn")
  assert attn["lora"] == 2 * (4 * layers * (2 * n * n + 6 * n * r) + 3 * layers * 2 * n * n + 2 * n * vocab)
  big = models.lora_flops_per_token(ModelConfig.llama3p1_8b(), 16)
  assert 2 / 3 < big["ratio"] < 0.68  # "slightly more than 2/3" (line 561)


def test_learning_rate_rules():
  assert models.lora_lr(1e-5) == pytest.approx(1e-4)
  assert models.lora_lr(1e-5, short_run=True) == pytest.approx(1.5e-4)
  with pytest.raises(ValueError, match="full_ft_lr"):
    models.lora_lr(0.0)
  llama = models.hidden_size_lr(ModelConfig.llama3p1_8b())
  assert llama == pytest.approx(5e-5 * 9.8 * (2000 / 4096) ** 0.781)
  assert models.hidden_size_lr(ModelConfig.llama3p1_8b(), lora=False) == pytest.approx(llama / 9.8)
  assert models.hidden_size_lr(2000, family="qwen") == pytest.approx(5e-5 * 9.8)
  assert models.hidden_size_lr(ModelConfig.qwen3_8b(), lora=False) == pytest.approx(5e-5 * (2000 / 4096) ** 0.0775)
  with pytest.raises(ValueError, match="family"):
    models.hidden_size_lr(4096)
  with pytest.raises(ValueError, match="b_lr_ratio"):
    models.lr_scale_tree({}, 0.0)

