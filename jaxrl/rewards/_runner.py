"""Scoring batches of samples with a reward function in a thread or process pool.

`RewardRunner` keys every sample by its index, so results come back in order and each sample is
counted exactly once however the pool finishes them. A reward function that raises, returns a
non-finite value or the wrong type gives that sample `RewardRunnerConfig.error_value` and a
recorded reason; past `max_errors` errors in one collected batch the runner raises
`RewardBudgetExceeded` naming the function and the first failures.

Samples can be submitted one by one as generation finishes them (`submit`) and collected later
(`collect`), so reward computation overlaps generation.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import multiprocessing
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from jaxrl.rewards._base import RewardValueError, coerce_reward, load_reward, reward_name

__all__ = [
  "RewardBatch",
  "RewardBudgetExceeded",
  "RewardError",
  "RewardRunner",
  "RewardRunnerConfig",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardRunnerConfig:
  """How a `RewardRunner` schedules reward calls and tolerates failures."""

  workers: int = 4
  """Pool size (threads or processes)."""
  executor: Literal["thread", "process"] = "thread"
  """``thread`` suits rewards that wait on subprocesses (the code sandbox) or are cheap;
  ``process`` gives CPU-bound Python rewards (sympy) real parallelism. Process workers receive
  the reward by import path (or pickle) and load it once per worker."""
  mp_context: Literal["spawn", "forkserver", "fork"] = "spawn"
  """Start method for process workers; ``spawn`` is safe in a process that already runs JAX."""
  max_errors: int | float = 0.05
  """Errors tolerated per collected batch before aborting: an int is a count, a float in [0, 1] a
  fraction of the batch. ``0`` aborts on the first error."""
  error_value: float = 0.0
  """Reward given to a sample whose reward call failed."""
  timeout_s: float | None = None
  """Per-sample deadline, counted from `submit`; a sample still running at `collect` past it is an
  error with reason ``timeout`` (its worker thread cannot be interrupted and keeps running)."""
  max_worker_restarts: int = 3
  """Process workers: a worker that dies (killed, segfault, ``os._exit``) breaks the pool; it is
  started again at most this many times per runner, and the samples it lost (their results never came
  back) are scored again, each result counted once. One more death: `RewardWorkersDied`, so a reward
  that kills its worker on some input stops the run with a message instead of looping."""

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
      raise ValueError(f"workers must be a positive int, got {self.workers!r}")
    if self.executor not in ("thread", "process"):
      raise ValueError(f"executor must be 'thread' or 'process', got {self.executor!r}")
    if self.mp_context not in ("spawn", "forkserver", "fork"):
      raise ValueError(f"mp_context must be spawn/forkserver/fork, got {self.mp_context!r}")
    m = self.max_errors
    if isinstance(m, bool) or not isinstance(m, (int, float)):
      raise ValueError(f"max_errors must be an int count or a float fraction, got {m!r}")
    if isinstance(m, int) and m < 0:
      raise ValueError(f"max_errors as a count must be >= 0, got {m!r}")
    if isinstance(m, float) and not 0.0 <= m <= 1.0:
      raise ValueError(f"max_errors as a fraction must be in [0, 1], got {m!r}")
    if not np.isfinite(self.error_value):
      raise ValueError(f"error_value must be finite, got {self.error_value!r}")
    if self.timeout_s is not None and not self.timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s!r}")
    if isinstance(self.max_worker_restarts, bool) or not isinstance(self.max_worker_restarts, int) \
        or self.max_worker_restarts < 0:
      raise ValueError(f"max_worker_restarts must be an int >= 0, got {self.max_worker_restarts!r}")

  def allowed_errors(self, n: int) -> float:
    """The most errors a batch of `n` samples may have without aborting."""
    return float(self.max_errors) if isinstance(self.max_errors, int) else self.max_errors * n


@dataclasses.dataclass(frozen=True)
class RewardError:
  """One failed reward call: the sample's index, a short reason tag and the message."""

  index: int
  reason: str
  """``exception``, ``wrong_type``, ``wrong_shape``, ``non_finite``, ``timeout`` or ``worker_died``."""
  message: str


class RewardBudgetExceeded(RuntimeError):
  """More reward calls failed in one batch than `RewardRunnerConfig.max_errors` allows."""

  def __init__(self, name: str, errors: Sequence[RewardError], n: int, max_errors: int | float):
    self.reward = name
    self.errors = list(errors)
    first = "; ".join(f"[sample {e.index}] {e.reason}: {e.message}" for e in self.errors[:3])
    super().__init__(
      f"reward function {name} failed on {len(self.errors)}/{n} samples "
      f"(max_errors={max_errors!r}); first errors: {first}"
    )


class RewardWorkersDied(RuntimeError):
  """The process pool broke more than ``max_worker_restarts`` times."""


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """Scored samples in index order."""

  indices: tuple[int, ...]
  rewards: np.ndarray  # [N] float32
  infos: tuple[dict[str, Any], ...]
  errors: tuple[RewardError, ...]

  def __len__(self) -> int:
    return len(self.indices)

  def metrics(self, prefix: str = "reward") -> dict[str, float]:
    """Mean/std/min/max of the rewards, the error count, a count per ``info["reason"]`` and the mean of each
    ``info["monitor"]`` value over the samples that report it (e.g. RubiCap's ``reward/monitor/self_praise``)."""
    r = self.rewards.astype(np.float64)
    out = {f"{prefix}/errors": float(len(self.errors))}
    if len(r):
      out |= {f"{prefix}/mean": r.mean(), f"{prefix}/std": r.std(), f"{prefix}/min": r.min(), f"{prefix}/max": r.max()}
    for info in self.infos:
      reason = info.get("reason")
      if isinstance(reason, str):
        key = f"{prefix}/reason/{reason}"
        out[key] = out.get(key, 0.0) + 1.0
    out |= monitor_means(monitor_values(self.infos), prefix)
    return {k: float(v) for k, v in out.items()}


def monitor_values(infos: Sequence[Mapping[str, Any] | None]) -> list[tuple[str, float]]:
  """Every ``(key, value)`` of the samples' ``info["monitor"]`` dicts, in sample order."""
  return [(str(k), float(v)) for info in infos for k, v in ((info or {}).get("monitor") or {}).items()]


def monitor_means(pairs: Sequence[tuple[str, float]], prefix: str = "reward") -> dict[str, float]:
  """``{prefix}/monitor/<key>``: the mean of each key's values over the samples that report it."""
  monitored: dict[str, list[float]] = {}
  for k, v in pairs:
    monitored.setdefault(f"{prefix}/monitor/{k}", []).append(v)
  return {k: float(np.mean(np.asarray(v, np.float64))) for k, v in monitored.items()}


def _evaluate(fn: Callable[..., Any], prompt: str, completion: str, fields: Mapping[str, Any]):
  """Runs one reward call; returns ``(value, info, None)`` or ``(None, None, (reason, message))``."""
  try:
    result = coerce_reward(fn(prompt, completion, **fields))
  except RewardValueError as e:
    return None, None, (e.reason, str(e))
  except Exception as e:  # noqa: BLE001 (any failure of user code is a counted sample error)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return None, None, ("exception", f"{type(e).__name__}: {e}{where}")
  return result.value, result.info, None


@functools.lru_cache(maxsize=16)
def _worker_fn(blob: bytes) -> Callable[..., Any]:
  spec, kwargs = pickle.loads(blob)
  return load_reward(spec, **kwargs)


def _evaluate_in_worker(blob: bytes, prompt: str, completion: str, fields: Mapping[str, Any]):
  return _evaluate(_worker_fn(blob), prompt, completion, fields)


class RewardRunner:
  """Scores samples with one reward function in a pool.

  Args:
    reward: the reward function or its import path (see `load_reward`).
    config: scheduling and error tolerance.
    reward_kwargs: bound to the reward function (e.g. ``{"config": MathRewardConfig.areal()}``).

  Example:
    >>> runner = RewardRunner("jaxrl.rewards.math:math_reward")
    >>> runner.score(["1+1?"], ["<think>.</think> \\\\boxed{2}"], answer=["2"]).rewards.tolist()
    [1.0]
    >>> # asynchronous: submit each sample as it finishes generating, collect before the update
    >>> runner.submit("1+1?", "<think>.</think> 3", index=7, answer="2")
    7
    >>> runner.collect().rewards.tolist()
    [0.0]
  """

  def __init__(
    self,
    reward: str | Callable[..., Any],
    *,
    config: RewardRunnerConfig | None = None,
    reward_kwargs: Mapping[str, Any] | None = None,
  ):
    self.config = config or RewardRunnerConfig()
    kwargs = dict(reward_kwargs or {})
    self.name = reward_name(reward)
    self._fn = load_reward(reward, **kwargs)  # fails fast on a bad import path
    if self.config.executor == "process":
      try:
        self._blob = pickle.dumps((reward, kwargs))
      except Exception as e:  # noqa: BLE001
        raise TypeError(
          f"reward {self.name} cannot be sent to process workers ({e}); pass it as an import "
          "path 'module:function' or use executor='thread'"
        ) from e
      self._pool: cf.Executor = self._new_process_pool()
    else:
      self._pool = cf.ThreadPoolExecutor(self.config.workers, thread_name_prefix="jaxrl-reward")
    self._lock = threading.Lock()
    self._pool_lock = threading.Lock()
    self.restarts = 0  # process pools started again after a worker died
    self._pending: dict[int, tuple[cf.Future, float]] = {}
    self._next_index = 0

  def _new_process_pool(self) -> cf.ProcessPoolExecutor:
    ctx = multiprocessing.get_context(self.config.mp_context)
    return cf.ProcessPoolExecutor(self.config.workers, mp_context=ctx)

  def _restart_pool(self, broken: cf.Executor) -> None:
    """Replaces the pool ``broken`` (once, however many of its futures report it)."""
    with self._pool_lock:
      if self._pool is not broken:
        return  # another sample of the same pool already restarted it
      if self.restarts >= self.config.max_worker_restarts:
        raise RewardWorkersDied(
            f"reward {self.name}: a process worker died again after {self.restarts} restart(s) "
            f"(reward.runner.max_worker_restarts={self.config.max_worker_restarts}); check the reward "
            "function for crashes or memory use")
      broken.shutdown(wait=False, cancel_futures=True)
      self._pool = self._new_process_pool()
      self.restarts += 1

  # -- other work in the same pool (tool calls of agentic environments) -----------------------

  def submit_call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
    """Runs ``fn(*args, **kwargs)`` in the reward pool (process workers: everything must pickle).

    Tool calls of :class:`jaxrl.envs.ToolExecutor` run here, so a tool that crashes kills a worker,
    not the trainer. A broken process pool is started again; that restart is not counted against
    ``max_worker_restarts`` (the caller turns the lost call into an error of its own).
    """
    pool = self._pool
    try:
      return pool.submit(fn, *args, **kwargs)
    except cf.BrokenExecutor:
      self.replace_pool(pool)
      return self._pool.submit(fn, *args, **kwargs)

  def replace_pool(self, old: cf.Executor | None = None, *, kill: bool = False) -> None:
    """Process workers: a fresh pool instead of ``old`` (default: the current one; replaced once,
    however many callers ask for the same ``old``). With ``kill`` the old pool's workers are killed
    first (a hung call cannot be interrupted otherwise; calls still running there fail with
    ``BrokenExecutor``, reward samples among them are scored again). Not counted against
    ``max_worker_restarts``. Thread pools are left as they are."""
    with self._pool_lock:
      old = self._pool if old is None else old
      if self.config.executor != "process" or self._pool is not old:
        return
      if kill:
        for proc in list((getattr(old, "_processes", None) or {}).values()):  # no public handle on the workers
          proc.kill()
      old.shutdown(wait=False, cancel_futures=True)
      self._pool = self._new_process_pool()

  # -- asynchronous feeding --------------------------------------------------------------------

  def submit(self, prompt: str, completion: str, *, index: int | None = None, **fields: Any) -> int:
    """Schedules one sample and returns its index (the next free one when `index` is None).

    Raises:
      ValueError: `index` is already pending (each sample is scored exactly once).
    """
    with self._lock:
      if index is None:
        index = self._next_index
      if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"index must be an int, got {index!r}")
      index = int(index)
      if index in self._pending:
        raise ValueError(f"sample index {index} is already pending in {self.name}")
      self._pending[index] = (self._schedule(prompt, completion, fields), time.monotonic())
      self._next_index = max(self._next_index, index + 1)
      return index

  def _schedule(self, prompt: str, completion: str, fields: Mapping[str, Any]) -> cf.Future:
    if self.config.executor == "process":
      pool = self._pool
      try:
        fut = pool.submit(_evaluate_in_worker, self._blob, prompt, completion, fields)
      except cf.BrokenExecutor:
        self._restart_pool(pool)
        pool = self._pool
        fut = pool.submit(_evaluate_in_worker, self._blob, prompt, completion, fields)
      fut.jaxrl_retry = (pool, prompt, completion, fields)  # what a restart needs to score it again
      return fut
    return self._pool.submit(_evaluate, self._fn, prompt, completion, fields)

  @property
  def pending(self) -> int:
    """Samples submitted and not yet collected."""
    with self._lock:
      return len(self._pending)

  def collect(self, indices: Sequence[int] | None = None) -> RewardBatch:
    """Waits for the given (default: all pending) samples and returns them in index order.

    Raises:
      KeyError: an index was never submitted or was already collected.
      RewardBudgetExceeded: more failures than `max_errors` among the collected samples.
    """
    with self._lock:
      wanted = sorted(self._pending) if indices is None else [int(i) for i in indices]
      if len(set(wanted)) != len(wanted):
        raise ValueError(f"collect: duplicate indices in {list(indices or [])}")
      missing = [i for i in wanted if i not in self._pending]
      if missing:
        raise KeyError(f"collect: indices {missing[:10]} are not pending in {self.name}")
      items = [(i, *self._pending.pop(i)) for i in wanted]
      items.sort(key=lambda t: t[0])
    return self._gather(items)

  def _gather(self, items: list[tuple[int, cf.Future, float]]) -> RewardBatch:
    rewards = np.empty(len(items), np.float32)
    infos: list[dict[str, Any]] = []
    errors: list[RewardError] = []
    for k, (index, fut, t0) in enumerate(items):
      value, info, err = self._wait(fut, t0)
      if err is not None:
        errors.append(RewardError(index, err[0], err[1]))
        rewards[k] = self.config.error_value
        infos.append({"reason": "reward_error", "error": err[0], "message": err[1]})
      else:
        rewards[k] = value
        infos.append(info)
    batch = RewardBatch(tuple(i for i, *_ in items), rewards, tuple(infos), tuple(errors))
    if len(errors) > self.config.allowed_errors(len(items)):
      raise RewardBudgetExceeded(self.name, errors, len(items), self.config.max_errors)
    return batch

  def _wait(self, fut: cf.Future, t0: float):
    timeout = None
    if self.config.timeout_s is not None:
      timeout = max(0.0, t0 + self.config.timeout_s - time.monotonic())
    try:
      return fut.result(timeout=timeout)
    except cf.TimeoutError:
      fut.cancel()
      return None, None, ("timeout", f"no result within timeout_s={self.config.timeout_s}")
    except cf.BrokenExecutor as e:
      retry = getattr(fut, "jaxrl_retry", None)
      if retry is None:
        return None, None, ("worker_died", f"the reward worker process died: {e}")
      # The sample was lost with its pool (its result never came back): score it again on a new one.
      pool, prompt, completion, fields = retry
      self._restart_pool(pool)
      return self._wait(self._schedule(prompt, completion, fields), t0)
    except Exception as e:  # noqa: BLE001 (e.g. an unpicklable result from a process worker)
      return None, None, ("exception", f"{type(e).__name__}: {e}")

  # -- synchronous batch -----------------------------------------------------------------------

  def score(self, prompts: Sequence[str], completions: Sequence[str], **fields: Sequence[Any]) -> RewardBatch:
    """Scores ``len(prompts)`` samples; each keyword is a per-sample column of the same length.

    The batch's indices are ``0 .. N-1``; samples fed with `submit` are not touched.
    """
    n = len(prompts)
    if len(completions) != n:
      raise ValueError(f"score: {n} prompts but {len(completions)} completions")
    for key, col in fields.items():
      if isinstance(col, (str, bytes)) or len(col) != n:
        raise ValueError(f"score: field {key!r} must be a sequence of {n} values (one per sample)")
    items = []
    for i in range(n):
      row = {k: v[i] for k, v in fields.items()}
      items.append((i, self._schedule(prompts[i], completions[i], row), time.monotonic()))
    return self._gather(items)

  def close(self, *, wait: bool = True) -> None:
    """Shuts the pool down (pending futures are cancelled when `wait` is False)."""
    self._pool.shutdown(wait=wait, cancel_futures=not wait)

  def __enter__(self) -> RewardRunner:
    return self

  def __exit__(self, *exc) -> None:
    self.close(wait=exc[0] is None)

