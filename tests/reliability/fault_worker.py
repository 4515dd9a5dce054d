"""One training process of the fault-injection suite: ``jaxrl sft|rl`` on 8 fake CPU devices, killed
with SIGKILL (or sent SIGTERM) at a chosen point.

Run as ``python fault_worker.py KIND FAULT CONFIG [key=value ...]``; KIND is ``sft``, ``rl`` or ``async``
(``jaxrl rl`` with an ``asynchronous:`` section: the asynchronous trainer). ``FAULT`` is ``none`` or
``PHASE:STEP`` with PHASE one of

- ``in_step``: while the step runs (SFT: right after the jitted update is dispatched; RL: after the
  rollout, before the update; asynchronous RL: the batch is taken from the rollout thread, before the update),
- ``in_reward`` (RL): the step's samples are submitted to the reward pool, one is scored, the rest
  are still being scored,
- ``before_save``: the step is done, its checkpoint not started,
- ``after_save``: the checkpoint's asynchronous write has just started,
- ``in_commit``: every file of the checkpoint is written, the commit (rename) has not happened,
- ``in_manifest``: committed, its integrity manifest half-written,
- ``sigterm``: SIGTERM to itself after the step (pre-emption: checkpoint, exit 143),
- ``enospc``: the commit fails with ``OSError(ENOSPC)`` (disk full).

A fault at a step the run does not reach does nothing. The exit status is the CLI's.

With ``JAXRL_COORDINATOR`` / ``JAXRL_NUM_PROCESSES`` / ``JAXRL_PROCESS_ID`` set, this is one process of a
multi-process run (``8 / JAXRL_NUM_PROCESSES`` CPU devices each; ``faultlib.launch_processes``).
"""

import errno
import os
import signal
import sys

kind, fault, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // int(os.environ.get('JAXRL_NUM_PROCESSES', 1))}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from jaxrl import cli, train  # noqa: E402
from jaxrl.train import _checkpoint  # noqa: E402

phase, at = (fault.split(":")[0], int(fault.split(":")[1])) if fault != "none" else ("none", -1)


def die():
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


_save = train.Checkpointer.save


def save(self, step, state, host, *, force=False):
  if step == at and phase == "before_save":
    die()
  out = _save(self, step, state, host, force=force)
  if step == at and phase == "after_save":
    die()
  return out


train.Checkpointer.save = save

_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def finalize(self):
  if self._final_path.name == str(at) and phase == "in_commit":
    die()
  if self._final_path.name == str(at) and phase == "enospc":
    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(self._tmp_path))
  return await _finalize(self)


atomicity.AtomicRenameTemporaryPath.finalize = finalize

_write_manifest = _checkpoint.write_manifest


def write_manifest(step_dir, step):
  if step == at and phase == "in_manifest":
    (step_dir / (_checkpoint.MANIFEST + ".tmp")).write_text('{"step": ')
    die()
  return _write_manifest(step_dir, step)


_checkpoint.write_manifest = write_manifest

_log = train.MetricsLogger.log


def log(self, step, metrics):
  _log(self, step, metrics)
  if step == at and phase == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)


train.MetricsLogger.log = log

if kind == "sft":
  from jaxrl.sft import _trainer as sft_trainer
  _init = sft_trainer.SFTTrainer.__init__

  def sft_init(self, cfg):
    _init(self, cfg)
    step_fn = self.step_fn

    def step_and_die(state, *args):
      out = step_fn(state, *args)
      if int(out[0].step) + int(out[0].skipped) == at and phase == "in_step":
        die()
      return out
    self.step_fn = step_and_die

  sft_trainer.SFTTrainer.__init__ = sft_init
else:
  from jaxrl.rl import _trainer as rl_trainer
  _update = rl_trainer.RLTrainer.update

  def update(self, rollout, step):
    if step == at and phase == "in_step":
      die()
    return _update(self, rollout, step)

  rl_trainer.RLTrainer.update = update
  _submit = rl_trainer.RLTrainer._submit

  def submit(self, prompts, idx, n, texts, *, offset):
    indices = _submit(self, prompts, idx, n, texts, offset=offset)
    step = self.stream.drawn // self.cfg.rollout.prompts_per_step  # this step's prompts are drawn
    if phase == "in_reward" and step == at and prompts is self.train_prompts:
      self.rewards.collect(indices[:1])  # one sample scored, the others still in the pool
      die()
    return indices

  rl_trainer.RLTrainer._submit = submit

sys.exit(cli.main(["sft" if kind == "sft" else "rl", "--config", config, *overrides]))
