"""The RL trainer driven by an environment: :class:`AgenticTrainer` and :class:`AgenticRLConfig`.

:class:`AgenticTrainer` is :class:`jaxrl.rl.RLTrainer` with its rollout source replaced: each round
of prompts becomes ``rollout.n`` multi-turn episodes (:class:`MultiTurnRollout`; with an ``arpo:``
section, ARPO's adaptive branching; with ``rollout.engine``, continuous batching on the engine, ARPO
included),
scored by the environment's rewards. The rollout carries a ``policy_mask`` (tool / environment
tokens 0) that :func:`jaxrl.rl.loss_mask` folds into the loss mask, and ``prefix_ids`` that
``arpo_hard`` / ``arpo_soft`` advantages read. Everything after the rollout (advantages, packing,
updates, checkpoints) is the RL trainer's own code.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jaxrl import rewards as rewards_lib
from jaxrl.envs._arpo import ArpoConfig
from jaxrl.envs._base import env_factory
from jaxrl.envs._multiturn import AgentBatch, MultiTurnRollout, SamplingOptions
from jaxrl.rl import (AlgorithmConfig, EncodedPrompts, PromptStream, RLConfig, RLTrainer, Rollout, RolloutBatch, draw_rounds,
                      total_rewards)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSection:
  """The ``env:`` section: which environment, its options, and per-trajectory limits."""

  name: str = "single_turn"
  "A registered environment (``jaxrl.envs.ENVS``): ``single_turn``, ``tools`` or your own."
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  "Passed to the environment (``tools: {calculator: {}}``, ``reward_fn``, ``max_tool_calls``, ...)."
  max_turns: int = 8
  "Assistant turns per trajectory."
  max_turn_tokens: int | None = None
  "Tokens per assistant turn (default: what is left of ``rollout.max_new_tokens``)."
  workers: int = 8
  "Threads stepping environments concurrently."
  min_bucket: int = 64
  ("Smallest prompt / completion length bucket of the sampler: contexts grow every turn, so larger "
   "buckets mean fewer compilations (the sampler's own default is 8).")

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns!r}")
    if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
      raise ValueError(f"env.max_turn_tokens must be >= 1 or null, got {self.max_turn_tokens!r}")
    if self.workers < 1:
      raise ValueError(f"env.workers must be >= 1, got {self.workers!r}")
    if self.min_bucket < 1:
      raise ValueError(f"env.min_bucket must be >= 1, got {self.min_bucket!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgenticAlgorithmConfig(AlgorithmConfig):
  """``algorithm:`` of an agentic run: the rollouts supply ``prefix_ids`` (``arpo_hard`` can run)."""

  TREE_ROLLOUTS = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgenticRLConfig(RLConfig):
  """``jaxrl rl`` with an ``env:`` section: multi-turn (tool-use) RL, optionally with ARPO rollouts."""

  algorithm: AgenticAlgorithmConfig = dataclasses.field(default_factory=AgenticAlgorithmConfig)
  env: EnvSection = dataclasses.field(default_factory=EnvSection)
  arpo: ArpoConfig | None = None
  "ARPO's entropy-based adaptive rollout (``rollout.n`` is the global budget ``M``); null: plain groups."

  def __post_init__(self):
    super().__post_init__()
    if self.arpo is not None:
      ns = [self.rollout.n] + [s.n for s in self.rollout.context_schedule if s.n is not None]
      if self.arpo.initial_samples > min(ns):
        raise ValueError(f"arpo.initial_samples={self.arpo.initial_samples} must be <= rollout.n={min(ns)} "
                         "(the global rollout size M)")
    if getattr(self, "asynchronous", None) is not None:
      raise ValueError("asynchronous: multi-turn rollouts are synchronous so far; remove the section")


def agent_metrics(batch: AgentBatch, prefix: str = "agent") -> dict[str, float]:
  """Means over trajectories: environment metrics, tool-call rate, policy / tool tokens, turns."""
  ts = batch.trajectories
  per = [t.env.metrics() for t in ts]
  keys = sorted({k for m in per for k in m})
  out = {f"{prefix}/{k}": float(np.mean([m.get(k, 0.0) for m in per])) for k in keys}
  if "tool_calls" in keys:
    out[f"{prefix}/tool_call_rate"] = float(np.mean([m.get("tool_calls", 0.0) > 0 for m in per]))
  pol = np.asarray([sum(t.policy) for t in ts], np.float64)
  out[f"{prefix}/policy_tokens_mean"] = float(pol.mean())
  out[f"{prefix}/env_tokens_mean"] = float(np.mean([len(t.tokens) for t in ts]) - pol.mean())
  out[f"{prefix}/turns_mean"] = float(np.mean([t.turns for t in ts]))
  for k, v in batch.stats.items():
    if k != "time_rollout":
      out[f"{prefix}/{k}"] = float(v)
  return out


class EpisodeRollout:
  """The rollout source of :class:`AgenticTrainer`: each round of prompts becomes ``rollout.n`` multi-turn
  episodes per prompt (:class:`MultiTurnRollout`, with ARPO's branching under an ``arpo:`` section) on the
  trainer's sampler or engine, scored by the environments (a :class:`jaxrl.rl.RolloutSource`).

  Args:
    cfg: the run's config (``rollout``, ``env``, ``arpo``, ``seed``, ``data.max_prompt_tokens``).
    tokenizer: the policy's tokenizer (chat template).
    make_env: zero-argument constructor of fresh episodes.
    backend: ``step -> sampler`` holding the trainer's current parameters (``RLTrainer._sampler_for``).
  """

  def __init__(self, cfg: AgenticRLConfig, tokenizer, make_env, *, backend):
    self.cfg, self.tokenizer, self.make_env, self.backend = cfg, tokenizer, make_env, backend
    self._drivers: dict[int, MultiTurnRollout] = {}

  def driver(self, sampler) -> MultiTurnRollout:
    """The multi-turn driver over ``sampler`` (one per sampler object)."""
    key = id(sampler)
    if key not in self._drivers:
      e = self.cfg.env
      sampler.min_bucket = max(sampler.min_bucket, e.min_bucket)
      self._drivers = {key: MultiTurnRollout(sampler, self.tokenizer, self.make_env, max_turns=e.max_turns,
                                             max_turn_tokens=e.max_turn_tokens, workers=e.workers,
                                             max_prompt_tokens=self.cfg.data.max_prompt_tokens)}
    return self._drivers[key]

  def rollout(self, step: int, prompts: EncodedPrompts, stream: PromptStream) -> RolloutBatch:
    driver = self.driver(self.backend(step))
    generate = lambda idx, ids, **kw: self.generate(driver, idx, ids, prompts=prompts, **kw)
    return draw_rounds(generate, step, stream, self.cfg.rollout)

  def set_weights(self, model, *, version: int) -> None:
    """Nothing to push: the backend hands the sampler the trainer's arrays at each :meth:`rollout`."""

  def generate(self, driver: MultiTurnRollout, idx: list[int], request_ids: list[int], *, prompts: EncodedPrompts,
               max_new: int, n: int) -> tuple[Rollout, dict[str, float]]:
    """One round: ``n`` episodes of each prompt ``idx`` (environment rewards, the overlong penalty added)
    and the round's :func:`agent_metrics`."""
    r = self.cfg.rollout
    t0 = time.perf_counter()
    batch = driver.run(
        [prompts.records[i] for i in idx], n=n, max_new_tokens=max_new, request_ids=request_ids,
        options=SamplingOptions(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=self.cfg.seed,
                                stop_strings=tuple(r.stop_strings)), arpo=self.cfg.arpo)
    rollout = batch.to_rollout(self.tokenizer)
    if r.overlong_penalty is not None:
      rollout = dataclasses.replace(rollout, rewards=total_rewards(
          rollout.task_rewards, rollout.lengths, max_new=max_new, overlong_penalty=r.overlong_penalty))
    info = {"time_generate": time.perf_counter() - t0, "time_reward": 0.0, "reward_errors": 0.0}
    return rollout, {**info, **agent_metrics(batch)}

  def close(self) -> None:
    for d in self._drivers.values():
      d.close()


class AgenticTrainer(RLTrainer):
  """:class:`jaxrl.rl.RLTrainer` whose rollout source is :class:`EpisodeRollout` (module docstring)."""

  def __init__(self, cfg: AgenticRLConfig):
    if not isinstance(cfg, AgenticRLConfig):
      raise TypeError(f"AgenticTrainer needs an AgenticRLConfig, got {type(cfg).__name__}")
    self.engine_entropy = cfg.arpo is not None  # ARPO's entropy probe on the engine (rollout.engine)
    super().__init__(cfg)
    if self.procs > 1:
      raise ValueError("env: multi-turn rollouts run on one process so far (docs/agentic.md)")
    # Tool calls run in the reward pool when it has process workers (reward.runner.executor: process).
    self.source = EpisodeRollout(cfg, self.tokenizer, env_factory(cfg.env.name, runner=self.rewards, **cfg.env.kwargs),
                                 backend=self._sampler_for)

  def close(self) -> None:
    self.source.close()
    super().close()

  def evaluate(self, step: int, *, temperature: float | None = None, samples: int | None = None,
               prefix: str = "eval") -> dict[str, float]:
    """Held-out episodes (``eval:`` section): accuracy (reward > ``reward.correct_threshold``), also
    split into episodes with and without a tool call (``accuracy_with_tool`` / ``accuracy_without_tool``,
    logged when there are any), mean reward, tool-call rate and the other environment means."""
    ev = self.cfg.eval
    if self.heldout_prompts is None or not ev.prompts:
      return {}
    temp = ev.temperature if temperature is None else temperature
    k = ev.samples if samples is None else samples
    idx = list(range(min(ev.prompts, len(self.heldout_prompts))))
    batch = self.source.driver(self._sampler_for(step)).run(
        [self.heldout_prompts.records[i] for i in idx], n=k, max_new_tokens=self._eval_max_new(step),
        request_ids=idx, options=SamplingOptions(
            temperature=temp, top_p=self.cfg.rollout.top_p if temp else 1.0, seed=self.cfg.seed + 1,
            stop_strings=tuple(self.cfg.rollout.stop_strings)))
    rewards = np.asarray([t.reward for t in batch.trajectories], np.float64).reshape(len(idx), k)
    correct = rewards > self.cfg.reward.correct_threshold
    out = {f"{prefix}/reward_mean": float(rewards.mean()),
           f"{prefix}/length_mean": float(np.mean([len(t.tokens) for t in batch.trajectories]))}
    names = [f"avg@{k}"] + ([f"pass@{k}"] if k > 1 else [])
    names += [m for m in (rewards_lib.parse_metrics(ev.metrics, k) if ev.metrics else []) if m not in names]
    if any(m.startswith("maj@") for m in names):
      raise ValueError("eval.metrics: maj@k needs extracted answers, which agentic episodes do not report")
    out.update({f"{prefix}/{m}": v for m, v in rewards_lib.summarize(correct, names).items()})
    out[f"{prefix}/accuracy"] = out.pop(f"{prefix}/avg@{k}")  # avg@k: the share of correct episodes
    called = np.asarray([t.env.metrics().get("tool_calls", 0.0) > 0 for t in batch.trajectories]).reshape(correct.shape)
    for name, rows in (("with_tool", called), ("without_tool", ~called)):  # accuracy with / without a tool call
      if rows.any():
        out[f"{prefix}/accuracy_{name}"] = float(correct[rows].mean())
    out.update(agent_metrics(batch, prefix=prefix))
    return out
