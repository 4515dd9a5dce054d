"""Orbax checkpoints of the training state, the data-iterator state and the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every ``every`` steps, keeps the last ``keep`` and restores the latest (``resume=auto``).

  A checkpoint holds the train state pytree (params, optimizer state, step, RNG — whatever the
  trainer passes) and a JSON item for host-side state such as the data iterator's position.

  On several processes (after ``jax.distributed.initialize``) every process calls :meth:`save` and
  :meth:`restore` together: each writes its own shards of the state, process 0 alone writes the JSON
  item (the trainers keep host state global, the same on every process), and a restore reshards onto
  ``abstract_state``'s shardings, so a checkpoint restores on any process count.
  """

  def __init__(self, directory: str | Path, *, every: int, keep: int = 3):
    if every < 1:
      raise ValueError(f"checkpoint.every must be >= 1, got {every}")
    if keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    self.directory = Path(directory).absolute()
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "host"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, host: dict[str, Any], *, force: bool = False) -> bool:
    saved = self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
        force=force)
    return bool(saved)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
    """Restores ``step`` (default: latest) into arrays shaped and sharded like ``abstract_state``."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), host=ocp.args.JsonRestore()))
    return step, out["state"], dict(out["host"])

  def wait(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()
