"""The rollout side of asynchronous RL (:mod:`jaxrl.rl._async`, docs/async.md): AReaL's staleness bound
(eq. 3) with its buffer of scored groups (:class:`AsyncSchedule`), the rollout loop over the engine
(:class:`RolloutWorker`), and :class:`AsyncRollout`, the rollout source the asynchronous trainer takes each
step's batch from. The bookkeeping is pure Python (tested with a scripted engine); the rollout loop runs on
the calling thread, the trainer on its own.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl import rewards, sampling, sharding
from jaxrl.rl._config import RLConfig
from jaxrl.rl._prompts import EncodedPrompts, PromptStream, reward_fields
from jaxrl.rl._rollout import Rollout, informative_groups, total_rewards, vision_fields
from jaxrl.rl._source import RolloutBatch, monitor_metrics

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
  infos: tuple[dict[str, Any], ...] = ()  # the reward's info per sample (``monitor`` values are logged)
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


def groups_to_rollout(groups: list[Group], prompt_ids, *, max_new: int, tokenizer, overlong_penalty=None,
                      images=None, model_cfg=None) -> tuple[Rollout, np.ndarray]:
  """The groups (admission order, samples ``0..n-1``) as the synchronous trainer's :class:`Rollout`,
  plus ``[N, max_new]`` per-token versions (−1 past each length; also the rollout's ``versions``). ``logprobs``
  are the engine's behaviour log-probs (π_behav of decoupled PPO), token by token whichever version drew them.
  With ``images`` (``prompt -> images or None``, :meth:`EncodedPrompts.images`) and the VLM's ``model_cfg`` the
  rollout gets :func:`vision_fields`, as the synchronous source gives it."""
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
      task_rewards=task, texts=texts, versions=versions)
  if images is not None:
    imgs = {g.prompt: images(g.prompt) for _, g, _ in rows}
    rollout = dataclasses.replace(rollout, **vision_fields(model_cfg, rollout.prompt_ids,
                                                           [imgs[g.prompt] for _, g, _ in rows]))
  return rollout, versions


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
# The rollout source


class AsyncRollout:
  """The asynchronous trainer's rollout source (a :class:`jaxrl.rl.RolloutSource`): a :class:`RolloutWorker`
  driving an engine on the rollout sub-mesh, with its own reward pool and its own copy of the prompt stream,
  filling the :class:`AsyncSchedule` buffer that :meth:`rollout` takes each step's batch from.

  :meth:`start` builds the loop; the rollout thread then calls :meth:`poll` while the trainer thread calls
  :meth:`wait`, :meth:`rollout` and :meth:`set_weights`. On several processes each admits its contiguous share of
  every round of the global stream (``share`` groups) and scores it in its own pool.

  Args:
    cfg: the run's config (``rollout``, ``reward``, ``asynchronous``, ``seed``, ``data.shuffle_seed``).
    tokenizer: the policy's tokenizer (completion texts for the rewards).
    procs, pid: the processes rolling out together and this one's index.
  """

  def __init__(self, cfg: RLConfig, tokenizer, *, procs: int = 1, pid: int = 0):
    a, runner = cfg.asynchronous, cfg.reward.runner
    self.cfg, self.tokenizer, self.procs, self.pid = cfg, tokenizer, procs, pid
    self.share = cfg.rollout.prompts_per_step // procs
    # Errors are counted per training batch against reward.runner.max_errors (not per group).
    self.rewards = rewards.RewardRunner(
        cfg.reward.fn, reward_kwargs=cfg.reward.kwargs,
        config=dataclasses.replace(runner, max_errors=1.0, workers=a.reward_workers or runner.workers))
    self._collectors = cf.ThreadPoolExecutor(4, thread_name_prefix="jaxrl-async-collect")
    self.engine: sampling.Engine | None = None
    self.schedule: AsyncSchedule | None = None
    self.worker: RolloutWorker | None = None
    self.last: Batch | None = None  # the batch the last rollout() took

  def start(self, engine, prompts: EncodedPrompts, stream: PromptStream, *, start: int, total: int) -> None:
    """Rolls out on ``engine`` (at policy version ``start``) from a copy of ``stream`` (its position: the
    checkpoint of step ``start``), batches ``start .. total - 1``."""
    r, a = self.cfg.rollout, self.cfg.asynchronous
    self.prompts, self.engine = prompts, engine
    # The rollout thread admits from its own copy of the stream; the trainer's (checkpointed) follows the batches.
    self.admit_stream = PromptStream(len(prompts), seed=self.cfg.data.shuffle_seed)
    self.admit_stream.set_state(stream.get_state())
    self._admit_queue: collections.deque[tuple[int, int]] = collections.deque()
    keep = (functools.partial(informative, max_new=r.max_new_tokens, overlong_penalty=r.overlong_penalty)
            if r.dynamic_sampling else None)
    self.schedule = AsyncSchedule(self.share, a.max_staleness, total, start=start, informative=keep,
                                  max_rounds=r.max_rounds)
    self.worker = RolloutWorker(engine, self.schedule, make_request=self._make_request, score=self._score_group,
                                on_row=self._on_row, one_off=a.mode == "one_off", interrupt=a.interrupt)

  def poll(self) -> bool:
    """One iteration of the rollout loop (:meth:`RolloutWorker.poll`); whether the engine ran a round."""
    return self.worker.poll()

  def wait(self, step: int, stop: threading.Event) -> bool:
    """Waits until the batch of ``step`` is ready; False when ``stop`` was set first."""
    return self.schedule.wait_ready(step - 1, stop)

  def rollout(self, step: int, prompts: EncodedPrompts, stream: PromptStream) -> RolloutBatch:
    """Takes the batch of ``step`` (this process's share, every token within η: checked), advances ``stream``
    by every group drawn for it (checking they are its next prompts) and checks the reward-error budget over
    every process's samples. A collective: every process calls it, in step order."""
    r, B = self.cfg.rollout, self.cfg.rollout.prompts_per_step
    _, max_new, n = r.stage(step)
    batch = self.last = self.schedule.take(step - 1)
    if any(g.n != n for g in batch.drawn):  # admission gave every group of batch step - 1 the stage of step
      raise RuntimeError(f"batch {step - 1}: group sizes {sorted({g.n for g in batch.drawn})}, its stage's n is {n}")
    # Every process has its share of the batch: from here on the programs span every process's trainer devices
    # (a barrier first: CPU collectives give up on a peer arriving more than 30 s late).
    sharding.barrier("rl-async-batch")
    # The stream advances by every group drawn for the batch (filtered and dropped ones too, as the synchronous
    # trainer's rounds do). Each round's share of this process is its contiguous slice.
    got, ids = stream.take(batch.rounds * B)
    mine = [k for k in range(batch.rounds * B) if self.pid * self.share <= k % B < (self.pid + 1) * self.share]
    if [got[k] for k in mine] != [g.prompt for g in batch.drawn] or \
        [ids[k] for k in mine] != [g.request_id for g in batch.drawn]:
      raise RuntimeError(f"batch {step - 1}: its groups are not this process's share of the prompt stream's next "
                         f"{batch.rounds * B} prompts")
    vl = dict(images=prompts.images, model_cfg=self.engine.cfg) if prompts.has_images else {}
    drawn, _ = groups_to_rollout(batch.drawn, prompts.ids, max_new=max_new, tokenizer=self.tokenizer,
                                 overlong_penalty=r.overlong_penalty)
    rollout, _ = groups_to_rollout(batch.groups, prompts.ids, max_new=max_new, tokenizer=self.tokenizer,
                                   overlong_penalty=r.overlong_penalty, **vl)
    errors, ahead, samples = (int(x) for x in sharding.allgather_rows({"x": np.asarray(
        [[sum(g.errors for g in batch.drawn), self.schedule.held(), drawn.num_samples]])})[0]["x"].sum(0))
    runner = self.cfg.reward.runner
    if errors > runner.allowed_errors(samples):  # the same decision everywhere
      raise rewards.RewardBudgetExceeded(self.rewards.name, [], samples, runner.max_errors)
    metrics = {"reward_errors": float(errors)}
    metrics |= monitor_metrics([i for g in batch.drawn for i in g.infos])  # reward/monitor/*, every process's
    if r.dynamic_sampling:
      metrics.update({"dynamic/groups_kept": float(len(batch.groups)), "dynamic/rounds": float(batch.rounds),
                      "dynamic/groups_generated": float(len(batch.drawn)),
                      "dynamic/groups_filtered": float(batch.filtered),
                      "dynamic/groups_surplus": float(batch.surplus)})
    metrics["async/ahead_groups"] = float(ahead)
    return RolloutBatch(rollout=rollout if batch.groups else None, drawn=drawn, metrics=metrics)

  def set_weights(self, model, *, version: int) -> None:
    """Offers ``model`` (already on the rollout shardings) to the rollout loop, applied between engine rounds."""
    self.worker.offer_weights(model, version)

  def take_counters(self) -> dict[str, float]:
    """Engine-busy and weight-apply seconds since the last call (:meth:`RolloutWorker.take_counters`)."""
    return self.worker.take_counters()

  def global_group(self, index: int) -> int:
    """The global label of this process's group ``index`` (its share of round ``index // share``)."""
    return (index // self.share) * self.cfg.rollout.prompts_per_step + self.pid * self.share + index % self.share

  def _make_request(self, index: int):
    """Group ``index``'s request. Without dynamic sampling it lands in batch ``index // share``, trained at step
    ``index // share + 1``: generated with that step's context stage (``max_new_tokens``, ``n``)."""
    r = self.cfg.rollout
    _, max_new, n = r.stage(index // self.share + 1)
    if not self._admit_queue:  # a new round: this process's share of the global stream's next B prompts
      prompts, ids = self.admit_stream.take(r.prompts_per_step)  # the synchronous trainer's order
      mine = slice(self.pid * self.share, (self.pid + 1) * self.share)
      self._admit_queue.extend(zip(prompts[mine], ids[mine]))
    prompt, rid = self._admit_queue.popleft()
    req = sampling.Request(prompt=self.prompts.ids[prompt].tolist(), n=n, max_new_tokens=max_new,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=self.cfg.seed,
                           request_id=rid,
                           **({"images": self.prompts.images(prompt)} if self.prompts.has_images else {}))
    return prompt, req

  def _on_row(self, g: Group, c) -> None:  # each row's reward starts as soon as it finishes
    rec = self.prompts.records[g.prompt]
    text = self.tokenizer.decode(np.asarray(c.tokens).tolist(), skip_special_tokens=True)
    self.rewards.submit(self.prompts.texts[g.prompt], text, index=g.index * g.n + c.sample, **reward_fields(rec))

  def _score_group(self, g: Group) -> cf.Future:
    idx = [g.index * g.n + s for s in range(g.n)]

    def collect():
      got = self.rewards.collect(idx)
      g.infos = got.infos  # before the future completes: the rollout loop reads it after
      return got.rewards.astype(np.float32), len(got.errors)
    return self._collectors.submit(collect)

  def close(self) -> None:
    self.rewards.close()
    self._collectors.shutdown(wait=True)
