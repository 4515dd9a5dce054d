"""Asynchronous RL on two sub-meshes of one JAX program: AReaL's staleness-bounded, interruptible
rollouts with decoupled PPO, and DeepCoder's one-off pipelining (docs/async.md). This module is the trainer
side; the rollout side (:class:`AsyncSchedule`, :class:`RolloutWorker` and the trainer's rollout source
:class:`AsyncRollout`) is :mod:`jaxrl.rl._async_rollout`.

Devices. The first ``asynchronous.rollout_devices`` devices form the rollout sub-mesh (the
continuous-batching :class:`jaxrl.sampling.Engine`), the rest the trainer sub-mesh (an
:class:`RLTrainer` built on them: packing, updates, rewards, evaluation are its methods). After each
RL step the trainer's parameters are cast to the compute dtype and ``jax.device_put`` onto the
rollout shardings (device to device, no host round trip); the time is logged as
``async/time_weight_transfer``.

Threads. The calling thread runs the rollout loop (:class:`RolloutWorker`): admit prompts under the
staleness bound, one engine scheduling round, stream finished rows into the reward pool at once,
move fully scored prompt groups into the buffer, and apply new weights between decode rounds. A
trainer thread takes batches, updates, and hands the new weights over. JAX releases the GIL while
device programs run, so on the two device sets the two loops overlap (on CPU the fake devices share
the host's cores; the overlap that remains is decoding vs. slow rewards vs. training).

Staleness (AReaL eq. 3). The policy version ``i`` is the number of RL steps whose weights the engine
holds; a prompt group is admitted only while ``⌊(N_r − 1)/B⌋ ≤ i + η`` (``N_r`` counting it,
``B = rollout.prompts_per_step``). Batch ``j`` is exactly the groups admitted ``jB .. (j+1)B − 1``
(oldest first; each group used once), trained with the parameters of version ``j``: every token
was generated at a version ``≥`` its group's admission version ``≥ j − η``, so no batch holds a token
more than ``η`` versions old, whatever the number of updates per step (versions count RL steps;
π_prox is the parameters before the step, held fixed across its ``ppo_epochs × mini_batches``
updates). ``η = 0`` is the synchronous trainer, step for step. :meth:`AsyncSchedule.take` checks the
bound on every token and raises if it were ever broken. With DAPO dynamic sampling, groups come in
rounds of ``B``; a scored round fills the open batch with its informative groups (the synchronous
trainer's rule) and eq. 3 generalises to ``c + (r − u) ≤ i + η`` (:class:`AsyncSchedule`).

LoRA. The frozen base is placed on the rollout devices once; each version transfers only the adapters
(the trainer's optimizer holds only them), and the engine runs base + unmerged adapters.

Several processes. Each process rolls out its contiguous share of every batch (``B / P`` groups per round,
the synchronous trainer's split, global prompts and request ids) on an engine over its *own* rollout devices,
with its own schedule, reward pool and loop: no rollout decision is agreed across processes. Every program
that spans processes (the batch's gathers, the update, the weight hand-off's all-gather) runs on the trainer
thread, in step order on every process, after a coordinator barrier; the bound holds per process, hence for
the whole batch. Dynamic sampling is not supported there yet.

Context stages (``rollout.context_schedule``, e.g. Vision-R1's PTST). A group's stage is the stage of the step
that trains it: group ``k`` (admission order) lands in batch ``⌊k/B⌋``, so admission generates it with the
``max_new_tokens`` and ``n`` of step ``⌊k/B⌋ + 1``, even while an earlier stage trains; batches never mix
stages. The engine is built once with the largest stage's ``max_len``; the learner takes each step's stage (row
length, aggregation length), and a new stage starts from the forced checkpoint of its previous step, as
synchronously. Not with dynamic sampling (a group's batch is only known once earlier rounds are filtered).

Resume. The checkpoint of step ``s`` holds the trainer's prompt stream at group ``s·B``; the groups
admitted beyond it are not saved, and a resume re-admits them (same prompts and request ids) at version
``s``: exact for ``η = 0``, fresher first batches for ``η > 0`` (docs/async.md, "Resume").
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import models, sampling, sharding, train
from jaxrl.rl._async_rollout import AsyncRollout, Group, staleness_metrics
from jaxrl.rl._config import RLConfig
from jaxrl.rl._engine_build import build_engine, rollout_max_len
from jaxrl.rl._rollout import Rollout
from jaxrl.rl._trainer import RLTrainer


# --------------------------------------------------------------------------------------------------
# The trainer


def split_devices(cfg: RLConfig, devices=None) -> tuple[list, list]:
  """``(rollout devices, trainer devices)``: the first ``rollout_devices`` (default 3/4) roll out.

  On several processes (devices of ``P`` process indices) every process's first ``rollout_devices / P``
  devices roll out: the rollout devices returned are this process's own (its engine's process-local
  sub-mesh); the trainer devices are every process's others, in process order (one trainer mesh).
  """
  devices = list(devices if devices is not None else jax.devices())
  procs = sorted({d.process_index for d in devices})
  local = {p: [d for d in devices if d.process_index == p] for p in procs}
  per = min(len(v) for v in local.values())
  k = cfg.asynchronous.rollout_devices
  if k is None:
    k = max(1, (3 * per) // 4) * len(procs)
  if k % len(procs) or len({len(v) for v in local.values()}) > 1:
    raise ValueError(f"asynchronous.rollout_devices={k}: on {len(procs)} processes it must be a multiple of the "
                     f"process count, every process with the same number of devices (each rolls out on its own)")
  k //= len(procs)
  if not 1 <= k < per:
    raise ValueError(f"asynchronous.rollout_devices={k * len(procs)}: needs at least one rollout and one trainer "
                     f"device of the {per} on each of the {len(procs)} process(es)")
  me = jax.process_index() if jax.process_index() in local else procs[0]
  return local[me][:k], [d for p in procs for d in local[p][k:]]


class AsyncRLTrainer(RLTrainer):
  """:class:`RLTrainer` on the trainer sub-mesh, fed by an engine on the rollout sub-mesh (its rollout source
  is :class:`AsyncRollout`).

  Reuses ``collect`` / ``pack`` / ``update`` / ``evaluate`` / checkpoints; replaces the schedule (:meth:`run`).
  ``history`` gets the synchronous metrics plus ``async/*`` (staleness histogram, versions per
  trajectory, busy fractions, weight-transfer time, effective training tokens/s).
  """

  def __init__(self, cfg: RLConfig):
    if cfg.asynchronous is None:
      raise ValueError("AsyncRLTrainer needs an asynchronous: section")
    procs = jax.process_count()
    if procs > 1 and cfg.rollout.dynamic_sampling:
      raise ValueError("asynchronous: rollout.dynamic_sampling runs on one process so far (docs/async.md, "
                       "\"Several processes\")")
    if cfg.rollout.engine.num_slots % procs:
      raise ValueError(f"rollout.engine.num_slots={cfg.rollout.engine.num_slots} must be a multiple of the {procs} "
                       "processes (asynchronous: each process's engine gets an equal share)")
    self.rollout_devices, trainer_devices = split_devices(cfg)
    super().__init__(cfg, devices=trainer_devices)
    a = cfg.asynchronous
    # Several processes: each generates its own contiguous share of every round (the synchronous trainer's
    # split), on an engine over its own rollout devices only; every cross-process program (the update, the
    # batch's gathers, the weight hand-off) runs on the trainer thread, in the same order on every process.
    self._replicate = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec()))
    self.eta = a.max_staleness
    self.rollout_mesh = sharding.MeshConfig(shape=dict(a.rollout_mesh), rules=cfg.mesh.rules).build(
        self.rollout_devices)
    self.compute_dtype = self.current_model().cfg.dtype
    self.lora = cfg.lora is not None
    if self.lora:
      # LoRA: the frozen base moves to the rollout devices once; each version moves only the adapters (the
      # trained state), as the synchronous sampler gets them: unmerged, in their own dtype.
      base = self.frozen[0]
      self._rollout_base = jax.device_put(self._local(base),
                                          models.state_shardings(base, self.rollout_mesh, self.rules))
      self._rollout_shardings = models.state_shardings(self.state.params, self.rollout_mesh, self.rules)
    else:
      self._rollout_shardings = models.state_shardings(
          models.cast_params(self.state.params, self.compute_dtype), self.rollout_mesh, self.rules)
    self.source: AsyncRollout = AsyncRollout(cfg, self.tokenizer, procs=self.procs, pid=self.pid)
    self.engine: sampling.Engine | None = None
    self.transfer_times: list[float] = []

  # -- weights ---------------------------------------------------------------------------------

  def _local(self, tree):
    """``tree`` (trainer-mesh arrays) readable by this process alone: itself on one process; on several, one
    all-gather onto every trainer device (a collective: the trainer thread calls it, in step order, on every
    process), then this process's replica."""
    if self.procs == 1:
      return tree
    return jax.tree.map(lambda x: x.addressable_data(0), self._replicate(tree))

  def rollout_model(self):
    """The current parameters in the compute dtype on the rollout shardings: ``(model, seconds)``. LoRA:
    only the adapters are transferred; the model is them over the base already on the rollout devices."""
    t0 = time.perf_counter()
    params = self.state.params if self.lora else models.cast_params(self.state.params, self.compute_dtype)
    params = jax.device_put(self._local(params), self._rollout_shardings)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    self.transfer_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    model = nnx.merge(self.graphdef, params, self._rollout_base) if self.lora else nnx.merge(self.graphdef, params)
    return models.shard_model(model, self.rollout_mesh, self.rules), dt

  def _build_engine(self, version: int) -> sampling.Engine:
    """The rollout engine on the rollout sub-mesh, holding the parameters of ``version`` (this process's share of
    the slots; :func:`jaxrl.rl.build_engine`), built once: its ``max_len`` covers the largest context stage of the
    steps left (:func:`jaxrl.rl.rollout_max_len` over them), as admission runs ahead into later stages."""
    cfg = self.cfg
    model, dt = self.rollout_model()
    self.transfer_times.append(dt)
    return build_engine(model, self.tokenizer, cfg.rollout.engine,
                        max_len=rollout_max_len(cfg, version + 1, last=cfg.steps),
                        mesh=self.rollout_mesh, rules=self.rules, num_slots=cfg.rollout.engine.num_slots // self.procs,
                        version=version, stop_strings=cfg.rollout.stop_strings)

  # -- the loop --------------------------------------------------------------------------------

  def run(self, *, until: int | None = None) -> dict[str, Any]:
    cfg = self.cfg
    # The checkpoint of step s holds the parameters after s steps and the prompt stream at group s·B (the
    # trainer's stream advances one batch per step). Groups admitted beyond it (async/ahead_groups at step
    # s) are not saved: the rollout restarts at version s and draws them again, same prompts and ids.
    start_step = self.resume()
    self._stage = cfg.rollout.stage(max(start_step, 1))[0]
    logger = train.process_logger(self.out_dir, self.pid, total_steps=cfg.steps, desc="rl-async",
                                  show=("reward/mean", "accuracy", "eval/accuracy", "async/staleness_mean",
                                        "async/tok_s_effective"), tensorboard=cfg.tensorboard)
    results: dict[str, Any] = {"start_step": start_step}
    if start_step:
      logger.note(f"resumed from step {start_step}: the rollout restarts at version {start_step}; the groups the "
                  f"interrupted run had admitted ahead (async/ahead_groups of step {start_step}) are drawn again")
    elif cfg.eval.every:
      results["eval_before"] = self.evaluate(1)
      logger.log(0, results["eval_before"])
    last = cfg.steps if until is None else min(until, cfg.steps)
    self.trained: list[dict[str, np.ndarray]] = []  # per step, every process's trained samples (gathered)
    self.engine = self._build_engine(version=start_step)
    self.source.start(self.engine, self.train_prompts, self.stream, start=start_step, total=max(last, start_step))
    stop = threading.Event()
    failure: list[BaseException] = []
    self._preempted = None  # (signal, step) once the trainer thread stopped on a pre-emption signal
    self.preemption.install()

    def trainer_loop():
      try:
        self._train_loop(start_step, last, logger, results, stop)
      except BaseException as e:  # noqa: BLE001 (re-raised on the calling thread)
        failure.append(e)
      finally:
        stop.set()

    t_start = time.perf_counter()
    thread = threading.Thread(target=trainer_loop, name="jaxrl-async-trainer", daemon=True)
    thread.start()
    try:
      while not stop.is_set():
        if not self.source.poll():
          time.sleep(0.002)  # nothing to decode: waiting for rewards or for the trainer's weights
    except BaseException:
      stop.set()
      thread.join()
      raise
    thread.join()
    if failure:
      raise failure[0]
    if self._preempted is not None:
      self.stop(*self._preempted, logger)  # the checkpoint commits, then train.Preempted (exit 143)
    self.preemption.uninstall()
    results["time_total"] = time.perf_counter() - t_start
    if self.checkpointer is not None:
      self.checkpointer.close()
    return self.finish(results, logger, last, title="rl-async")

  def _train_loop(self, start_step: int, last: int, logger, results: dict, stop: threading.Event) -> None:
    t_prev = time.perf_counter()
    for step in range(start_step + 1, last + 1):
      if self.cfg.rollout.stage(step)[0] != self._stage:  # PTST: as synchronously (checkpoint of step - 1)
        self._begin_stage(step, logger)
      t_wait = time.perf_counter()
      if not self.source.wait(step, stop):
        return
      t0 = time.perf_counter()
      # This process's share of batch step - 1 from the source (AsyncRollout.rollout: every token within η,
      # checked; the checkpointed stream advanced past it), with the rollout metrics over every sample drawn.
      rollout, metrics = self.collect(step)
      self.last_rollout = rollout
      trained_tokens = 0.0
      if rollout is not None:
        trained_tokens = self._record_trained(step, self.source.last.groups, rollout, rollout.versions, metrics)
        metrics.update(self.update(rollout, step))
      else:
        logger.note(f"step {step}: no informative group after {self.source.last.rounds} rounds; no update")
      t1 = time.perf_counter()
      metrics["time_train"] = t1 - t0
      model, dt = self.rollout_model()
      self.transfer_times.append(dt)
      self.source.set_weights(model, version=step)
      t2 = time.perf_counter()
      counters = self.source.take_counters()
      wall = max(t2 - t_prev, 1e-9)
      metrics.update({
          "async/time_weight_transfer": dt, "async/time_weight_apply": counters["apply_s"],
          "async/time_wait_batch": t0 - t_wait, "async/trainer_busy": (t2 - t0) / wall,
          "async/rollout_busy": min(counters["busy_s"] / wall, 1.0),
          "async/weight_transfer_bytes": float(self.transfer_bytes),
          "async/tok_s_effective": trained_tokens / wall, "time_step": wall})
      if rollout is not None:
        metrics["tok_s/train"] = metrics["train/tokens"] / max(metrics["time_train"], 1e-9)
      t_prev = t2
      signum = self.end_step(step, last, metrics, logger=logger, results=results)
      if signum is not None:  # this step's checkpoint is saved; run() raises Preempted on the calling thread
        self._preempted = (signum, step)
        return

  def _record_trained(self, step: int, groups: list[Group], rollout: Rollout, versions: np.ndarray,
                      metrics: dict[str, float]) -> float:
    """Gathers every process's trained samples of ``step`` into ``self.trained`` and their staleness into
    ``metrics``; returns the number of tokens trained."""
    got, _ = sharding.allgather_rows({  # every process's trained samples: metrics and self.trained
        "versions": versions, "lengths": rollout.lengths,
        "group": np.asarray([self.source.global_group(g.index) for g in groups for _ in range(g.n)], np.int64),
        "sample": np.asarray([s for g in groups for s in range(g.n)], np.int64),
        "request_id": np.asarray([g.request_id for g in groups for _ in range(g.n)], np.int64),
        "tokens_crc": np.asarray([zlib.crc32(t[:k].tobytes()) & 0x7FFFFFFF  # gathered as int32 (x64 off)
                                  for t, k in zip(rollout.tokens, rollout.lengths)], np.int64)})
    valid = np.arange(got["versions"].shape[1])[None, :] < got["lengths"][:, None]
    self.trained.append({
        "step": np.full(len(got["group"]), step), "group": got["group"], "sample": got["sample"],
        "request_id": got["request_id"], "tokens_crc": got["tokens_crc"], "length": got["lengths"],
        "version_min": np.where(valid, got["versions"], np.iinfo(np.int32).max).min(1, initial=step),
        "version_max": got["versions"].max(1, initial=-1)})
    metrics.update(staleness_metrics(got["versions"], got["lengths"], step - 1, self.eta))
    return float(got["lengths"].sum())

  def close(self) -> None:
    super().close()
    self.source.close()  # the rollout side's reward pool and collector threads


def make_trainer(cfg: RLConfig) -> RLTrainer:
  """The trainer a config asks for: :class:`AsyncRLTrainer` with an ``asynchronous:`` section."""
  return AsyncRLTrainer(cfg) if cfg.asynchronous is not None else RLTrainer(cfg)
