"""The Coconut trainer's step on the 8-device mesh (data × fsdp) against the same loss on one device."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data, latent, models, sharding, train


def test_sharded_step_loss_equals_single_device(tmp_path):
  cfg = latent.CoconutConfig(
      model=models.ModelSource(preset="tiny", seed=3, overrides=dict(
          vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)),
      data=latent.LatentData(builtin=data.BuiltinTask(n_train=64, n_heldout=0, difficulty=2)),
      method="no_curriculum", max_stage=2, steps=1, batch_size=8, pack_length=128, eot_head=0.5,
      mesh=sharding.MeshConfig(shape={"data": 2, "fsdp": 4}), out_dir=str(tmp_path))
  trainer = latent.CoconutTrainer(cfg)
  assert trainer.mesh.devices.size == 8
  examples = trainer.examples(trainer.train_chains, 2)
  layout = trainer.layouts({2: examples})[2]
  assert isinstance(layout, latent.PackedLayout) and layout.thoughts == 2
  rows = trainer.draw_rows(np.random.default_rng(0), examples, layout)
  assert (rows["segment_ids"].max(axis=1) >= 2).all()  # every row packs several examples
  host_params = jax.tree.map(np.asarray, trainer.trainable())  # the step donates the placed ones
  optimizer = train.make_optimizer(cfg.optim, 1)
  state = train.place_on_mesh(train.init_train_state(trainer.trainable(), optimizer), trainer.mesh)
  batch = {k: sharding.global_batch(v, trainer.batch_sharding) for k, v in rows.items()}
  assert batch["tokens"].sharding.spec[0] == ("data", "fsdp")
  _, metrics = trainer.make_step(layout, optimizer)(state, batch)

  # The same loss on one device: an unplaced copy of the model with the same weights.
  graphdef, _ = nnx.split(cfg.model.build())
  params = jax.tree.map(jnp.asarray, host_params)
  loss_fn = latent.latent_loss_fn(graphdef, layout, eot_weight=0.5)
  single = {k: jnp.asarray(v) for k, v in rows.items()}
  (loss, aux), grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, latent.token_mean_prepare(single)),
                                                  has_aux=True))(params)
  assert float(aux["eot_bce"]) > 0
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(jnp.sqrt(sum(jnp.sum(g * g) for g in
                                                                             jax.tree.leaves(grads)))), rtol=1e-5)
