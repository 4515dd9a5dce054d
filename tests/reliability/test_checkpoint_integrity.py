"""Checkpoints: retention (keep-last-K + keep-every-M), partial saves ignored, integrity manifests,
fallback to the newest valid checkpoint, and a full disk during a save (docs/reliability.md)."""

import errno

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

from jaxrl import sharding, train
from jaxrl.train._checkpoint import MANIFEST


def _state():
  mesh = sharding.make_mesh({"fsdp": 8})
  return {"w": jax.device_put(jnp.arange(16, dtype=jnp.float32), NamedSharding(mesh, P("fsdp"))),
          "step": jnp.asarray(0, jnp.int32)}


def _save_steps(ckpt, state, steps):
  for step in steps:
    ckpt.save(step, jax.tree.map(lambda x: x + step, state), {"data": {"pos": step}})
  ckpt.wait()


def _open(path, logs, **kw):
  return train.Checkpointer(path, every=1, log=logs.append, **kw)


def _data_file(step_dir):
  """The largest array-data file of a checkpoint (the one holding ``w``)."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
  return max(files, key=lambda p: p.stat().st_size)


def test_keeps_the_newest_k_and_every_multiple_of_m(tmp_path):
  ckpt = train.Checkpointer(tmp_path, every=1, keep=2, keep_every=4)
  _save_steps(ckpt, _state(), range(1, 11))
  ckpt.close()
  assert ckpt.committed_steps() == [4, 8, 9, 10]
  assert all((tmp_path / str(s) / MANIFEST).is_file() for s in (4, 8, 9, 10))


def test_a_partial_save_is_ignored_logged_and_removed(tmp_path):
  logs = []
  ckpt = _open(tmp_path, logs, keep=3)
  state = _state()
  _save_steps(ckpt, state, [1, 2])
  ckpt.close()
  partial = tmp_path / "3.orbax-checkpoint-tmp"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half_written").write_bytes(b"\0" * 10)
  ckpt = _open(tmp_path, logs, keep=3)
  assert any("partial checkpoint of step 3" in line for line in logs), logs
  assert not partial.exists()
  step, restored, host = ckpt.restore(state)
  ckpt.close()
  assert step == 2 and host == {"data": {"pos": 2}}
  np.testing.assert_array_equal(restored["w"], np.arange(16) + 2)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_older_one_and_names_the_file(tmp_path, damage):
  logs = []
  ckpt = _open(tmp_path, logs, keep=3)
  state = _state()
  _save_steps(ckpt, state, [1, 2])
  victim = _data_file(tmp_path / "2")
  data = bytearray(victim.read_bytes())
  if damage == "flip":
    data[len(data) // 2] ^= 0xFF
  else:
    data = data[:len(data) // 2]
  victim.write_bytes(bytes(data))
  with pytest.raises(train.CheckpointError, match=r"step 2: .*" + victim.name):
    ckpt.restore(state, step=2)  # an explicit step is never replaced by another
  step, restored, _ = ckpt.restore(state)
  assert step == 1
  np.testing.assert_array_equal(restored["w"], np.arange(16) + 1)
  assert any("step 2" in line and victim.name in line for line in logs), logs
  assert (tmp_path / "2.unusable").is_dir()  # kept for inspection, out of Orbax's way
  _save_steps(ckpt, state, [2])  # the resumed run writes step 2 again
  ckpt.close()
  assert ckpt.committed_steps() == [1, 2]


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
  ckpt = _open(tmp_path, [], keep=1)
  state = _state()
  _save_steps(ckpt, state, [1])
  victim = _data_file(tmp_path / "1")
  victim.write_bytes(victim.read_bytes()[:8])
  with pytest.raises(train.CheckpointError, match=r"no usable checkpoint .*step 1: .*" + victim.name + r".*bytes"):
    ckpt.restore(state)
  ckpt.close()


def test_an_unreadable_checkpoint_without_manifest_falls_back(tmp_path):
  logs = []
  ckpt = _open(tmp_path, logs, keep=3)
  state = _state()
  _save_steps(ckpt, state, [1, 2])
  (tmp_path / "2" / MANIFEST).unlink()  # committed just before a crash: not yet sealed
  for p in (tmp_path / "2" / "state").rglob("*"):
    if p.is_file() and "/d/" in str(p):
      p.unlink()
  step, _, _ = ckpt.restore(state)
  ckpt.close()
  assert step == 1
  assert any("step 2" in line for line in logs), logs


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def full_disk(self):
    if self._final_path.name == "2":
      raise OSError(errno.ENOSPC, "No space left on device", str(self._tmp_path))
    return await finalize(self)
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", full_disk)
  state = _state()
  ckpt = _open(tmp_path, [], keep=3)
  _save_steps(ckpt, state, [1])
  with pytest.raises(Exception, match="No space left on device"):
    _save_steps(ckpt, state, [2])
  monkeypatch.undo()
  logs = []
  ckpt = _open(tmp_path, logs, keep=3)
  assert any("partial checkpoint of step 2" in line for line in logs), logs
  step, restored, _ = ckpt.restore(state)
  ckpt.close()
  assert step == 1
  np.testing.assert_array_equal(restored["w"], np.arange(16) + 1)


def test_a_manifest_that_cannot_be_written_leaves_the_checkpoint_usable(tmp_path, monkeypatch):
  from jaxrl.train import _checkpoint

  def full_disk(step_dir, step):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(_checkpoint, "write_manifest", full_disk)
  logs = []
  ckpt = _open(tmp_path, logs, keep=3)
  state = _state()
  _save_steps(ckpt, state, [1])
  assert any(MANIFEST in line and "step 1" in line for line in logs), logs
  step, _, _ = ckpt.restore(state)
  ckpt.close()
  assert step == 1
