"""Multi-turn rollouts on :class:`jaxrl.sampling.Sampler`: environments, tool turns, ARPO branching.

One trajectory is ``prompt | turn_1 | obs_1 | turn_2 | obs_2 | ... | turn_K`` where the turns are
sampled by the policy (``policy_mask`` 1, the sampler's log-probs) and each observation is the
environment's reply rendered with the tokenizer's chat template (``policy_mask`` 0, log-prob 0):
it is never trained on and never counted as a policy token. Each turn is one ``Sampler.generate``
call over the trajectory so far (prompt + every earlier turn and observation, a new prefill: the
sampler has no "append tokens" call); rows of all trajectories still running are batched together.
On :class:`jaxrl.sampling.Engine` (continuous batching) each turn is a request submitted as soon as
the trajectory's previous observation is ready, so trajectories advance at their own pace while
environments step in worker threads; a row waiting for its environment holds no slot and no cache
blocks (its context is prefilled again with the next turn). Both paths draw the same tokens. ARPO
runs on both: on the Sampler by probing ``k`` tokens and forking the decode state, on the Engine by
reading each turn's entropies and submitting the branches as one request (``n = Z``) whose prompt is
the shared prefix (:class:`_EngineEpisodes`).

Observation tokens are the chat template's text for the new messages after an assistant turn,
including the assistant turn's own closing text when the policy did not write it (a turn ended by a
stop string) and the next assistant header; a template that refuses the ``tool`` role falls back to
``user`` messages wrapped in ``<tool_response>...</tool_response>``.

Randomness: trajectory ``j`` of the question with request id ``q`` samples turn ``u`` with request
id :func:`turn_request_id` ``(q, j, u)``, so a trajectory's tokens do not depend on which other
trajectories share its batch; with ARPO at ``α = β = 0`` the ``N`` initial trajectories plus ``M − N``
top-ups are exactly the ``M`` trajectories of a plain rollout.

Limits per trajectory: ``max_new_tokens`` response tokens in all (policy + observation; the row is
cut and marked truncated, finish ``"length"``, at the budget), ``max_turns`` assistant turns (finish
``"turn_limit"``), ``max_turn_tokens`` per turn (a turn cut there ends the turn, not the episode);
the environment adds its own (tool calls).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.envs._arpo import ArpoConfig, branch_probability, entropy_delta, shared_prefix_ids
from jaxrl.envs._base import Env


def turn_request_id(question: int, trajectory: int, turn: int) -> int:
  """The sampler request id of turn ``turn`` of trajectory ``trajectory`` of request ``question``."""
  if not 0 <= trajectory < 4096 or not 0 <= turn < 64:
    raise ValueError(f"trajectory index must be < 4096 and turn < 64, got {trajectory}, {turn}")
  return ((int(question) * 4096 + trajectory) * 64 + turn) % (2**31)


class ObservationEncoder:
  """Token ids of environment messages appended after an assistant turn (see module docstring)."""

  _ASSISTANT = "\x01jaxrl-assistant\x01"

  def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
    self.tok = tokenizer
    self.eos_ids = frozenset(int(x) for x in eos_token_ids)
    self.base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self._ASSISTANT}]
    full = self._render(self.base, gen=False)
    cut = full.rindex(self._ASSISTANT) + len(self._ASSISTANT)
    self.full, self.close = full, full[cut:]  # e.g. "<|im_end|>\n": the text after the assistant's content
    self._cache: dict[tuple, list[int]] = {}

  def _render(self, messages, *, gen: bool) -> str:
    return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

  def _delta(self, messages: list[dict[str, Any]]) -> str:
    try:
      text = self._render(self.base + messages, gen=True)
    except Exception:  # noqa: BLE001  a template without a tool role: documented fallback
      messages = [{"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
                  if m["role"] == "tool" else m for m in messages]
      text = self._render(self.base + messages, gen=True)
    if not text.startswith(self.full):
      raise ValueError("the chat template is not prefix-stable when appending environment messages")
    return text[len(self.full):]

  def __call__(self, messages: list[dict[str, Any]], *, last_token: int | None) -> list[int]:
    """Tokens of ``messages`` (+ the next assistant header) after a turn ending in ``last_token``."""
    close = self.close
    if last_token is not None and last_token in self.eos_ids:
      eos = self.tok.decode([last_token], skip_special_tokens=False)
      if close.startswith(eos):
        close = close[len(eos):]
    text = close + self._delta([{k: v for k, v in m.items() if k in ("role", "content", "name")} for m in messages])
    return list(self.tok(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class Trajectory:
  """One episode being rolled out (host lists; see :class:`AgentBatch` for the arrays)."""

  group: int
  index: int  # trajectory id within the group (0..M-1)
  question: int  # the question's request id
  prompt: np.ndarray  # [P] int32
  env: Env
  budget: int  # most response tokens (policy + observation)
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  policy: list[float] = dataclasses.field(default_factory=list)
  turns: int = 0
  reward: float = 0.0
  done: bool = False
  finish: str = ""
  parent: int | None = None
  branch_pos: int = 0
  h_init: np.ndarray | None = None
  last_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  topup: bool = False

  def context(self) -> list[int]:
    return self.prompt.tolist() + self.tokens


@dataclasses.dataclass
class AgentBatch:
  """Finished trajectories of ``G`` groups, rows ordered by group then trajectory index."""

  trajectories: list[Trajectory]
  num_groups: int
  stats: dict[str, float]

  def arrays(self) -> dict[str, np.ndarray]:
    """``tokens``/``logprobs``/``policy_mask``/``prefix_ids`` ``[B, L]``, ``lengths``, ``group_ids``, ``rewards``."""
    ts = self.trajectories
    width = max([len(t.tokens) for t in ts] + [1])
    b = len(ts)
    tokens = np.zeros((b, width), np.int32)
    logprobs = np.zeros((b, width), np.float32)
    policy = np.zeros((b, width), np.float32)
    for i, t in enumerate(ts):
      n = len(t.tokens)
      tokens[i, :n], logprobs[i, :n], policy[i, :n] = t.tokens, t.logprobs, t.policy
    prefix = np.full((b, width), -1, np.int32)
    next_id = 0
    for g in range(self.num_groups):
      rows = [i for i, t in enumerate(ts) if t.group == g]
      pos = {ts[i].index: k for k, i in enumerate(rows)}
      ids, next_id = shared_prefix_ids([None if ts[i].parent is None else pos[ts[i].parent] for i in rows],
                                       [ts[i].branch_pos for i in rows], [len(ts[i].tokens) for i in rows],
                                       width=width, first_id=next_id)
      prefix[rows] = ids
    return {"tokens": tokens, "logprobs": logprobs, "policy_mask": policy, "prefix_ids": prefix,
            "lengths": np.asarray([len(t.tokens) for t in ts], np.int32),
            "group_ids": np.asarray([t.group for t in ts], np.int32),
            "rewards": np.asarray([t.reward for t in ts], np.float32),
            "truncated": np.asarray([t.finish == "length" for t in ts])}

  def to_rollout(self, tokenizer=None):
    """A :class:`jaxrl.rl.Rollout` (``policy_mask`` and ``prefix_ids`` set) for the RL trainer."""
    from jaxrl.rl import Rollout  # lazy: jaxrl.rl pulls in JAX; reward-pool workers import envs without it
    a = self.arrays()
    texts = tuple(tokenizer.decode(t.tokens, skip_special_tokens=True) if tokenizer is not None else ""
                  for t in self.trajectories)
    return Rollout(prompt_ids=tuple(t.prompt for t in self.trajectories), tokens=a["tokens"], logprobs=a["logprobs"],
                   lengths=a["lengths"], truncated=a["truncated"], group_ids=a["group_ids"], rewards=a["rewards"],
                   task_rewards=a["rewards"].copy(), texts=texts, policy_mask=a["policy_mask"],
                   prefix_ids=a["prefix_ids"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingOptions:
  """Per-call sampler options of a multi-turn rollout."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_strings: tuple[str, ...] = ()


class MultiTurnRollout:
  """Rolls out environment episodes with a :class:`jaxrl.sampling.Sampler` (module docstring).

  Args:
    sampler: a :class:`jaxrl.sampling.Sampler` (turn-synchronous batches) or a
      :class:`jaxrl.sampling.Engine` (continuous batching: each trajectory's next turn is submitted
      as soon as its observation is ready; ARPO needs one built with ``entropy=True``); its
      ``max_len`` bounds prompt + response.
    tokenizer: the policy's tokenizer (chat template).
    make_env: zero-argument constructor of fresh episodes (:func:`jaxrl.envs.env_factory`).
    max_turns: assistant turns per trajectory.
    max_turn_tokens: tokens per assistant turn (default: the remaining budget).
    max_prompt_tokens: an episode's rendered prompt must fit (the trainer's packed rows are sized by it).
    workers: threads stepping environments concurrently (tool calls inside run on the env's own pool).
  """

  def __init__(self, sampler, tokenizer, make_env: Callable[[], Env], *, max_turns: int = 8,
               max_turn_tokens: int | None = None, max_prompt_tokens: int | None = None, workers: int = 8):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.sampler, self.tok, self.make_env = sampler, tokenizer, make_env
    self.max_turns, self.max_turn_tokens = int(max_turns), max_turn_tokens
    self.max_prompt_tokens = max_prompt_tokens
    self.encode_obs = ObservationEncoder(tokenizer, sampler.eos_token_ids)
    from jaxrl.sampling import Engine  # lazy: jaxrl.sampling pulls in JAX; reward-pool workers import envs without it
    self._engine = isinstance(sampler, Engine)
    self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-env")

  def close(self) -> None:
    self._pool.shutdown(wait=False)

  # ------------------------------------------------------------------------------------------------

  def _start(self, record: dict[str, Any], *, group: int, index: int, question: int, max_new: int) -> Trajectory:
    env = self.make_env()
    messages = env.reset(record)
    text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], np.int32)
    if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
      raise ValueError(f"an episode prompt has {len(prompt)} tokens > data.max_prompt_tokens="
                       f"{self.max_prompt_tokens} (system prompt + question); raise data.max_prompt_tokens")
    budget = min(max_new, self.sampler.max_len - len(prompt))
    if budget < 1:
      raise ValueError(f"an episode prompt has {len(prompt)} tokens, no room under the sampler's max_len="
                       f"{self.sampler.max_len}")
    return Trajectory(group=group, index=index, question=question, prompt=prompt, env=env, budget=budget)

  def run(self, records: Sequence[dict[str, Any]], *, n: int, max_new_tokens: int, request_ids: Sequence[int],
          options: SamplingOptions = SamplingOptions(), arpo: ArpoConfig | None = None) -> AgentBatch:
    """``n`` (= ARPO's ``M``) trajectories for each record; returns them with statistics.

    Args:
      records: prompt records (``env.reset`` input), one group each.
      n: trajectories per record.
      max_new_tokens: response budget per trajectory (policy + observation tokens).
      request_ids: one per record (the questions' sampler request ids).
      options: sampling options.
      arpo: entropy-based adaptive branching (``None``: ``n`` trajectory-level samples).
    """
    t0 = time.perf_counter()
    if arpo is not None and not 1 <= arpo.initial_samples <= n:
      raise ValueError(f"arpo.initial_samples={arpo.initial_samples} must be in [1, rollout.n={n}]")
    if arpo is not None and self._engine and not self.sampler.entropy:
      raise ValueError("arpo: ARPO's entropy probe on jaxrl.sampling.Engine needs an engine built with entropy=True")
    first = n if arpo is None else arpo.initial_samples
    trajs = [self._start(rec, group=g, index=j, question=int(q), max_new=max_new_tokens)
             for g, (rec, q) in enumerate(zip(records, request_ids)) for j in range(first)]
    self.stats = {"branch_events": 0.0, "branch_paths": 0.0, "probes": 0.0, "topups": 0.0, "generate_calls": 0.0}
    budget = {g: (0 if arpo is None else n - first) for g in range(len(records))}

    def top_up(g: int) -> list[Trajectory]:
      """Trajectory-level samples filling group ``g`` up to exactly ``M`` (its paths have all ended)."""
      have = sum(t.group == g for t in trajs)
      extra = [self._start(records[g], group=g, index=j, question=int(request_ids[g]), max_new=max_new_tokens)
               for j in range(have, n)]
      for t in extra:
        t.topup = True
      self.stats["topups"] += len(extra)
      return extra

    if self._engine:  # top-ups start per group, as soon as the group's last path ends
      _EngineEpisodes(self, trajs, options, arpo, budget, top_up if arpo is not None else None).run()
    else:
      self._advance(trajs, options, arpo, budget)
      if arpo is not None:  # top up every group to exactly M with trajectory-level samples
        extra = [t for g in range(len(records)) for t in top_up(g)]
        self._advance(extra, options, None, budget)
        trajs += extra
    trajs.sort(key=lambda t: (t.group, t.index))
    counts = np.bincount([t.group for t in trajs], minlength=len(records))
    if (counts != n).any():
      raise AssertionError(f"rollout produced {counts.tolist()} trajectories per group, expected {n}")
    stats = dict(self.stats, time_rollout=time.perf_counter() - t0)
    return AgentBatch(trajs, len(records), stats)

  # ------------------------------------------------------------------------------------------------

  def _generate(self, rows: list[Trajectory], options: SamplingOptions, **kw):
    self.stats["generate_calls"] += 1
    room = max(t.budget - len(t.tokens) for t in rows)
    max_new = room if self.max_turn_tokens is None else min(room, self.max_turn_tokens)
    return self.sampler.generate(
        [t.context() for t in rows], n=1, max_new_tokens=max_new, temperature=options.temperature,
        top_p=options.top_p, top_k=options.top_k, seed=options.seed, stop_strings=options.stop_strings,
        request_ids=[turn_request_id(t.question, t.index, t.turns) for t in rows], **kw)

  def _advance(self, trajs: list[Trajectory], options: SamplingOptions, arpo: ArpoConfig | None,
               budget: dict[int, int]) -> None:
    """Runs every trajectory in ``trajs`` (and the branches it spawns, appended) to the end."""
    while True:
      active = [t for t in trajs if not t.done]
      if not active:
        return
      probe = [t for t in active if arpo is not None and t.turns > 0 and budget[t.group] > 0]
      plain = [t for t in active if not (arpo is not None and t.turns > 0 and budget[t.group] > 0)]
      finished: list[tuple[Trajectory, list[int], list[float], str]] = []
      if plain:
        want_h = arpo is not None and any(t.turns == 0 for t in plain)
        out = self._generate(plain, options, return_entropy=want_h)
        for i, t in enumerate(plain):
          n = int(out.lengths[i])
          if want_h and t.turns == 0:
            t.h_init = np.asarray(out.entropy[i, :min(n, arpo.entropy_tokens)], np.float32)
          finished.append((t, out.tokens[i, :n].tolist(), out.logprobs[i, :n].tolist(), out.finish_reason[i]))
      if probe:
        finished += self._probe_and_branch(probe, trajs, options, arpo, budget)
      self._apply(finished)

  def _probe_and_branch(self, rows, trajs, options, arpo: ArpoConfig, budget):
    """Generates ``k`` tokens of each row, branches rows with ``P_t > τ`` (fork), finishes the turns."""
    self.stats["probes"] += len(rows)
    out = self._generate(rows, options, max_steps=arpo.entropy_tokens, return_state=True, return_entropy=True)
    state = out.state
    vocab = self.sampler.cfg.vocab_size
    forks = []
    for i, t in enumerate(rows):
      n = int(out.lengths[i])
      if state.finished[i] or budget[t.group] <= 0:  # a finished row cannot branch
        continue
      h = np.asarray(out.entropy[i, :min(n, arpo.entropy_tokens)])
      p = branch_probability(entropy_delta(h, t.h_init if t.h_init is not None else h, vocab_size=vocab,
                                           normalize=arpo.normalize), alpha=arpo.alpha, beta=arpo.beta)
      if p > arpo.threshold:
        z = min(arpo.branches, budget[t.group])
        budget[t.group] -= z
        forks.append((t, n, self.sampler.fork(state, [i], z)))
        self.stats["branch_events"] += 1
        self.stats["branch_paths"] += z
    results = []
    full = self.sampler.resume(state, return_state=False)
    for i, t in enumerate(rows):
      n = int(full.lengths[i])
      results.append((t, full.tokens[i, :n].tolist(), full.logprobs[i, :n].tolist(), full.finish_reason[i]))
    for parent, shared, child_state in forks:
      cout = self.sampler.resume(child_state, return_state=False)
      have = sum(x.group == parent.group for x in trajs)
      for c in range(child_state.num_rows):
        child = dataclasses.replace(
            parent, index=have + c, env=parent.env.fork(), tokens=list(parent.tokens), logprobs=list(parent.logprobs),
            policy=list(parent.policy), parent=parent.index, branch_pos=len(parent.tokens) + shared,
            last_info={}, topup=False)
        trajs.append(child)
        n = int(cout.lengths[c])
        results.append((child, cout.tokens[c, :n].tolist(), cout.logprobs[c, :n].tolist(), cout.finish_reason[c]))
    return results

  def _append_turn(self, t: Trajectory, toks: list[int], lps: list[float], reason: str) -> tuple[list[int], str]:
    """Appends a sampled turn (cut to the trajectory's budget); returns its tokens and its text for the env."""
    room = t.budget - len(t.tokens)
    if len(toks) > room:  # the sampler's own cap can exceed the trajectory's remaining budget
      toks, lps, reason = toks[:room], lps[:room], "length"
    # A turn cut by max_turn_tokens ("length" with budget left) ends the turn, not the episode.
    t.tokens += toks
    t.logprobs += lps
    t.policy += [1.0] * len(toks)
    t.turns += 1
    t.finish = reason
    eos = self.sampler.eos_token_ids
    body = toks[:-1] if toks and toks[-1] in eos else toks
    return toks, self.tok.decode(body, skip_special_tokens=False)

  def _observe(self, t: Trajectory, toks: list[int], result) -> None:
    """Takes the environment's answer to a turn: ends the trajectory or appends the observation."""
    obs, reward, done, info = result
    reason = t.finish
    t.reward += float(reward)
    t.last_info = dict(info)
    full = len(t.tokens) >= t.budget
    if done or obs is None or full or t.turns >= self.max_turns:
      t.done = True
      if not done:  # cut short: budget spent, turn limit, or an environment that gave nothing back
        t.finish = "length" if full else "turn_limit" if t.turns >= self.max_turns else "env"
      return
    t.finish = reason
    ids = self.encode_obs(obs, last_token=toks[-1] if toks else None)
    room = t.budget - len(t.tokens)
    if len(ids) >= room:  # no room left for another turn: the row ends (truncated) inside the observation
      ids, t.done, t.finish = ids[:room], True, "length"
    t.tokens += ids
    t.logprobs += [0.0] * len(ids)
    t.policy += [0.0] * len(ids)

  def _apply(self, finished: list[tuple[Trajectory, list[int], list[float], str]]) -> None:
    """Appends each turn, steps the environments concurrently, appends their observations."""
    turns = [(f[0], *self._append_turn(*f)) for f in finished]
    steps = list(self._pool.map(lambda a: a[0].env.step(a[2]), turns))
    for (t, toks, _), res in zip(turns, steps):
      self._observe(t, toks, res)


def _step_env(t: Trajectory, toks: list[int], text: str):
  """Steps ``t``'s environment with its turn's text (in a worker thread)."""
  return t, toks, t.env.step(text)


class _EngineEpisodes:
  """Runs every trajectory to the end on the engine, each at its own pace (:meth:`MultiTurnRollout.run` with
  a :class:`jaxrl.sampling.Engine`).

  Every turn is a request whose prompt is the trajectory so far. When a turn finishes, the row
  leaves its slot and its cache blocks go back to the pool; the environment steps in the worker
  threads while the engine keeps decoding the other rows; the next turn is submitted as soon as the
  observation is appended, and its context is prefilled again (the engine keeps no cache of a
  finished request). Draws depend only on ``(seed, turn_request_id, token index)``, so the
  trajectories are those of the turn-synchronous :class:`Sampler` path.

  ARPO (``arpo`` set) through the engine's public API: every turn asks for the per-token entropy.
  The first ``k`` entropies of a trajectory's first turn are ``H_initial``; when a turn after a
  tool observation ends with more than ``k`` tokens (the row was still running after its ``k``
  probe tokens) and the group has branch budget left, ``P_t`` from its first ``k`` entropies
  decides the branch. The ``Z`` branches are one request with ``n = Z`` whose prompt is the
  trajectory so far plus those ``k`` probe tokens (the engine prefills the shared prefix once and
  shares its blocks among the samples); each branch's turn is the probe tokens (the parent's
  tokens and log-probs) followed by its own continuation, so the prefix is shared token for token.
  The parent's turn is the one it would have drawn without ARPO. ``top_up(g)`` is called once
  every path of group ``g`` has ended, and its trajectory-level samples are submitted at once.
  Differences from the :class:`Sampler` path (which forks the decode state after the probe): the
  branches start when the parent's turn ends rather than after its ``k`` probe tokens, and a stop
  string spanning the probe/continuation boundary of a branch is not seen (stop tokens are).
  """

  def __init__(self, rollout: MultiTurnRollout, trajs: list[Trajectory], options: SamplingOptions,
               arpo: ArpoConfig | None = None, budget: dict[int, int] | None = None,
               top_up: Callable[[int], list[Trajectory]] | None = None):
    # jaxrl.sampling pulls in JAX: reward-pool workers that only unpickle tool calls import this module without it.
    from jaxrl.sampling import Request  # lazy: jaxrl.sampling pulls in JAX; reward-pool workers import envs without it
    self.make_request = Request
    self.rollout, self.eng = rollout, rollout.sampler
    self.trajs, self.options, self.arpo, self.budget, self.top_up = trajs, options, arpo, budget, top_up
    self.k = 0 if arpo is None else arpo.entropy_tokens
    self.inflight: dict[tuple[int, int], tuple[Trajectory, list[int], list[float]]] = {}  # (rid, sample) -> row, probe
    self.stepping: set[cf.Future] = set()
    self.topped: set[int] = set()

  def run(self) -> None:
    """Submits every live trajectory's turn, then decodes, steps environments and submits the next turns
    until every trajectory (and every branch and top-up) has ended."""
    if not self.eng.idle:
      raise RuntimeError("MultiTurnRollout: the engine must be idle when a rollout starts")
    self.eng.set_stops((), self.options.stop_strings)
    self.submit([self.turn(t) for t in self.trajs if not t.done])
    while self.inflight or self.stepping:
      if self.inflight:
        self.eng.step()
      self.finish_turns()
      if not self.stepping:
        continue
      if self.inflight and not self.eng.idle:
        ready = {f for f in self.stepping if f.done()}
      else:  # nothing to decode: wait for an environment
        ready, _ = cf.wait(self.stepping, return_when=cf.FIRST_COMPLETED)
      self.stepping -= ready
      self.observe(ready)

  def turn_max(self, t: Trajectory) -> int:
    room = t.budget - len(t.tokens)
    mt = self.rollout.max_turn_tokens
    return room if mt is None else min(room, mt)

  def request(self, t: Trajectory, rid: int, rows: list[Trajectory], probe: list[int], probe_lp: list[float]):
    """The request of ``rows`` (``t`` or its branches) continuing ``t``'s context after ``probe`` tokens."""
    for s, row in enumerate(rows):
      if (rid, s) in self.inflight:
        raise ValueError(f"request id {rid} of two trajectories at once: request_ids must be distinct")
      self.inflight[(rid, s)] = (row, probe, probe_lp)
    o = self.options
    want_h = self.arpo is not None and not probe and not t.topup
    return self.make_request(prompt=t.context() + probe, n=len(rows), temperature=o.temperature, top_p=o.top_p,
                             top_k=o.top_k, seed=o.seed, request_id=rid,
                             max_new_tokens=self.turn_max(t) - len(probe), entropy=want_h)

  def turn(self, t: Trajectory):
    """The request of ``t``'s next turn."""
    return self.request(t, turn_request_id(t.question, t.index, t.turns), [t], [], [])

  def submit(self, reqs: list) -> None:
    if reqs:
      self.rollout.stats["generate_calls"] += 1
      self.eng.submit(reqs)

  def branch(self, t: Trajectory, c):
    """ARPO's decision after a tool call (class docstring); the branches' request, or None."""
    arpo, k, stats = self.arpo, self.k, self.rollout.stats
    stats["probes"] += 1
    if len(c.tokens) <= k:  # the row ended within its probe tokens: it cannot branch
      return None
    h = np.asarray(c.entropy[:k], np.float32)
    p = branch_probability(entropy_delta(h, t.h_init if t.h_init is not None else h,
                                         vocab_size=self.eng.cfg.vocab_size, normalize=arpo.normalize),
                           alpha=arpo.alpha, beta=arpo.beta)
    if not p > arpo.threshold:
      return None
    z = min(arpo.branches, self.budget[t.group])
    self.budget[t.group] -= z
    stats["branch_events"] += 1
    stats["branch_paths"] += z
    have = sum(x.group == t.group for x in self.trajs)
    kids = [dataclasses.replace(t, index=have + j, env=t.env.fork(), tokens=list(t.tokens), logprobs=list(t.logprobs),
                                policy=list(t.policy), parent=t.index, branch_pos=len(t.tokens) + k, last_info={},
                                topup=False) for j in range(z)]
    self.trajs.extend(kids)
    return self.request(t, turn_request_id(t.question, kids[0].index, t.turns), kids, c.tokens[:k].tolist(),
                        c.logprobs[:k].tolist())

  def finish_turns(self) -> None:
    """Appends every finished turn (ARPO: notes ``H_initial`` or branches first) and steps its environment."""
    branches = []
    for c in self.eng.pop_finished():
      t, probe, probe_lp = self.inflight.pop((int(c.request_id), int(c.sample)))
      if self.arpo is not None and not probe and not t.topup:
        if t.turns == 0:
          t.h_init = np.asarray(c.entropy[:self.k], np.float32)
        elif self.budget[t.group] > 0:  # a turn after a tool observation; the env forks before it steps
          r = self.branch(t, c)
          if r is not None:
            branches.append(r)
      toks, text = self.rollout._append_turn(t, probe + c.tokens.tolist(), probe_lp + c.logprobs.tolist(),
                                             c.finish_reason)
      self.stepping.add(self.rollout._pool.submit(_step_env, t, toks, text))
    self.submit(branches)

  def observe(self, ready: set[cf.Future]) -> None:
    """Appends the observations of the stepped environments and submits the next turns (and a group's top-ups
    once every path of it has ended)."""
    cont = []
    for f in ready:
      t, toks, result = f.result()
      self.rollout._observe(t, toks, result)
      if not t.done:
        cont.append(t)
      elif self.top_up is not None and t.group not in self.topped and \
          all(x.done for x in self.trajs if x.group == t.group):
        self.topped.add(t.group)  # no live path is left to branch: fill the group up to M now
        extra = self.top_up(t.group)
        self.trajs.extend(extra)
        cont += extra
    self.submit([self.turn(t) for t in sorted(cont, key=lambda x: (x.group, x.index))])
