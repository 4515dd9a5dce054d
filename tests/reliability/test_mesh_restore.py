"""A checkpoint saved on fsdp=8 restores on data=2, fsdp=2, tensor=2 with identical values, and the
next step's loss matches the uninterrupted fsdp=8 run."""

import shutil

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl import sft, train

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def _cfg(out_dir, mesh):
  return config_lib.from_dict(sft.SFTConfig, {
      "model": TINY, "data": {"builtin": {"n_train": 12, "n_heldout": 4, "difficulty": 2, "seed": 0}},
      "packing": {"seq_len": 64, "global_rows": 16, "buffer_size": 4},
      "optim": {"lr": 3e-3, "warmup_steps": 0}, "steps": 3, "eval": {"every": 0, "exact_match": 0},
      "checkpoint": {"every": 1, "keep": 3}, "mesh": {"shape": mesh}, "export_hf": False,
      "tensorboard": False, "out_dir": str(out_dir)})


def test_restore_on_another_mesh_gives_identical_values_and_the_same_next_loss(tmp_path):
  straight = sft.SFTTrainer(_cfg(tmp_path / "a", {"fsdp": 8}))
  step_fn, trained = straight.step_fn, {}

  def recording_step(state, *args):  # the uninterrupted run's state after each step, in memory
    out = step_fn(state, *args)
    trained[int(out[0].step)] = jax.tree.map(np.asarray, out[0])
    return out
  straight.step_fn = recording_step
  want = straight.run()  # uninterrupted, checkpoints 1-3
  (tmp_path / "b").mkdir()
  shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "3")  # as if stopped after step 2
  saved = train.Checkpointer(tmp_path / "a" / "checkpoints", every=1)
  _, _, host = saved.restore(straight.state, step=2)
  saved.close()
  at_2 = trained[2]  # what the checkpoint of step 2 must hold, taken from the run, not from a restore

  moved = sft.SFTTrainer(_cfg(tmp_path / "b", {"data": 2, "fsdp": 2, "tensor": 2}))
  step, restored, moved_host = moved.checkpointer.restore(moved.state)
  assert step == 2 and moved_host == host
  paths = jax.tree_util.tree_flatten_with_path(at_2)[0]
  for (path, a), b in zip(paths, jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
  for a, b in zip(jax.tree.leaves(moved.state), jax.tree.leaves(restored)):
    assert b.sharding == a.sharding  # laid out for the new mesh
  assert {s.sharding.mesh.shape_tuple for s in jax.tree.leaves(restored)} == {
      (("data", 2), ("fsdp", 2), ("sequence", 1), ("tensor", 2))}

  got = moved.run()  # resumes at 2 on the new mesh and trains step 3
  assert got["start_step"] == 2
  # One step on another mesh sums in another order: equal to float32 rounding, not bit for bit.
  np.testing.assert_allclose(got["losses"], want["losses"][2:], rtol=1e-6)
