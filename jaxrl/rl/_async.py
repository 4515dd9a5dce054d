"""Asynchronous RL on two sub-meshes of one JAX program: AReaL's staleness-bounded, interruptible
rollouts with decoupled PPO, and DeepCoder's one-off pipelining (docs/async.md).

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

Resume. The checkpoint of step ``s`` holds the trainer's prompt stream at group ``s·B``; the groups
admitted beyond it are not saved, and a resume re-admits them (same prompts and request ids) at version
``s``: exact for ``η = 0``, fresher first batches for ``η > 0`` (docs/async.md, "Resume").
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import losses, models, rewards, sampling, sharding, train
from jaxrl.rl._config import RLConfig
from jaxrl.rl._prompts import PromptStream, reward_fields
from jaxrl.rl._rollout import Rollout, informative_groups
from jaxrl.rl._trainer import RLTrainer


# --------------------------------------------------------------------------------------------------
# Staleness control and the buffer (pure Python: tested with a scripted engine)


@dataclasses.dataclass
class Group:
  """One admitted prompt with its ``n`` rows; scored when ``rewards`` is set."""

  index: int  # admission order: N_r - 1
  prompt: int  # index into the training prompts
  request_id: int
  version: int  # the engine's policy version at admission
  n: int
  completions: dict[int, Any] = dataclasses.field(default_factory=dict)  # sample -> Completion
  rewards: np.ndarray | None = None  # [n] float32 task rewards
  errors: int = 0
  finished_at: float = 0.0

  @property
  def generated(self) -> bool:
    return len(self.completions) == self.n

  def token_versions(self) -> np.ndarray:
    return np.concatenate([np.asarray(self.completions[s].versions, np.int64) for s in range(self.n)])


@dataclasses.dataclass
class Batch:
  """Training batch ``index``: the groups it trains and every group drawn for it (rollout metrics)."""

  index: int
  groups: list[Group]  # trained, in admission order
  drawn: list[Group]  # every group of its rounds, in admission order (== groups without dynamic sampling)
  rounds: int = 1
  filtered: int = 0  # dynamic sampling: groups whose rewards are all equal (never trained)
  surplus: int = 0  # dynamic sampling: informative groups of its last round beyond B (dropped, as synchronously)


class StalenessError(RuntimeError):
  """A batch would hold a token older than the staleness bound (never raised when eq. 3 holds)."""


class AsyncSchedule:
  """AReaL's rate limit (eq. 3), the bounded buffer of scored groups and oldest-first batches.

  Groups are admitted in rounds of ``B`` (round ``r`` = groups ``rB … (r+1)B − 1``). A round is
  *assigned* to the open batch once all its groups are scored: without dynamic sampling every round is
  one batch; with it (DAPO) the round's groups whose rewards are all equal are filtered out, the first
  informative ones fill the open batch up to ``B`` groups, the rest of the round is dropped (the
  synchronous trainer's rule), and the batch closes when full or after ``max_rounds`` rounds.

  Admission (eq. 3, generalised): the next group, of round ``r``, is admitted only while
  ``c + (r − u) ≤ i + η``, with ``i`` the rollout's policy version, ``c`` the batches closed so far and
  ``u`` the first unassigned round. Each batch takes at least one round, so round ``r`` can only land in
  a batch ``≤ c + (r − u)``: no batch holds a token more than η versions old. Without dynamic sampling
  ``c = u`` and this is ``⌊(N_r − 1)/B⌋ ≤ i + η``; with it, filtered rounds free admission (no
  deadlock) and ``η = 0`` draws one round at a time, as the synchronous trainer does.

  Args:
    batch: ``B``, prompt groups per training batch.
    max_staleness: ``η``.
    total_batches: batches to train in all (``steps``); rounds that could only land beyond are not admitted.
    start: batches already trained (a resume from the checkpoint of step ``start``): the rollout starts at
      version ``start`` with round ``start`` and nothing in flight.
    informative: dynamic sampling: ``group -> bool`` (rewards not all equal); ``None``: every group is kept.
    max_rounds: dynamic sampling: most rounds per batch (the batch may stay short, even empty).
  """

  def __init__(self, batch: int, max_staleness: int, total_batches: int, *, start: int = 0,
               informative: Callable[[Group], bool] | None = None, max_rounds: int = 1):
    self.B, self.eta, self.total = batch, max_staleness, total_batches
    self.informative = informative
    self.max_rounds = max_rounds if informative is not None else 1
    self.version = start  # i: the rollout's policy version
    self.admitted = start * batch  # group labels: round r holds groups rB … (r+1)B − 1
    self.unassigned = start  # u: the first round not yet assigned to a batch
    self.closed = start  # c: batches closed (complete or out of rounds)
    self.taken = start  # batches handed to the trainer
    self.consumed = start * batch  # groups trained, filtered or dropped
    self.pending: dict[int, Group] = {}  # scored groups of unassigned rounds
    self.batches: dict[int, Batch] = {}  # closed batches not yet taken
    self._open = Batch(index=start, groups=[], drawn=[], rounds=0)
    # Unassigned rounds + closed batches not yet trained ≤ η + 1 (eq. 3); with dynamic sampling the open
    # batch's informative groups (< B) wait besides, as the synchronous trainer's do between rounds.
    self.capacity = (max_staleness + 1) * batch + (batch - 1 if informative is not None else 0)
    self.cond = threading.Condition()

  def _lowest_batch(self, r: int) -> int:
    """The earliest batch round ``r`` can land in (each batch takes at most ``max_rounds`` rounds)."""
    ahead = r - self.unassigned + 1 + self._open.rounds
    return self.closed + -(-ahead // self.max_rounds) - 1

  def can_admit(self) -> bool:
    """Eq. 3 for the next group (of round ``admitted // B``), and a batch left that could use it."""
    with self.cond:
      r = self.admitted // self.B
      return (self.closed + (r - self.unassigned) <= self.version + self.eta
              and self._lowest_batch(r) < self.total)

  def admit(self) -> int:
    if not self.can_admit():
      raise StalenessError(f"admission of group {self.admitted} at version {self.version} breaks eq. 3")
    with self.cond:
      self.admitted += 1
      return self.admitted - 1

  def set_version(self, version: int) -> None:
    with self.cond:
      self.version = version

  def held(self) -> int:
    """Admitted groups neither trained, filtered nor dropped (at most ``capacity``: ``(η + 1)·B``, plus
    ``B − 1`` with dynamic sampling)."""
    with self.cond:
      return self.admitted - self.consumed

  def put(self, group: Group) -> None:
    """A scored group; completes its round (then assigned to the open batch) when it is the last one."""
    with self.cond:
      if not (self.unassigned * self.B <= group.index < self.admitted) or group.index in self.pending:
        raise RuntimeError(f"group {group.index}: not admitted, already consumed, or already buffered")
      self.pending[group.index] = group
      while all(g in self.pending for g in self._round(self.unassigned)):
        self._assign([self.pending.pop(g) for g in self._round(self.unassigned)])
      if self.admitted - self.consumed > self.capacity:
        raise RuntimeError(f"buffer over its capacity of {self.capacity} groups")
      self.cond.notify_all()

  def _round(self, r: int) -> range:
    return range(r * self.B, (r + 1) * self.B)

  def _assign(self, groups: list[Group]) -> None:
    b = self._open
    self.unassigned += 1
    b.rounds += 1
    b.drawn += groups
    if self.informative is None:
      keep = groups
    else:
      good = [g for g in groups if self.informative(g)]
      keep = good[:self.B - len(b.groups)]
      b.filtered += len(groups) - len(good)
      b.surplus += len(good) - len(keep)
    b.groups += keep
    self.consumed += len(groups) - len(keep)  # filtered and surplus groups are done with
    if len(b.groups) >= self.B or b.rounds >= self.max_rounds:
      self.batches[b.index] = b
      self.closed += 1
      self._open = Batch(index=b.index + 1, groups=[], drawn=[], rounds=0)

  def ready(self, j: int) -> bool:
    return j == self.taken and j in self.batches

  def take(self, j: int) -> Batch:
    """Batch ``j`` (its groups in admission order), removed from the buffer; trained at version ``j``, so
    every token version must be ``≥ j − η``."""
    with self.cond:
      if not self.ready(j):
        raise RuntimeError(f"batch {j} is not ready (next batch {self.taken})")
      batch = self.batches.pop(j)
      self.taken += 1
      self.consumed += len(batch.groups)
    oldest = min((int(g.token_versions().min(initial=j)) for g in batch.groups), default=j)
    if j - oldest > self.eta:
      raise StalenessError(f"batch {j} holds a token of version {oldest}: staleness {j - oldest} > η={self.eta}")
    return batch

  def wait_ready(self, j: int, stop: threading.Event, timeout: float = 0.05) -> bool:
    with self.cond:
      while not self.ready(j):
        if stop.is_set():
          return False
        self.cond.wait(timeout)
      return True


# --------------------------------------------------------------------------------------------------
# The rollout side


class RolloutWorker:
  """The rollout loop: admission, engine rounds, rewards as rows finish, weight updates.

  Args:
    engine: ``submit / step / idle / update_weights`` (a :class:`jaxrl.sampling.Engine`).
    schedule: the :class:`AsyncSchedule`.
    make_request: ``group index -> (prompt index, Request)``.
    score: ``(group) -> Future`` of ``(task rewards [n], error count)``; called when a group's rows
      are all generated (each row's reward was already submitted by ``on_row``).
    on_row: ``(group, completion)`` as each row finishes (submits its reward).
    one_off: apply new weights only when the engine is idle (DeepCoder one-off pipelining).
    interrupt: ``update_weights`` mode (``interrupt`` or ``finish``).
  """

  def __init__(self, engine, schedule: AsyncSchedule, *, make_request: Callable[[int], tuple[int, Any]],
               score: Callable[[Group], cf.Future], on_row: Callable[[Group, Any], None] | None = None,
               one_off: bool = False, interrupt: bool = True):
    self.engine, self.schedule = engine, schedule
    self.make_request, self.score, self.on_row = make_request, score, on_row
    self.one_off, self.mode = one_off, "interrupt" if interrupt else "finish"
    self.groups: dict[int, Group] = {}  # request id -> generating group
    self.scoring: list[tuple[Group, cf.Future]] = []
    self._lock = threading.Lock()
    self._pending: tuple[Any, int] | None = None  # (model, version) offered by the trainer
    self.busy_s = 0.0  # engine rounds
    self.apply_s = 0.0  # update_weights (incl. the interrupted rows' recompute)
    self.rows_done = 0

  def offer_weights(self, model, version: int) -> None:
    """Called by the trainer (any thread): the weights of ``version``, applied between rounds."""
    with self._lock:
      self._pending = (model, version)

  def take_counters(self) -> dict[str, float]:
    with self._lock:
      out = {"busy_s": self.busy_s, "apply_s": self.apply_s}
      self.busy_s = self.apply_s = 0.0
    return out

  def _apply_weights(self) -> None:
    with self._lock:
      pending = self._pending
      if pending is None or (self.one_off and not self.engine.idle):
        return
      self._pending = None
    t0 = time.perf_counter()
    model, version = pending
    self.engine.update_weights(model, version, mode=self.mode)
    if self.mode == "finish":
      self._drain()
    self.schedule.set_version(version)
    with self._lock:
      self.apply_s += time.perf_counter() - t0

  def _drain(self) -> None:
    for c in self.engine.pop_finished():
      g = self.groups[c.request_id]
      if c.sample in g.completions:
        raise RuntimeError(f"group {g.index}: sample {c.sample} finished twice")
      g.completions[c.sample] = c
      self.rows_done += 1
      if self.on_row is not None:
        self.on_row(g, c)
      if g.generated:
        del self.groups[c.request_id]
        g.finished_at = time.perf_counter()
        self.scoring.append((g, self.score(g)))

  def poll(self) -> bool:
    """One iteration; returns whether the engine ran a round."""
    self._apply_weights()
    new = []
    while self.schedule.can_admit():
      index = self.schedule.admit()
      prompt, request = self.make_request(index)
      g = Group(index=index, prompt=prompt, request_id=request.request_id, version=self.schedule.version,
                n=request.n)
      if request.request_id in self.groups:
        raise RuntimeError(f"request id {request.request_id} is already generating")
      self.groups[request.request_id] = g
      new.append(request)
    if new:
      self.engine.submit(new)
    ran = False
    if not self.engine.idle:
      t0 = time.perf_counter()
      self.engine.step()
      with self._lock:
        self.busy_s += time.perf_counter() - t0
      ran = True
    self._drain()
    still = []
    for g, fut in self.scoring:
      if fut.done():
        g.rewards, g.errors = fut.result()
        self.schedule.put(g)
      else:
        still.append((g, fut))
    self.scoring = still
    return ran


# --------------------------------------------------------------------------------------------------
# Batches and metrics


def groups_to_rollout(groups: list[Group], prompt_ids, *, max_new: int, tokenizer, overlong_penalty=None
                      ) -> tuple[Rollout, np.ndarray]:
  """The groups (admission order, samples ``0..n-1``) as the synchronous trainer's :class:`Rollout`,
  plus ``[N, max_new]`` per-token versions (−1 past each length). ``logprobs`` are the engine's
  behaviour log-probs (π_behav of decoupled PPO), token by token whichever version drew them."""
  rows = [(gi, g, g.completions[s]) for gi, g in enumerate(groups) for s in range(g.n)]
  total = len(rows)
  tokens = np.zeros((total, max_new), np.int32)
  lp = np.zeros((total, max_new), np.float32)
  versions = np.full((total, max_new), -1, np.int32)
  lengths = np.zeros((total,), np.int32)
  for i, (_, _, c) in enumerate(rows):
    k = len(c.tokens)
    tokens[i, :k], lp[i, :k], versions[i, :k], lengths[i] = c.tokens, c.logprobs, c.versions, k
  texts = tuple(tokenizer.decode(tokens[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(total))
  task = np.concatenate([np.asarray(g.rewards, np.float32) for g in groups]) if groups else np.zeros(0, np.float32)
  rew = total_rewards(task, lengths, max_new=max_new, overlong_penalty=overlong_penalty)
  rollout = Rollout(
      prompt_ids=tuple(prompt_ids[g.prompt] for _, g, _ in rows), tokens=tokens, logprobs=lp, lengths=lengths,
      truncated=np.asarray([c.finish_reason == "length" for *_, c in rows]),
      group_ids=np.asarray([gi for gi, _, _ in rows], np.int32), rewards=rew.astype(np.float32),
      task_rewards=task, texts=texts)
  return rollout, versions


def total_rewards(task: np.ndarray, lengths: np.ndarray, *, max_new: int, overlong_penalty=None) -> np.ndarray:
  """Task rewards plus the DAPO overlong penalty (as the synchronous trainer adds it), float32."""
  if overlong_penalty is None:
    return np.asarray(task, np.float32)
  return task + np.asarray(losses.dapo_overlong_penalty(
      lengths, max_len=overlong_penalty.max_len or max_new, cache_len=overlong_penalty.cache_len), np.float32)


def informative(group: Group, *, max_new: int, overlong_penalty=None) -> bool:
  """Dynamic sampling's test on one scored group: its rewards (with the overlong penalty) are not all equal."""
  lengths = np.asarray([len(group.completions[s].tokens) for s in range(group.n)], np.int32)
  rew = total_rewards(np.asarray(group.rewards, np.float32), lengths, max_new=max_new,
                      overlong_penalty=overlong_penalty)
  return bool(informative_groups(rew, np.zeros(group.n, np.int32), 1)[0])


def staleness_metrics(versions: np.ndarray, lengths: np.ndarray, step_version: int, max_staleness: int
                      ) -> dict[str, float]:
  """Histogram of per-token staleness ``step_version − v`` (``async/staleness/k``: token share),
  its mean and max, and distinct versions per trajectory."""
  valid = np.arange(versions.shape[1])[None, :] < lengths[:, None]
  st = step_version - versions[valid]
  m: dict[str, float] = {}
  total = max(st.size, 1)
  for k in range(max_staleness + 1):
    m[f"async/staleness/{k}"] = float((st == k).sum() / total)
  m["async/staleness_mean"] = float(st.mean()) if st.size else 0.0
  m["async/staleness_max"] = float(st.max()) if st.size else 0.0
  per = [len(np.unique(versions[i, :lengths[i]])) for i in range(len(lengths)) if lengths[i]]
  m["async/versions_per_traj_mean"] = float(np.mean(per)) if per else 0.0
  m["async/versions_per_traj_max"] = float(np.max(per)) if per else 0.0
  return m


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
  """:class:`RLTrainer` on the trainer sub-mesh, fed by an engine on the rollout sub-mesh.

  Reuses ``pack`` / ``update`` / ``evaluate`` / checkpoints; replaces the schedule (:meth:`run`).
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
    self.share = cfg.rollout.prompts_per_step // self.procs
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
    runner = cfg.reward.runner
    # Errors are counted per training batch against reward.runner.max_errors (not per group).
    self.rollout_rewards = rewards.RewardRunner(
        cfg.reward.fn, reward_kwargs=cfg.reward.kwargs,
        config=dataclasses.replace(runner, max_errors=1.0, workers=a.reward_workers or runner.workers))
    self._collectors = cf.ThreadPoolExecutor(4, thread_name_prefix="jaxrl-async-collect")
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
    cfg, eng = self.cfg, self.cfg.rollout.engine
    model, dt = self.rollout_model()
    self.transfer_times.append(dt)
    engine = sampling.Engine(
        model, self.tokenizer, mesh=self.rollout_mesh, rules=self.rules,
        max_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens, num_slots=eng.num_slots // self.procs,
        kv_cache_bytes=eng.kv_cache_bytes, kv_cache_fraction=eng.kv_cache_fraction, block_size=eng.block_size,
        steps_per_call=eng.steps_per_call, prefill_rows=eng.prefill_rows, prefill_chunk=eng.prefill_chunk,
        version=version)
    engine.set_stops((), cfg.rollout.stop_strings)
    return engine

  # -- rollout side ----------------------------------------------------------------------------

  def global_group(self, index: int) -> int:
    """The global label of this process's group ``index`` (its share of round ``index // share``)."""
    return (index // self.share) * self.cfg.rollout.prompts_per_step + self.pid * self.share + index % self.share

  def _make_request(self, index: int):
    r = self.cfg.rollout
    if not self._admit_queue:  # a new round: this process's share of the global stream's next B prompts
      prompts, ids = self.admit_stream.take(r.prompts_per_step)  # the synchronous trainer's order
      mine = slice(self.pid * self.share, (self.pid + 1) * self.share)
      self._admit_queue.extend(zip(prompts[mine], ids[mine]))
    prompt, rid = self._admit_queue.popleft()
    req = sampling.Request(prompt=self.train_prompts.ids[prompt].tolist(), n=r.n, max_new_tokens=r.max_new_tokens,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=self.cfg.seed,
                           request_id=rid)
    return prompt, req

  def _on_row(self, g: Group, c) -> None:  # each row's reward starts as soon as it finishes
    rec = self.train_prompts.records[g.prompt]
    text = self.tokenizer.decode(np.asarray(c.tokens).tolist(), skip_special_tokens=True)
    self.rollout_rewards.submit(self.train_prompts.texts[g.prompt], text, index=g.index * g.n + c.sample,
                                **reward_fields(rec))

  def _score_group(self, g: Group) -> cf.Future:
    idx = [g.index * g.n + s for s in range(g.n)]

    def collect():
      got = self.rollout_rewards.collect(idx)
      return got.rewards.astype(np.float32), len(got.errors)
    return self._collectors.submit(collect)

  # -- the loop --------------------------------------------------------------------------------

  def run(self, *, until: int | None = None) -> dict[str, Any]:
    cfg = self.cfg
    # The checkpoint of step s holds the parameters after s steps and the prompt stream at group s·B (the
    # trainer's stream advances one batch per step). Groups admitted beyond it (async/ahead_groups at step
    # s) are not saved: the rollout restarts at version s and draws them again, same prompts and ids.
    start_step = self.resume()
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
    # The rollout thread admits from its own copy of the stream; self.stream (checkpointed) follows the batches.
    self.admit_stream = PromptStream(len(self.train_prompts), seed=cfg.data.shuffle_seed)
    self.admit_stream.set_state(self.stream.get_state())
    self._admit_queue: collections.deque[tuple[int, int]] = collections.deque()
    r = cfg.rollout
    keep = (functools.partial(informative, max_new=r.max_new_tokens, overlong_penalty=r.overlong_penalty)
            if r.dynamic_sampling else None)
    self.trained: list[dict[str, np.ndarray]] = []  # per step, every process's trained samples (gathered)
    self.staleness = AsyncSchedule(self.share, self.eta, max(last, start_step), start=start_step, informative=keep,
                                   max_rounds=r.max_rounds)
    self.engine = self._build_engine(version=start_step)
    self.worker = RolloutWorker(self.engine, self.staleness, make_request=self._make_request, score=self._score_group,
                                on_row=self._on_row, one_off=cfg.asynchronous.mode == "one_off",
                                interrupt=cfg.asynchronous.interrupt)
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
        if not self.worker.poll():
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
    cfg, r = self.cfg, self.cfg.rollout
    t_prev = time.perf_counter()
    for step in range(start_step + 1, last + 1):
      j = step - 1
      t_wait = time.perf_counter()
      if not self.staleness.wait_ready(j, stop):
        return
      t0 = time.perf_counter()
      batch = self.staleness.take(j)  # this process's share of batch j, every token within η (checked)
      groups = batch.groups
      # Every process has its share of batch j: from here on the programs span every process's trainer devices
      # (a barrier first: CPU collectives give up on a peer arriving more than 30 s late).
      sharding.barrier("rl-async-batch")
      # The checkpointed stream advances by every group drawn for the batch (filtered and dropped ones too,
      # as the synchronous trainer's rounds do): at the batch's last round's end after this. Each round's
      # share of this process is its contiguous slice.
      B = r.prompts_per_step
      prompts, ids = self.stream.take(batch.rounds * B)
      mine = [k for k in range(batch.rounds * B) if self.pid * self.share <= k % B < (self.pid + 1) * self.share]
      if [prompts[k] for k in mine] != [g.prompt for g in batch.drawn] or \
          [ids[k] for k in mine] != [g.request_id for g in batch.drawn]:
        raise RuntimeError(f"batch {j}: its groups are not this process's share of the prompt stream's next "
                           f"{batch.rounds * B} prompts")
      drawn, _ = groups_to_rollout(batch.drawn, self.train_prompts.ids, max_new=r.max_new_tokens,
                                   tokenizer=self.tokenizer, overlong_penalty=r.overlong_penalty)
      rollout, versions = groups_to_rollout(groups, self.train_prompts.ids, max_new=r.max_new_tokens,
                                            tokenizer=self.tokenizer, overlong_penalty=r.overlong_penalty)
      everything = self.global_view(drawn)  # every process's per-sample scalars (gathered)
      errors, ahead = (int(x) for x in sharding.allgather_rows(
          {"x": np.asarray([[sum(g.errors for g in batch.drawn), self.staleness.held()]])})[0]["x"].sum(0))
      if errors > cfg.reward.runner.allowed_errors(everything.num_samples):  # the same decision everywhere
        raise rewards.RewardBudgetExceeded(self.rollout_rewards.name, [], everything.num_samples,
                                           cfg.reward.runner.max_errors)
      self.last_rollout = rollout if groups else None
      metrics = self.rollout_metrics(everything)  # over every sample drawn, as the synchronous trainer's
      metrics["reward_errors"] = float(errors)
      if r.dynamic_sampling:
        metrics.update({"dynamic/groups_kept": float(len(groups)), "dynamic/rounds": float(batch.rounds),
                        "dynamic/groups_generated": float(len(batch.drawn)),
                        "dynamic/groups_filtered": float(batch.filtered),
                        "dynamic/groups_surplus": float(batch.surplus)})
      metrics["async/ahead_groups"] = float(ahead)
      trained_tokens = 0.0
      if groups:
        trained_tokens = self._record_trained(step, groups, rollout, versions, metrics)
        metrics.update(self.update(rollout, step))
      else:
        logger.note(f"step {step}: no informative group after {batch.rounds} rounds; no update")
      t1 = time.perf_counter()
      metrics["time_train"] = t1 - t0
      model, dt = self.rollout_model()
      self.transfer_times.append(dt)
      self.worker.offer_weights(model, step)
      t2 = time.perf_counter()
      counters = self.worker.take_counters()
      wall = max(t2 - t_prev, 1e-9)
      metrics.update({
          "async/time_weight_transfer": dt, "async/time_weight_apply": counters["apply_s"],
          "async/time_wait_batch": t0 - t_wait, "async/trainer_busy": (t2 - t0) / wall,
          "async/rollout_busy": min(counters["busy_s"] / wall, 1.0),
          "async/weight_transfer_bytes": float(self.transfer_bytes),
          "async/tok_s_effective": trained_tokens / wall, "time_step": wall})
      if groups:
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
        "group": np.asarray([self.global_group(g.index) for g in groups for _ in range(g.n)], np.int64),
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
    self.rollout_rewards.close()
    self._collectors.shutdown(wait=True)


def make_trainer(cfg: RLConfig) -> RLTrainer:
  """The trainer a config asks for: :class:`AsyncRLTrainer` with an ``asynchronous:`` section."""
  return AsyncRLTrainer(cfg) if cfg.asynchronous is not None else RLTrainer(cfg)
