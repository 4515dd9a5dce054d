"""The SFT trainer end to end on the tiny model: learning, resume, split-invariance, export."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, sharding, sft, train

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def _cfg(tmp_path, **over):
  base = {
      "model": TINY,
      "data": {"builtin": {"n_train": 400, "n_heldout": 16, "difficulty": 2, "seed": 0}},
      "packing": {"seq_len": 64, "global_rows": 8, "buffer_size": 16},
      "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
      "steps": 6,
      "eval": {"every": 0, "exact_match": 0},
      "out_dir": str(tmp_path / "run"),
      "export_hf": False,
      "tensorboard": False,
  }
  data = config_lib.apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in over.items()])
  return config_lib.from_dict(sft.SFTConfig, data)


def test_loss_falls_and_every_parameter_changes(tmp_path):
  trainer = sft.SFTTrainer(_cfg(tmp_path, steps=12))
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.params))
  out = trainer.run()
  assert np.mean(out["losses"][-3:]) < out["losses"][0] - 0.5, out["losses"]
  after = nnx.to_pure_dict(trainer.state.params)
  for path, old in jax.tree_util.tree_leaves_with_path(before):
    new = np.asarray(_get(after, path))
    assert not np.array_equal(old, new), f"parameter {jax.tree_util.keystr(path)} did not change"


def _get(tree, path):
  for k in path:
    tree = tree[k.key if hasattr(k, "key") else k.idx]
  return tree


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
  straight = sft.SFTTrainer(_cfg(tmp_path / "a", steps=6)).run()["losses"]
  cfg = _cfg(tmp_path / "b", steps=6, checkpoint={"every": 3, "keep": 2})
  first = sft.SFTTrainer(cfg).run(until=3)
  assert first["stopped_at"] == 3
  resumed = sft.SFTTrainer(cfg).run()  # a fresh process would do exactly this: resume=auto
  assert resumed["start_step"] == 3
  np.testing.assert_allclose(first["losses"] + resumed["losses"], straight, rtol=1e-5)


def test_export_writes_an_hf_dir_that_reloads_to_the_same_logits(tmp_path):
  trainer = sft.SFTTrainer(_cfg(tmp_path, steps=2, export_hf=True))
  out = trainer.run()
  model = models.load_pretrained(out["hf_dir"])
  tokens = np.arange(1, 17, dtype=np.int32)[None]
  pos = np.arange(16, dtype=np.int32)[None]
  seg = np.ones((1, 16), np.int32)
  trained = nnx.merge(trainer.graphdef, trainer.state.params)
  np.testing.assert_array_equal(model(tokens, positions=pos, segment_ids=seg),
                                trained(tokens, positions=pos, segment_ids=seg))
  assert (tmp_path / "run" / "curves.png").stat().st_size > 0


MODES = [("token_sum", "none"), ("global_token_mean", "default"), ("sample_mean", "none"),
         ("sample_mean", "gbs_true"), ("turn_mean", "gbs_true")]


@pytest.fixture(scope="module")
def packed_batch(tmp_path_factory):
  """8 packed rows of multi-turn samples of varied lengths (several samples and turns per row)."""
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  records = data_lib.generate_arithmetic(40, seed=1, config=data_lib.ArithmeticConfig.level(2, num_turns=2))
  path = data_lib.write_jsonl(records, tmp_path_factory.mktemp("data") / "train.jsonl")
  batches = data_lib.sft_batches(data_lib.DataConfig(paths=(str(path),), shuffle=False),
                                 data_lib.PackingConfig(seq_len=256, global_rows=8, buffer_size=40), tok)
  arrays = next(iter(batches)).arrays
  assert (arrays["segment_ids"].max(axis=1) >= 2).all()  # really packed
  return arrays


@pytest.mark.parametrize("mode,divisor", MODES)
def test_model_gradients_do_not_depend_on_the_split(packed_batch, mode, divisor):
  cfg = models.ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                                num_heads=4, num_kv_heads=2)
  graphdef, params = nnx.split(models.init_model(cfg, seed=0))
  loss_cfg = sft.SFTLoss(mode=mode, divisor=divisor, chunk_size=32)
  loss_fn, prepare = sft.sft_loss_fn(graphdef, loss_cfg), sft.sft_prepare(loss_cfg)

  def grads(devices, micro):
    mesh = sharding.make_mesh({"data": devices}, devices=jax.devices()[:devices])
    batch = jax.device_put(packed_batch, NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda p, b: train.accumulate_gradients(loss_fn, p, prepare(b), micro_batches=micro, mesh=mesh))
    loss, g, _ = fn(train.place_on_mesh(params, mesh), batch)
    return loss, g

  ref_loss, ref = grads(1, 1)
  for devices, micro in [(2, 4), (8, 1), (4, 2)]:
    loss, g = grads(devices, micro)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_lora_trains_only_adapters_and_exports_a_peft_adapter(tmp_path):
  trainer = sft.SFTTrainer(_cfg(tmp_path, steps=3, lora={"rank": 4, "alpha": 8, "targets": "all"},
                                export_hf=True))
  base_before = jax.tree.map(np.asarray, trainer.frozen[0])
  out = trainer.run()
  adapter_leaves = jax.tree.leaves(trainer.state.params)
  assert adapter_leaves and all(leaf.shape[-1] == 4 or leaf.shape[1] == 4 for leaf in adapter_leaves)
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(trainer.frozen[0])):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
  merged = models.load_pretrained(out["hf_dir"])
  tokens = np.arange(1, 17, dtype=np.int32)[None]
  pos, seg = np.arange(16, dtype=np.int32)[None], np.ones((1, 16), np.int32)
  np.testing.assert_allclose(merged(tokens, positions=pos, segment_ids=seg),
                             trainer.current_model()(tokens, positions=pos, segment_ids=seg), atol=1e-4)


def test_lr_multipliers_under_lora_resume_like_an_uninterrupted_run(tmp_path):
  """``optim.lr_multipliers`` on the LoRA adapters' paths: the sharded state checkpoints and resumes to the same
  losses; a regex for a frozen (base) weight is refused, naming it."""
  over = dict(steps=4, lora={"rank": 4, "alpha": 8, "targets": "all"},
              optim={"lr": 3e-3, "warmup_steps": 2, "lr_multipliers": {"lora_b$": 4.0, "mlp": 0.5}})
  straight = sft.SFTTrainer(_cfg(tmp_path / "a", **over)).run()["losses"]
  cfg = _cfg(tmp_path / "b", checkpoint={"every": 2, "keep": 2}, **over)
  first = sft.SFTTrainer(cfg).run(until=2)
  resumed = sft.SFTTrainer(cfg).run()
  assert resumed["start_step"] == 2
  np.testing.assert_allclose(first["losses"] + resumed["losses"], straight, rtol=1e-5)
  plain = sft.SFTTrainer(_cfg(tmp_path / "d", **dict(over, optim={"lr": 3e-3, "warmup_steps": 2}))).run()["losses"]
  assert plain[0] == pytest.approx(straight[0]) and not np.allclose(plain[1:], straight[1:], rtol=1e-4)  # applied
  with pytest.raises(ValueError, match=r"'embed' matches no trainable parameter"):
    sft.SFTTrainer(_cfg(tmp_path / "c", **dict(over, optim={"lr": 3e-3, "lr_multipliers": {"embed": 2.0}})))


def test_caption_answer_task_trains_a_text_answerer_on_caprl_prompts(tmp_path):
  section = {"n_train": 64, "n_heldout": 8, "scenes": 16, "difficulty": 0, "image_size": 56, "max_objects": 1,
             "shape_scale": 3.0, "answerer": {"template": "Description:\n{caption}\n\nQuestion: {question}\n"
                                                          "Options:\n{options}\n\nAnswer:"}}
  cfg = _cfg(tmp_path, steps=2, **{"data.caption_answer_task": section, "packing.seq_len": 256})
  sft.SFTTrainer(cfg).run()
  train = [json.loads(line) for line in open(tmp_path / "run" / "data" / "train.jsonl")]
  assert len(train) == 64 and train[0]["messages"][0]["content"].startswith("Description:\n")
  assert train[0]["messages"][1]["content"].split()[-1] == train[0]["letter"]
  vl = {"preset": "tiny_vl", "overrides": {"vocab_size": 128, "vision_start_token_id": 103, "vision_end_token_id": 104,
                                           "image_token_id": 105, "video_token_id": 106}}
  with pytest.raises(ValueError, match="data.caption_answer_task: trains a text answerer"):
    sft.SFTTrainer(_cfg(tmp_path / "vl", model=vl, **{"data.caption_answer_task": section})).run()
