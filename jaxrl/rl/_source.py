"""Rollout sources: the one interface through which an RL trainer gets its rollouts.

A trainer holds a :class:`RolloutSource` (its ``source`` attribute). Each step it asks the source for the
step's batch (:meth:`RolloutSource.rollout`: the next prompts of the trainer's stream, generated and
scored); after an update it hands the new policy over (:meth:`RolloutSource.set_weights`); ``close`` ends
it. The trainer never drives a sampler or an engine for its training rollouts itself. Three sources:

* :class:`EngineRollout`: synchronous and colocated. Each round of prompts is generated on the trainer's
  sampler or engine (which reads the trainer's parameter arrays in place) and scored in its reward pool.
* ``jaxrl.envs.EpisodeRollout``: synchronous multi-turn episodes (environments, tool calls, ARPO
  branching) on the same backend, scored by the environments.
* ``jaxrl.rl._async_rollout.AsyncRollout``: the asynchronous worker. An engine on the rollout sub-mesh admits
  prompts ahead under the staleness bound; a step's batch is the next one its buffer closes.

Both synchronous sources draw a step in rounds with :func:`draw_rounds` (DAPO dynamic sampling: more
rounds until the batch has ``prompts_per_step`` informative groups); they differ only in how one round
is generated. (In the spirit of Tunix's ``RLCluster`` rollout role: the learner sees batches and pushes
weights, never the generation machinery.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from jaxrl import rewards, sharding
from jaxrl.rl._config import RolloutConfig
from jaxrl.rl._prompts import EncodedPrompts, PromptStream
from jaxrl.rl._rollout import Rollout, concat_rollouts, informative_groups, total_rewards, vision_fields

_TIMES = ("time_generate", "time_reward", "reward_errors")
"""Round metrics that add up over a step's rounds (the others are averaged)."""


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  """One step's rollouts, as a source hands them to the trainer (this process's share of each)."""

  rollout: Rollout | None
  """The groups to train on; ``None`` when the step has none (dynamic sampling found no informative group)."""
  drawn: Rollout
  """Every sample drawn for the step, trained or not: the step's reward / length metrics."""
  metrics: dict[str, float]
  """The source's own metrics. ``time_generate`` (seconds), when present, also gives ``tok_s/rollout``."""


class RolloutSource(Protocol):
  """What an RL trainer consumes from its rollouts."""

  def rollout(self, step: int, prompts: EncodedPrompts, stream: PromptStream) -> RolloutBatch:
    """RL step ``step``'s batch: the next prompts of ``stream`` (indices into ``prompts``; the same global
    stream on every process, each process generating its share), at the policy of the last
    :meth:`set_weights`, scored."""
    ...

  def set_weights(self, model, *, version: int) -> None:
    """``model`` (the policy after ``version`` RL steps) generates every rollout from now on."""
    ...

  def close(self) -> None:
    """Releases the source's threads, pools and engine."""
    ...


def monitor_metrics(infos, prefix: str = "reward") -> dict[str, float]:
  """``{prefix}/monitor/<key>``: the mean of each ``info["monitor"]`` value over every process's samples that
  report it (:func:`jaxrl.rewards.monitor_means` of the gathered values). A collective: every process calls it,
  whatever its keys. Each value travels as a row with its key's UTF-8 bytes (padded to the longest key of any
  process), so processes may report different keys; on several processes the values travel in float32 (x64 off)."""
  pairs = rewards.monitor_values(infos)
  names = [k.encode() for k, _ in pairs]
  width = int(sharding.allgather_scalar(max(map(len, names), default=0)).max())
  if not width:
    return {}
  codes = np.zeros((len(names), width), np.int32)
  for i, b in enumerate(names):
    codes[i, :len(b)] = np.frombuffer(b, np.uint8)
  got, _ = sharding.allgather_rows({"key": codes, "value": np.asarray([v for _, v in pairs], np.float64)})
  keys = [bytes(row[row > 0].astype(np.uint8)).decode() for row in got["key"]]
  return rewards.monitor_means(list(zip(keys, got["value"].astype(np.float64).tolist())), prefix)


RoundFn = Callable[..., tuple[Rollout, dict[str, float]]]
"""``(idx, request_ids, *, max_new, n) -> (rollout, info)``: one round of prompts ``idx``, generated and
scored; ``info`` holds ``time_generate``, ``time_reward``, ``reward_errors`` and any other round metric."""


def draw_rounds(generate: RoundFn, step: int, stream: PromptStream, r: RolloutConfig, *, procs: int = 1,
                pid: int = 0) -> RolloutBatch:
  """A synchronous step's batch in rounds of ``r.prompts_per_step`` prompts from ``stream``.

  Every process takes the same global prompts and generates its contiguous share (``prompts_per_step /
  procs``, whole groups). Without dynamic sampling one round is the batch. With it, groups whose rewards
  are all equal are dropped and rounds continue (at most ``r.max_rounds``) until ``prompts_per_step``
  informative groups are kept, first ones first; the decision uses every process's groups, in process
  order, so it is the same everywhere. Round metrics ``time_*`` and ``reward_errors`` add up, others are
  averaged over the rounds that report them.
  """
  _, max_new, n = r.stage(step)
  want = r.prompts_per_step
  kept: list[Rollout] = []
  drawn: list[Rollout] = []
  infos: list[dict[str, float]] = []
  n_kept = 0
  per = want // procs  # this process's share of each round: prompts [pid·per, (pid+1)·per)
  mine = slice(pid * per, (pid + 1) * per)
  while True:
    idx, request_ids = stream.take(want)  # the global stream: the same on every process
    part, info = generate(idx[mine], request_ids[mine], max_new=max_new, n=n)
    drawn.append(part)
    infos.append(info)
    if not r.dynamic_sampling:
      kept, n_kept = [part], want
      break
    flags = informative_groups(part.rewards, part.group_ids, part.num_groups)
    if procs > 1:  # the same decision on every process: over all groups, in process order
      flags = sharding.allgather_rows({"f": flags})[0]["f"]
    good = np.flatnonzero(flags)[:want - n_kept]
    local = good[(good >= mine.start) & (good < mine.stop)] - mine.start
    if len(local):
      kept.append(part.select_groups(local))
    n_kept += len(good)
    if n_kept >= want or len(drawn) >= r.max_rounds:
      break
  metrics = {k: float(sum(i[k] for i in infos)) for k in _TIMES}
  if r.dynamic_sampling:
    metrics.update({"dynamic/groups_kept": float(n_kept), "dynamic/rounds": float(len(drawn)),
                    "dynamic/groups_generated": float(len(drawn) * want)})
  keys = dict.fromkeys(k for i in infos for k in i if k not in _TIMES)  # a monitor key may be in some rounds only
  metrics.update({k: float(np.mean([i[k] for i in infos if k in i])) for k in keys})
  if not n_kept:
    rollout = None
  elif not kept:  # other processes hold every kept group: an empty share (all processes still update)
    rollout = drawn[0].select_groups(np.zeros((0,), np.int64))
  else:
    rollout = concat_rollouts(kept)
  return RolloutBatch(rollout=rollout, drawn=concat_rollouts(drawn), metrics=metrics)


class EngineRollout:
  """The synchronous, colocated rollout: rounds on the trainer's sampler or engine, scored in its pool.

  Args:
    rollout: the ``rollout:`` section (sampling options, chunks, overlong penalty, dynamic sampling).
    seed: the sampling seed (draws depend on it, the request ids and the token index only).
    backend: ``step -> sampler`` holding the trainer's current parameters (``RLTrainer._sampler_for``:
      built from the config by :func:`jaxrl.rl.build_sampler`, read in place, no copy).
    submit: ``(prompts, idx, n, texts, *, offset) -> reward indices``: schedules the rewards of a chunk.
    rewards: ``() -> RewardRunner`` whose ``collect`` waits for them (the trainer's current pool).
    procs, pid: the processes generating together and this one's index.
  """

  def __init__(self, rollout: RolloutConfig, *, seed: int, backend: Callable[[int], Any], submit: Callable[..., list],
               rewards: Callable[[], Any], procs: int = 1, pid: int = 0):
    self.cfg, self.seed = rollout, seed
    self.backend, self.submit, self.rewards = backend, submit, rewards
    self.procs, self.pid = procs, pid

  def rollout(self, step: int, prompts: EncodedPrompts, stream: PromptStream) -> RolloutBatch:
    sampler = self.backend(step)
    generate = lambda idx, ids, **kw: self.generate(sampler, idx, ids, prompts=prompts, **kw)
    return draw_rounds(generate, step, stream, self.cfg, procs=self.procs, pid=self.pid)

  def set_weights(self, model, *, version: int) -> None:
    """Nothing to push: the backend hands the sampler the trainer's arrays at each :meth:`rollout`."""

  def close(self) -> None:
    """Nothing to release: the backend and the reward pool belong to the trainer."""

  def generate(self, sampler, idx: list[int], request_ids: list[int], *, prompts: EncodedPrompts, max_new: int,
               n: int) -> tuple[Rollout, dict[str, float]]:
    """Generates and scores one round. With ``rollout.reward_overlap_chunks > 1`` the prompts are
    generated in chunks and each chunk's rewards run in the pool while the next chunk generates."""
    r = self.cfg
    t0 = time.perf_counter()
    chunks = np.array_split(np.arange(len(idx)), min(r.reward_overlap_chunks, len(idx)))  # none empty
    outs, submitted, images = [], [], []
    for c in chunks:
      part = [idx[k] for k in c]
      imgs = [prompts.images(i) for i in part] if prompts.has_images else None  # loaded now, never all held
      out = sampler.generate([prompts.ids[i].tolist() for i in part], n=n, max_new_tokens=max_new,
                             temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=self.seed,
                             request_ids=[request_ids[k] for k in c], stop_strings=r.stop_strings,
                             **({"images": imgs} if imgs else {}))
      images += [x for x in (imgs or []) for _ in range(n)]
      submitted += self.submit(prompts, part, n, out.texts, offset=len(submitted))
      outs.append(out)
    t1 = time.perf_counter()
    scored = self.rewards().collect(submitted)  # waits only for what is still running
    t2 = time.perf_counter()
    lengths = np.concatenate([o.lengths for o in outs])
    finish = [f for o in outs for f in o.finish_reason]
    task = scored.rewards.astype(np.float32)
    rollout = Rollout(
        prompt_ids=tuple(prompts.ids[i] for i in idx for _ in range(n)),
        tokens=np.concatenate([o.tokens for o in outs]), logprobs=np.concatenate([o.logprobs for o in outs]),
        lengths=lengths.astype(np.int32),
        truncated=np.asarray([f == "length" for f in finish]),
        group_ids=np.repeat(np.arange(len(idx), dtype=np.int32), n),
        rewards=total_rewards(task, lengths, max_new=max_new, overlong_penalty=r.overlong_penalty),
        task_rewards=task, texts=tuple(t for o in outs for t in o.texts),
        **(vision_fields(sampler.cfg, [prompts.ids[i] for i in idx for _ in range(n)], images) if images else {}))
    # time_reward: the wait for rewards after the last chunk generated (all of scoring without overlap).
    info = {"time_generate": t1 - t0, "time_reward": t2 - t1, "reward_errors": float(len(scored.errors))}
    info |= monitor_metrics(scored.infos)  # e.g. RubiCap's reward/monitor/*, over every process's samples
    return rollout, info
