"""Mixed precision: float32 master weights and Adam state whatever the compute dtype; compute-dtype copies."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_testlib import HF_FIXTURES

from jaxrl import config as config_lib
from jaxrl import losses, models, sharding, train

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HF_PRESETS = {
    "DeepSeek-R1-Distill-Qwen-1.5B": "deepseek_r1_distill_qwen_1p5b",
    "DeepSeek-R1-Distill-Qwen-7B": "deepseek_r1_distill_qwen_7b",
    "DeepSeek-R1-Distill-Qwen-14B": "deepseek_r1_distill_qwen_14b",
    "Qwen2.5-7B": "qwen2p5_7b",
    "Qwen2.5-7B-Instruct": "qwen2p5_7b",
    "Qwen2.5-VL-3B-Instruct": "qwen2p5_vl_3b",
    "Qwen2.5-VL-7B-Instruct": "qwen2p5_vl_7b",
    "Vision-R1-CI-7B": "qwen2p5_vl_7b",
}
"""Checkpoint directory name in a recipe -> the preset with its shapes (config.json written as bf16)."""


def _load_recipe(path: Path, tmp_path: Path, role: str | None = None):
  """``(ModelSource, OptimConfig, steps)`` of any recipe (RL, SFT, latent...) through the config loader's
  typed sections; ``hf_dir`` is replaced by a bf16 config.json of the same shapes."""
  raw = config_lib.read_yaml(path)
  if role is not None:  # a two-policy recipe (Rubric-ARM): each role has its own model and optimizer
    raw = raw[role]
  model = dict(raw["model"])
  if model.get("hf_dir") is not None:
    preset = models.PRESETS[HF_PRESETS[Path(model["hf_dir"]).name]]()
    (tmp_path / "config.json").write_text(json.dumps(preset.to_hf_config(torch_dtype="bfloat16")))
    model["hf_dir"] = str(tmp_path)
  source = config_lib.from_dict(models.ModelSource, model, prefix="model")
  optim = config_lib.from_dict(train.OptimConfig, raw.get("optim", {}), prefix="optim")
  return source, optim, raw.get("steps", 100)


def _recipes() -> list[str]:
  """Every recipe, and ``name:role`` for each policy of a recipe without a top-level ``model:``."""
  out = []
  for path in sorted(CONFIGS.glob("*.yaml")):
    raw = config_lib.read_yaml(path)
    roles = [k for k, v in raw.items() if isinstance(v, dict) and "model" in v]
    out += [path.stem] if "model" in raw or not roles else [f"{path.stem}:{r}" for r in roles]
  return out


@pytest.mark.parametrize("name", _recipes())
def test_every_trainable_param_and_adam_moment_is_float32_in_every_recipe(name, tmp_path):
  stem, _, role = name.partition(":")
  source, optim, steps = _load_recipe(CONFIGS / f"{stem}.yaml", tmp_path, role or None)
  assert "param_dtype" in source.overrides and "dtype" in source.overrides, f"{name}: name both dtypes"
  model_cfg = source.config()
  _, params = nnx.split(source.abstract())
  optimizer = train.make_optimizer(optim, steps)
  opt_state = jax.eval_shape(optimizer.init, params)
  for kind, tree in (("param", params), ("optimizer state", opt_state)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert leaf.dtype == jnp.float32, f"{name}: {kind} {jax.tree_util.keystr(path)} is {leaf.dtype}"
  moments = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
  assert len(moments) == 2 * len(jax.tree.leaves(params))  # Adam's mu and nu, one per parameter
  if source.hf_dir is not None:  # the real-size recipes compute in bf16 over float32 master weights
    assert model_cfg.dtype == "bfloat16" and model_cfg.param_dtype == "float32"


def test_bf16_checkpoint_loads_float32_master_weights_and_source_config_agrees(tmp_path):
  """A bf16 compute dtype no longer makes bf16 storage, and ModelSource.config() reports what build() makes."""
  src = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32")
  models.save_pretrained(src, tmp_path, dtype="bfloat16")
  assert models.config_from_dir(tmp_path).dtype == "bfloat16"  # compute follows the checkpoint
  source = models.ModelSource(hf_dir=str(tmp_path), overrides={"dtype": "bfloat16"})
  model = source.build()
  assert model.cfg == source.config()
  assert (model.cfg.dtype, model.cfg.param_dtype) == ("bfloat16", "float32")
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.float32)}
  stored = models.load_pretrained(tmp_path, param_dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(nnx.state(stored))} == {jnp.dtype(jnp.bfloat16)}


def _one_step(param_dtype: str, lr: float):
  """One AdamW step of a bf16-compute model; returns (params before, after, opt_state before, after)."""
  cfg = models.ModelConfig.tiny(num_layers=1, vocab_size=64, dtype="bfloat16", param_dtype=param_dtype)
  graphdef, params = nnx.split(models.init_model(cfg, seed=0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)), jnp.int32)
  batch = dict(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16)),
               segment_ids=jnp.ones((4, 16), jnp.int32))

  traces = []

  def loss_fn(params, mb):
    traces.append(1)
    m = nnx.merge(graphdef, params)
    h = m(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"], return_hidden=True)
    return -jnp.mean(losses.token_logprobs(h, m.unembed_matrix(), jnp.roll(mb["tokens"], -1, 1))), {}

  optimizer = train.make_optimizer(train.OptimConfig(lr=lr, schedule="constant", clip_norm=None), 10)
  state = train.init_train_state(params, optimizer)
  step = train.make_train_step(loss_fn, optimizer, donate=False)
  new, _ = step(state, batch)
  return state, new, lambda s: (step(s, batch), len(traces))[1]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_adam_moments_are_float32_and_keep_their_dtype_across_steps(param_dtype):
  state, new, step = _one_step(param_dtype, 1e-3)
  dtypes = lambda tree: [x.dtype for x in jax.tree.leaves(tree)]
  assert all(d == jnp.float32 for d in dtypes(state.opt_state) if jnp.issubdtype(d, jnp.floating))
  assert dtypes(new.opt_state) == dtypes(state.opt_state)
  assert dtypes(new.params) == dtypes(state.params) == [jnp.dtype(param_dtype)] * len(dtypes(state.params))
  assert step(new) == 1  # the second step reuses the first step's trace: no dtype changed


def test_bf16_compute_step_at_lr_1e_6_moves_float32_weights_where_bf16_storage_rounds_it_away():
  """Adam's first step moves each weight by about lr = 1e-6; a bf16 weight of size ~0.02 has a spacing
  of ~1e-4, so bf16 storage loses the whole update while float32 storage keeps it."""
  changed = {}
  for param_dtype in ("float32", "bfloat16"):
    state, new, _ = _one_step(param_dtype, 1e-6)
    before = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(state.params)])
    after = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(new.params)])
    moment = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(new.opt_state)
                             if getattr(x, "ndim", 0) > 0][: len(jax.tree.leaves(state.params))])
    has_grad = moment != 0  # Adam's first moment after one step is (1 - b1)·g
    changed[param_dtype] = float(np.mean(before[has_grad] != after[has_grad]))
  assert changed["float32"] > 0.99, changed
  assert changed["bfloat16"] < 0.05, changed


def test_cast_params_makes_compute_dtype_copies_on_device_with_the_same_shardings():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  model = models.init_model(models.ModelConfig.tiny(dtype="bfloat16"), mesh=mesh, seed=0)
  cast = models.cast_params(model, "bfloat16")
  src, out = nnx.state(model), nnx.state(cast)
  for (path, a), (_, b) in zip(nnx.to_flat_state(src), nnx.to_flat_state(out)):
    a, b = a.get_value(), b.get_value()
    assert b.dtype == jnp.bfloat16 and b.sharding.is_equivalent_to(a.sharding, a.ndim), path
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a.astype(jnp.bfloat16), np.float32))
  assert tuple(cast.layers.attn.q_proj.get_value().sharding.spec)[:3] == (None, "fsdp", "tensor")
  same = jax.tree.leaves(models.cast_params(src, "float32"))
  assert all(x is y for x, y in zip(same, jax.tree.leaves(src)))  # nothing to cast: no copy
  copied = jax.tree.leaves(models.cast_params(src, "float32", copy=True))
  assert all(x is not y and x.unsafe_buffer_pointer() != y.addressable_shards[0].data.unsafe_buffer_pointer()
             for x, y in zip((c.addressable_shards[0].data for c in copied), jax.tree.leaves(src)))


@pytest.mark.parametrize("tied", [False, True])
def test_unembedding_is_cast_to_the_compute_dtype_for_every_log_prob_path(tied):
  """The model's logits, the trainer's/reference's chunked log-probs and the sampler all use
  ``unembed_matrix()``: bf16 under bf16 compute even though the stored weights are float32."""
  cfg = models.ModelConfig.tiny(num_layers=1, dtype="bfloat16", tie_word_embeddings=tied)
  model = models.abstract_model(cfg)
  stored = model.embed if tied else model.lm_head
  assert stored.get_value().dtype == jnp.float32
  w = jax.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)).unembed_matrix())
  assert (w.shape, w.dtype) == ((cfg.hidden_size, cfg.vocab_size), jnp.bfloat16)


@pytest.mark.parametrize("micro", [1, 2])
def test_train_step_on_the_compute_view_gives_the_master_weights_update(micro):
  """``models.compute_view``: the train step differentiates a bf16 view of the float32 weights (what its
  loops then carry) instead of the float32 weights the model casts at every use. The embedding and the
  norm scales stay float32; the loss, the gradient norm and the updated float32 weights and Adam moments
  are those of the plain step (to float32 rounding: XLA fuses the two programs differently), on an FSDP
  mesh, with and without micro-batches. Casting the norm scales or the embedding too moves the gradients
  by bf16 rounding (~1e-3), which this catches."""
  mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
  cfg = models.ModelConfig.tiny(num_layers=2, vocab_size=64, dtype="bfloat16", param_dtype="float32")
  graphdef, params = nnx.split(models.init_model(cfg, mesh=mesh, seed=0))
  view = models.compute_view(params, "bfloat16")
  dtypes = {"/".join(str(getattr(k, "key", "")) for k in p if getattr(k, "key", None)): x.dtype
            for p, x in jax.tree_util.tree_leaves_with_path(view)}
  assert dtypes.pop("embed") == dtypes.pop("final_norm/scale") == jnp.float32
  assert dtypes.pop("layers/attn_norm/scale") == dtypes.pop("layers/mlp_norm/scale") == jnp.float32
  assert set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)} and "lm_head" in dtypes, dtypes
  assert models.compute_view(params, "float32") is not None
  assert all(a is b for a, b in zip(jax.tree.leaves(models.compute_view(params, "float32")), jax.tree.leaves(params)))

  rng = np.random.default_rng(0)
  batch = dict(tokens=jnp.asarray(rng.integers(0, 64, (8, 16)), jnp.int32),
               positions=jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (8, 16)),
               segment_ids=jnp.ones((8, 16), jnp.int32))

  def loss_fn(params, mb):
    m = nnx.merge(graphdef, params)
    h = m(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"], return_hidden=True)
    return -jnp.sum(losses.token_logprobs(h, m.unembed_matrix(), jnp.roll(mb["tokens"], -1, 1))) / 128, {}

  optimizer = train.make_optimizer(train.OptimConfig(lr=1e-3, schedule="constant"), 10)
  state = train.place_on_mesh(train.init_train_state(params, optimizer), mesh)
  out = {}
  for name, view_fn in (("master", None), ("view", lambda p: models.compute_view(p, "bfloat16"))):
    step = train.make_train_step(loss_fn, optimizer, micro_batches=micro, mesh=mesh, donate=False,
                                 compute_view=view_fn)
    out[name] = step(state, batch)
  (a, ma), (b, mb) = out["master"], out["view"]
  assert float(ma["loss"]) == float(mb["loss"])
  np.testing.assert_allclose(float(mb["grad_norm"]), float(ma["grad_norm"]), rtol=2e-6)
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state)), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-9)
