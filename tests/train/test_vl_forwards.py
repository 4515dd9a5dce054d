"""Every trainer forward takes a VLM batch (M-RoPE positions + per-row images): the RL log-prob recompute,
the PPO critic and the preference pair log-probs, each against a float64 reference of the model's own
image-conditioned forward; dropping the images changes each result (they really reach it)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import models, pref, rl, sft
from jaxrl.rl import _critic

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2_5_vl"


@pytest.fixture(scope="module")
def vl():
  """The fixture VLM, a 4-row per-row VL batch on device and the float64 log-softmax of its logits."""
  model = models.load_pretrained(FIXTURE, dtype="float32")
  tok = models.load_tokenizer(FIXTURE)
  records = data_lib.BuiltinImageTask(n_train=16, difficulty=0, image_size=56, seed=2).records("train")
  records = [{**r, "_index": i, "_where": f"task:{i + 1}"} for i, r in enumerate(records)]
  ds = data_lib.vl_batches(records, tok, images=data_lib.ImageConfig(), model_config=model.cfg,
                           vision=data_lib.VisionPackingConfig(min_patches=16, per_row=True),
                           packing=data_lib.PackingConfig(seq_len=160, global_rows=4, buffer_size=16),
                           shuffle=False, num_threads=0)
  arrays = next(iter(ds)).arrays
  batch = jax.tree.map(jnp.asarray, sft.vl_device_arrays(arrays))
  hidden = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                 rope_positions=batch["rope_positions"], images=models.VisionInputs.from_batch(batch),
                 return_hidden=True)
  logits = np.asarray(model.unembed(hidden), np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  target_lp = np.take_along_axis(logp, arrays["targets"][..., None].astype(np.int64), -1)[..., 0]  # [R, T]
  return model, batch, arrays, np.asarray(hidden, np.float64), target_lp


def _blind(batch):
  return {k: v for k, v in batch.items() if k not in ("pixel_values", "rope_positions", *models.VISION_LAYOUT_KEYS)}


def test_rl_policy_logprobs_take_the_images(vl):
  model, batch, arrays, _, target_lp = vl
  graphdef, params = nnx.split(model)
  got = np.asarray(rl.policy_logprobs(graphdef, params, batch, temperature=1.0, chunk_size=32))
  real = arrays["segment_ids"] > 0
  np.testing.assert_allclose(got[real], target_lp[real], rtol=0, atol=2e-5)
  blind = np.asarray(rl.policy_logprobs(graphdef, params, _blind(batch), temperature=1.0, chunk_size=32))
  assert np.abs(blind[real] - target_lp[real]).max() > 1e-2


def test_critic_values_take_the_images(vl):
  model, batch, arrays, hidden, _ = vl
  vm = models.ValueModel(nnx.clone(model))  # the value head replaces the clone's lm_head
  w = np.random.default_rng(0).normal(size=hidden.shape[-1]).astype(np.float32)
  vm.value_head.set_value(jnp.asarray(w))
  vm.value_bias.set_value(jnp.asarray(0.5, jnp.float32))
  graphdef, params = nnx.split(vm)
  got = np.asarray(_critic.critic_values(graphdef, params, batch))
  want = hidden @ w.astype(np.float64) + 0.5
  real = arrays["segment_ids"] > 0
  np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
  blind = np.asarray(_critic.critic_values(graphdef, params, _blind(batch)))
  assert np.abs(blind[real] - want[real]).max() > 1e-3


def test_preference_pair_logps_take_the_images(vl):
  model, batch, arrays, _, target_lp = vl
  seg = arrays["segment_ids"]
  offsets = np.concatenate([[0], np.cumsum(seg.max(axis=1))])[:-1]
  seq_ids = np.where(seg > 0, seg + offsets[:, None], 0)  # global 1..S, row-major
  num = int(seq_ids.max()) // 2 * 2
  seq_ids = np.where(seq_ids > num, 0, seq_ids)
  pairs = dict(batch, seq_ids=jnp.asarray(seq_ids), pair_valid=jnp.ones((num // 2,), jnp.float32))
  chosen, rejected = pref.pair_logps(model, pairs, 32)
  mask = arrays["loss_mask"].astype(np.float64)
  want = np.asarray([(target_lp * mask)[seq_ids == s].sum() for s in range(1, num + 1)])
  np.testing.assert_allclose(np.asarray(chosen), want[0::2], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rejected), want[1::2], rtol=1e-5, atol=1e-4)
  blind_chosen, _ = pref.pair_logps(model, dict(_blind(batch), seq_ids=pairs["seq_ids"],
                                                pair_valid=pairs["pair_valid"]), 32)
  assert np.abs(np.asarray(blind_chosen) - want[0::2]).max() > 1e-2
