"""RL with LoRA: adapters are the only trained state, the frozen base is the KL reference (no copy
of the weights), the sampler runs the unmerged adapters, exports reload to the same policy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_testlib import first_micro_batch_ratios, make_config

from jaxrl import models, rl, train
from jaxrl.rl._loss import make_logprob_fn


def _flat(state) -> dict:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  cfg = make_config(
      tmp_path_factory.mktemp("lora"), **{
          "lora": {"rank": 4, "alpha": 8, "lr_multiplier": 10.0}, "optim.lr": 1e-3, "optim.schedule": "constant",
          "algorithm.kl_coef": 0.05, "algorithm.old_logprobs": "recompute", "algorithm.mini_batches": 2,
          "steps": 3, "export_hf": True})
  trainer = rl.RLTrainer(cfg)
  adapters = {k: v.copy() for k, v in _flat(trainer.state.params).items()}  # the step donates the state
  before = {"base": _flat(trainer.frozen[0]), "adapters": adapters}
  try:
    out = trainer.run()
  finally:
    trainer.close()
  return trainer, out, before


def test_only_adapters_train_and_the_base_stays_frozen(lora_run):
  trainer, _, before = lora_run
  trained = _flat(trainer.state.params)
  assert trained and all(k.endswith(("_lora_a", "_lora_b")) for k in trained), list(trained)
  assert trained.keys() == before["adapters"].keys()
  unchanged = [k for k, v in trained.items() if np.array_equal(v, before["adapters"][k])]
  assert not unchanged, f"adapters that did not train: {unchanged}"  # every A and B (B from 0)
  for k, v in _flat(trainer.frozen[0]).items():
    np.testing.assert_array_equal(v, before["base"][k], err_msg=k)
  # No optimizer state and no reference copy for the base.
  assert trainer.ref_params is None
  full = train.init_train_state(nnx.state(trainer.current_model()), trainer.optimizer)
  ratio = models.optimizer_state_bytes(trainer.state.opt_state) / models.optimizer_state_bytes(full.opt_state)
  assert ratio < 0.5, ratio
  assert trainer.cfg.optim.lr * 10.0 == pytest.approx(float(trainer.history[-1]["lr"]))


def test_kl_reference_is_the_base_model_with_adapters_off(lora_run):
  trainer, _, _ = lora_run
  pb = trainer.pack(trainer.last_rollout, 1)[0][0]
  batch = trainer._device(pb.interleaved())

  def per_micro_batch(lp):  # interleaved rows [R·M, T] -> [M, R, T] like pb.micro_batch(m)
    m, r, t = pb.shape
    return np.asarray(lp).reshape(r, m, t).transpose(1, 0, 2)
  ref = per_micro_batch(trainer._forward(trainer.state.params, batch, pb.num_micro, fn=trainer.ref_logprob_fn))
  policy = per_micro_batch(trainer._forward(trainer.state.params, batch, pb.num_micro))
  # Independent reference: the model section built again, without adapters.
  plain = trainer.cfg.model.build(mesh=trainer.mesh, rules=trainer.rules)
  graphdef, params = nnx.split(plain)
  fn = make_logprob_fn(graphdef, temperature=trainer.cfg.rollout.temperature,
                       chunk_size=trainer.cfg.algorithm.logprob_chunk_size)
  expected = np.zeros(pb.shape, np.float32)
  for m in range(pb.num_micro):
    mb = pb.micro_batch(m)
    expected[m] = np.asarray(fn(params, trainer._device({k: mb[k] for k in ("tokens", "targets", "positions",
                                                                             "segment_ids")})))
  expected *= pb.arrays["loss_mask"]
  np.testing.assert_allclose(ref, expected, atol=1e-5, rtol=0)
  assert np.abs(policy - ref).max() > 1e-4  # the adapters changed the policy, not the reference
  assert all(h["kl"] >= 0 for h in trainer.history if "kl" in h)


def test_ratios_and_the_sampler_agree_with_the_adapted_policy(lora_run):
  trainer, _, _ = lora_run
  step = len(trainer.history)
  # π_old recomputed through the adapters equals the loss's forward (so the first-mini-batch shortcut
  # is exact), and the ratio reads π_old.
  lo, hi = first_micro_batch_ratios(trainer, trainer.last_rollout, step, shift=0.0, current_as_old=False)
  assert abs(lo - 1.0) < 1e-5 and abs(hi - 1.0) < 1e-5, (lo, hi)
  lo, hi = first_micro_batch_ratios(trainer, trainer.last_rollout, step, shift=0.1, current_as_old=False)
  assert abs(lo - math.exp(-0.1)) < 1e-5 and abs(hi - math.exp(-0.1)) < 1e-5, (lo, hi)
  for h in trainer.history:
    # The sampler decoded with the unmerged adapters: its log-probs match the trainer's forward.
    assert h["logprob_diff/max_abs"] < 1e-4, h


def test_exports_reload_to_the_trained_policy(lora_run):
  trainer, out, _ = lora_run
  tokens = jnp.asarray(np.arange(1, 25, dtype=np.int32)[None] % 120)
  pos = jnp.arange(24, dtype=jnp.int32)[None]
  seg = jnp.ones_like(tokens)
  want = np.asarray(trainer.current_model()(tokens, positions=pos, segment_ids=seg))
  merged = models.load_pretrained(out["hf_dir"], dtype="float32")
  np.testing.assert_allclose(np.asarray(merged(tokens, positions=pos, segment_ids=seg)), want, atol=1e-4)
  fresh = models.load_peft(trainer.cfg.model.build(), out["adapter_dir"])
  np.testing.assert_allclose(np.asarray(fresh(tokens, positions=pos, segment_ids=seg)), want, atol=1e-4)
