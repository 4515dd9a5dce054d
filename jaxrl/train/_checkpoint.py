"""Orbax checkpoints of the training state, the data-iterator state and the step: atomic commits,
integrity manifests, keep-last-K plus keep-every-M, and restore that skips unusable checkpoints.

A step's checkpoint is written into ``<dir>/<step>.orbax-checkpoint-tmp`` and renamed to ``<dir>/<step>``
once every file is written (Orbax's atomic-rename commit), so a crash during a save leaves a temporary
directory that no restore looks at (it is removed, with a logged line, the next time a
:class:`Checkpointer` opens the directory). After the commit, process 0 writes ``jaxrl_manifest.json``
into the step directory: each file's size and CRC-32, computed in a background thread. A restore checks
the manifest first, so a truncated, missing or altered file is reported by step and file name before
Orbax reads anything. See docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as ocp_preserve
from orbax.checkpoint._src.checkpoint_managers import save_decision_policy as ocp_decide

from jaxrl import sharding

MANIFEST = "jaxrl_manifest.json"
"""Per-step integrity manifest: ``{"step": s, "files": {relative path: [size, crc32]}}``."""
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TRASH = "deleted"
"""Retention renames a pruned step into ``<dir>/deleted/`` (atomic) before anything is removed, so a crash
during a deletion never leaves a half-deleted ``<dir>/<step>`` that looks committed; the trash is emptied
after each save."""
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """The ``checkpoint:`` section of the SFT and RL configs (docs/reliability.md)."""

  every: int = 0
  "Steps between checkpoints; 0 disables."
  keep: int = 2
  "The newest `keep` checkpoints are kept."
  keep_every: int = 0
  "Also keep every checkpoint whose step is a multiple of this (0: none); `keep` does not prune them."
  resume: Literal["auto", "never"] = "auto"
  ("auto: continue from the newest valid checkpoint in out_dir/checkpoints if there is one (an unusable "
   "newer one is skipped with a logged line naming its step and file).")
  async_save: bool = True
  "Write checkpoints in a background thread (the step only waits for the device-to-host copy)."

  def __post_init__(self):
    if self.every < 0:
      raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
    if self.keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")
    if self.keep_every < 0:
      raise ValueError(f"checkpoint.keep_every must be >= 0, got {self.keep_every}")


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be restored; the message names the step and the file."""


def _stderr(text: str) -> None:
  if jax.process_index() == 0:
    print(f"jaxrl checkpoint: {text}", file=sys.stderr, flush=True)


def _crc32(path: Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def write_manifest(step_dir: Path, step: int) -> None:
  """Sizes and CRC-32s of every file under a committed ``step_dir``, written atomically."""
  files = {}
  for p in sorted(step_dir.rglob("*")):
    if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp"):
      files[str(p.relative_to(step_dir))] = [p.stat().st_size, _crc32(p)]
  tmp = step_dir / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps({"step": step, "files": files}))
  os.replace(tmp, step_dir / MANIFEST)


def verify_manifest(step_dir: Path, step: int) -> str | None:
  """``None`` when every file the manifest lists is there with its size and CRC-32 (or there is no
  manifest: a checkpoint committed just before a crash, or by an older jaxrl); else what is wrong."""
  path = step_dir / MANIFEST
  if not path.exists():
    return None
  try:
    files = json.loads(path.read_text())["files"]
  except (ValueError, KeyError) as e:
    return f"{path}: unreadable manifest ({e})"
  for rel, (size, crc) in files.items():
    p = step_dir / rel
    if not p.is_file():
      return f"{p}: missing"
    if p.stat().st_size != size:
      return f"{p}: {p.stat().st_size} bytes, the manifest says {size}"
    if _crc32(p) != crc:
      return f"{p}: CRC-32 differs from the manifest"
  return None


def gather_process_states(local: Any) -> list[Any]:
  """Every process's JSON-serialisable ``local``, process 0 first, on every process (one process:
  ``[local]``). A checkpoint's host item is written by process 0 alone; host state that is each
  process's own (its data-iterator state, the data files it read) reaches process 0 through this
  all-gather and is committed with the rest of the checkpoint. Every process must call it together."""
  text = json.dumps(local)  # key order kept: a fingerprint's files are matched in order
  got, counts = sharding.allgather_rows({"text": np.frombuffer(text.encode(), np.uint8)})  # one byte a row
  return [json.loads(bytes(part).decode()) for part in np.split(got["text"], np.cumsum(counts)[:-1])]


def own_process_state(saved: Any, *, step: int, what: str, key: Callable[[Any], Any] = lambda s: s) -> Any:
  """This process's entry of a per-process list that :func:`gather_process_states` saved.

  On the process count that wrote the checkpoint, entry ``jax.process_index()``. On another count, the
  entries must all be equal (compared through ``key``): then the state does not depend on the process
  (e.g. every process reads the same global data stream) and entry 0 serves every process; otherwise
  :class:`CheckpointError`. A non-list ``saved`` (one state for every process, as checkpoints written
  before per-process states hold) is returned as is."""
  if not isinstance(saved, list):
    return saved
  n, i = jax.process_count(), jax.process_index()
  if len(saved) == n:
    return saved[i]
  if saved and all(key(s) == key(saved[0]) for s in saved):
    return saved[0]
  raise CheckpointError(f"checkpoint step {step}: {what} was saved by {len(saved)} processes and differs "
                        f"between them, so it cannot be shared out over this run's {n}; resume on "
                        f"{len(saved)} processes")


class Checkpointer:
  """Saves every ``every`` steps, keeps the newest ``keep`` (plus multiples of ``keep_every``) and
  restores the newest valid one.

  A checkpoint holds the train state pytree (params, optimizer state, step, RNG — whatever the
  trainer passes) and a JSON item for host-side state such as the data iterator's position.

  On several processes (after ``jax.distributed.initialize``) every process calls :meth:`save` and
  :meth:`restore` together: each writes its own shards of the state, process 0 alone writes the JSON
  item and the manifest (host state is process 0's; state each process holds for itself is gathered
  into it with :func:`gather_process_states` and read back with :func:`own_process_state`), process 0
  chooses the step to restore, and a restore reshards onto ``abstract_state``'s shardings, so a
  checkpoint restores on any process count and any mesh.
  """

  def __init__(self, directory: str | Path, *, every: int, keep: int = 3, keep_every: int = 0,
               async_save: bool = True, log: Callable[[str], None] = _stderr):
    if every < 1:
      raise ValueError(f"checkpoint.every must be >= 1, got {every}")
    if keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    if keep_every < 0:
      raise ValueError(f"checkpoint.keep_every must be >= 0, got {keep_every}")
    self.directory = Path(directory).absolute()
    self.every = every
    self.log = log
    if jax.process_index() == 0 and self.directory.is_dir():
      for tmp in sorted(self.directory.glob(f"*{_TMP_SUFFIX}*")):
        self.log(f"ignoring the partial checkpoint of step {tmp.name.split('.')[0]} ({tmp.name}: "
                 "the save did not commit); removing it")
        shutil.rmtree(tmp, ignore_errors=True)
      shutil.rmtree(self.directory / _TRASH, ignore_errors=True)
    sharding.barrier("checkpoint-open")  # no process lists the directory while process 0 cleans it
    policies = [ocp_preserve.LatestN(n=keep)]
    if keep_every:
      policies.append(ocp_preserve.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        create=True, todelete_subdir=_TRASH,
        save_decision_policy=ocp_decide.FixedIntervalPolicy(every),  # exactly the multiples of `every`
        enable_async_checkpointing=async_save,
        preservation_policy=ocp_preserve.AnyPreservationPolicy(policies))
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "host"))
    self._sealer: threading.Thread | None = None
    self._closed = False

  def _step_dir(self, step: int) -> Path:
    return self.directory / str(step)

  def committed_steps(self) -> list[int]:
    """Steps whose save committed (their final directory exists), oldest first."""
    if not self.directory.is_dir():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir() if re.fullmatch(r"\d+", p.name) and p.is_dir())

  def due(self, step: int) -> bool:
    """Whether :meth:`save` writes ``step`` without ``force``."""
    return step % self.every == 0

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  # ------------------------------------------------------------------------------------------------
  # Saving

  def _seal(self, steps: list[int]) -> None:
    shutil.rmtree(self.directory / _TRASH, ignore_errors=True)  # checkpoints already pruned (renamed away)
    for step in steps:
      d = self._step_dir(step)
      try:
        if not (d / MANIFEST).exists():
          write_manifest(d, step)
      except FileNotFoundError:  # deleted by the retention policy meanwhile
        continue
      except OSError as e:  # e.g. a full disk: the checkpoint stays usable, only unverified
        self.log(f"step {step}: could not write {MANIFEST} ({e}); the checkpoint is kept unverified")

  def _start_sealing(self, *, background: bool) -> None:
    """Writes the manifests of committed steps that lack one (process 0)."""
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None
    if jax.process_index():
      return
    todo = [s for s in self.committed_steps() if not (self._step_dir(s) / MANIFEST).exists()]
    if not todo and not (self.directory / _TRASH).exists():
      return
    if background:
      self._sealer = threading.Thread(target=self._seal, args=(todo,), name="jaxrl-manifest", daemon=True)
      self._sealer.start()
    else:
      self._seal(todo)

  def save(self, step: int, state: Any, host: dict[str, Any], *, force: bool = False) -> bool:
    """Saves ``step`` when it is due (or ``force``); returns whether a save started. With async saves
    the call returns once the arrays are copied to host memory; the files are written and committed
    in the background (the next save, :meth:`wait` or :meth:`close` waits for them)."""
    if self._sealer is not None:  # no manifest is being written while the retention policy deletes
      self._sealer.join()
      self._sealer = None
    saved = self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
        force=force)
    if saved:  # the previous save has committed by now (Orbax waits for it before starting this one)
      self._start_sealing(background=True)
    return bool(saved)

  # ------------------------------------------------------------------------------------------------
  # Restoring

  def _choose(self, candidates: list[int]) -> tuple[int | None, list[str]]:
    """The newest candidate whose manifest checks out (process 0 decides, every process agrees)."""
    problems = []
    chosen = -1
    if jax.process_index() == 0:
      for step in candidates:
        problem = verify_manifest(self._step_dir(step), step)
        if problem is None:
          chosen = step
          break
        problems.append(f"step {step}: {problem}")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      chosen = int(multihost_utils.broadcast_one_to_all(np.asarray(chosen, np.int32)))
    return (None if chosen < 0 else chosen), problems

  def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), host=ocp.args.JsonRestore()))
    return out["state"], dict(out["host"])

  def restore(self, abstract_state: Any, step: int | None = None, *,
              fallback: bool = True) -> tuple[int, Any, dict[str, Any]]:
    """Restores ``step`` (default: the newest valid one) into arrays shaped and sharded like
    ``abstract_state``.

    Without ``step`` and with ``fallback``, a checkpoint whose manifest does not match its files, or
    that Orbax cannot read, is skipped with a logged line naming its step and file, and the next
    older one is tried; :class:`CheckpointError` names every problem when none is usable. An explicit
    ``step`` is restored or refused (:class:`CheckpointError`), never replaced by another.
    """
    self.wait()
    committed = self.committed_steps()
    if step is not None:
      if step not in committed:
        raise CheckpointError(f"checkpoint step {step}: no committed checkpoint in {self.directory}")
      candidates = [step]
    else:
      candidates = committed[::-1]
    if not candidates:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    if not fallback or step is not None:
      candidates = candidates[:1]
    problems: list[str] = []
    while candidates:
      chosen, bad = self._choose(candidates)
      problems += bad
      for line in bad:
        self.log(f"skipping unusable checkpoint {line}")
      if chosen is None:
        break
      try:
        state, host = self._restore_step(chosen, abstract_state)
      except Exception as e:  # noqa: BLE001  (unreadable files: try an older checkpoint, or report)
        if jax.process_count() > 1 or not fallback or step is not None:
          raise CheckpointError(f"checkpoint step {chosen} in {self.directory} cannot be restored: "
                                f"{type(e).__name__}: {e}") from e
        problems.append(f"step {chosen}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        self.log(f"skipping unusable checkpoint {problems[-1]}")
        candidates = [s for s in candidates if s < chosen]
        continue
      if problems:
        self._set_aside([s for s in committed if s > chosen])
        self.log(f"restored step {chosen} instead")
      return chosen, state, host
    raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(problems))

  def _set_aside(self, steps: list[int]) -> None:
    """Renames unusable checkpoints newer than the restored one to ``<step>.unusable`` (kept for
    inspection, invisible to Orbax) so the resumed run can save those steps again."""
    if jax.process_index() == 0:
      for s in steps:
        d = self._step_dir(s)
        if d.exists():
          target = self.directory / f"{s}.unusable"
          k = 1
          while target.exists():
            target, k = self.directory / f"{s}.unusable{k}", k + 1
          d.rename(target)
          self.log(f"moved unusable checkpoint step {s} to {target.name}")
    sharding.barrier("checkpoint-set-aside")
    self._manager.reload()

  def wait(self):
    """Waits for the pending save to commit and its manifest to be written."""
    self._manager.wait_until_finished()
    self._start_sealing(background=False)

  def close(self):
    """Waits for the pending save and releases Orbax's threads; calling it again does nothing."""
    if self._closed:
      return
    self.wait()
    self._manager.close()
    self._closed = True

