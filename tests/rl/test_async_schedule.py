"""Asynchronous RL bookkeeping with a scripted engine (no JAX): AReaL's staleness bound (eq. 3) on every
token, each sample used exactly once across interrupts / reward failures / many buffer refills, one-off
pipelining, and the batch assembly that carries per-token versions and behaviour log-probs.

Interrupt correctness of the real engine (a row decoded under versions v and v+1 carries both, with the
log-probs each version assigns) is tests/sampling/test_engine.py::
test_interrupted_rows_carry_both_versions_and_their_logprobs.
"""

import collections
import dataclasses
import random

import numpy as np
import pytest

from jaxrl.rl._async_rollout import (
    AsyncSchedule,
    Group,
    RolloutWorker,
    StalenessError,
    groups_to_rollout,
    staleness_metrics,
)
from jaxrl.rl._rollout import sequence_fields


@dataclasses.dataclass
class FakeCompletion:
  request_id: int
  sample: int
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str = "eos"


@dataclasses.dataclass
class FakeRequest:
  request_id: int
  n: int


class ScriptedEngine:
  """Rows of random (long-tailed) length; each round decodes 1-3 tokens per running row at the current
  version; ``update_weights`` interrupts (rows continue, later tokens record the new version) or lets
  running rows finish first."""

  def __init__(self, rng: random.Random, slots: int = 6):
    self.rng, self.slots, self.version = rng, slots, 0
    self.waiting: collections.deque = collections.deque()
    self.running: list[dict] = []
    self._finished: collections.deque = collections.deque()
    self.interrupted_rows = 0

  @property
  def idle(self):
    return not self.waiting and not self.running

  def submit(self, requests):
    for r in requests:
      for s in range(r.n):
        length = 1 + int(self.rng.paretovariate(1.2) * 3) % 40  # long-tailed lengths
        self.waiting.append({"rid": r.request_id, "s": s, "len": length, "versions": []})

  def _round(self):
    for row in self.running:
      for _ in range(self.rng.randint(1, 3)):
        if len(row["versions"]) < row["len"]:
          row["versions"].append(self.version)
    for row in [r for r in self.running if len(r["versions"]) == r["len"]]:
      self.running.remove(row)
      v = np.asarray(row["versions"], np.int32)
      self._finished.append(FakeCompletion(row["rid"], row["s"], np.arange(len(v), dtype=np.int32) % 7 + 3,
                                           -0.1 * (v + 1).astype(np.float32), v))

  def pop_finished(self):
    out = list(self._finished)
    self._finished.clear()
    return out

  def step(self):
    while self.waiting and len(self.running) < self.slots:
      self.running.append(self.waiting.popleft())
    self._round()

  def update_weights(self, model, version, *, mode):
    assert model == f"weights-{version}"
    if mode == "finish":
      while self.running:
        self._round()
    self.interrupted_rows += len(self.running)
    self.version = version


class SlowFuture:
  """A reward that is done after a random number of polls, sometimes with failed samples; with
  ``flat`` > 0 that share of groups gets all-equal rewards (what dynamic sampling filters)."""

  def __init__(self, rng, n, flat=0.0):
    self.left = rng.randint(0, 8)
    if rng.random() < flat:
      rewards = np.full(n, float(rng.randint(0, 1)), np.float32)
    else:
      rewards = np.asarray([rng.random() for _ in range(n)], np.float32)
    self.value = (rewards, int(rng.random() < 0.2))

  def done(self):
    self.left -= 1
    return self.left < 0

  def result(self):
    return self.value


def simulate(*, eta: int, B: int = 3, n: int = 2, steps: int = 25, one_off: bool = False, interrupt: bool = True,
             seed: int = 0, start: int = 0, flat: float = 0.0, max_rounds: int | None = None, full: bool = False):
  """Runs the real RolloutWorker + AsyncSchedule against the scripted engine with a trainer that takes
  batches at random moments; returns (batches, per-batch staleness arrays, engine, max buffer fill).
  ``max_rounds``: dynamic sampling (groups with all-equal rewards are filtered); ``full``: the
  batches are :class:`Batch` objects (else their trained groups)."""
  rng = random.Random(seed)
  keep = (lambda g: bool(g.rewards.max() > g.rewards.min())) if max_rounds else None
  sched = AsyncSchedule(B, eta, steps, start=start, informative=keep, max_rounds=max_rounds or 1)
  engine = ScriptedEngine(rng)
  engine.version = start
  rid = iter(range(10**6))
  worker = RolloutWorker(engine, sched, make_request=lambda i: (i % 5, FakeRequest(next(rid), n)),
                         score=lambda g: SlowFuture(rng, g.n, flat), one_off=one_off, interrupt=interrupt)
  batches, stale, max_fill = [], [], 0
  j = start
  for _ in range(100000):
    if j == steps:
      break
    worker.poll()
    max_fill = max(max_fill, sched.held())
    if sched.ready(j) and rng.random() < 0.3:  # the trainer is busy a random while
      batch = sched.take(j)
      assert batch.index == j
      batches.append(batch if full else batch.groups)
      stale.append(np.concatenate([j - g.token_versions() for g in batch.groups] or [np.zeros(0, np.int64)]))
      j += 1
      worker.offer_weights(f"weights-{j}", j)
  assert j == steps, "the run stalled"
  return batches, stale, engine, max_fill


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_token_older_than_eta_and_each_sample_used_once(eta):
  B, n, steps = 3, 2, 25
  batches, stale, engine, max_fill = simulate(eta=eta, B=B, n=n, steps=steps, seed=eta)
  for j, s in enumerate(stale):
    assert s.min() >= 0 and s.max() <= eta, (j, s.max())
  if eta == 0:  # the synchronous schedule: batch j is generated entirely by version j
    assert all((s == 0).all() for s in stale)
  else:  # really asynchronous: stale tokens and interrupted (mixed-version) rows happen
    assert max(s.max() for s in stale) >= 1 and engine.interrupted_rows > 0
    assert any(len(np.unique(c.versions)) > 1 for b in batches for g in b for c in g.completions.values())
  # each admitted group exactly once, in admission order; each of its n samples exactly once
  assert [g.index for b in batches for g in b] == list(range(steps * B))
  samples = [(g.index, s) for b in batches for g in b for s in g.completions]
  assert len(samples) == len(set(samples)) == steps * B * n
  assert sum(g.errors for b in batches for g in b) > 0  # reward failures happened and lost nothing
  assert max_fill <= (eta + 1) * B  # the bounded buffer (admitted, not yet trained)


def test_finish_mode_and_one_off_pipelining():
  _, stale, engine, _ = simulate(eta=2, interrupt=False, seed=5)
  assert max(s.max() for s in stale) <= 2 and engine.interrupted_rows == 0
  batches, stale, engine, _ = simulate(eta=1, one_off=True, seed=6)
  assert engine.interrupted_rows == 0
  assert all(len(np.unique(c.versions)) == 1 for b in batches for g in b for c in g.completions.values())
  # one step ahead: staleness 1 (0 when the engine idled until the newer weights came)
  worst = [int(s.max()) for s in stale]
  assert max(worst) == 1 and sum(worst) > len(worst) // 2


def test_eq3_admission_and_take_checks():
  sched = AsyncSchedule(2, 1, 50)
  assert [sched.admit() for _ in range(4)] == [0, 1, 2, 3]  # batches 0 and 1 at version 0 (η = 1)
  assert not sched.can_admit()
  with pytest.raises(StalenessError, match="eq. 3"):
    sched.admit()
  sched.set_version(1)
  assert sched.can_admit()
  old = lambda i, v: Group(index=i, prompt=0, request_id=i, version=0, n=1,
                           completions={0: FakeCompletion(i, 0, np.zeros(2, np.int32), np.zeros(2, np.float32),
                                                          np.asarray(v, np.int32))}, rewards=np.zeros(1))
  sched.put(old(0, [0, 0]))
  with pytest.raises(RuntimeError, match="already buffered"):
    sched.put(old(0, [0, 0]))
  sched.put(old(1, [0, 0]))
  assert sched.take(0).groups[0].index == 0
  with pytest.raises(RuntimeError, match="not ready"):
    sched.take(0)
  # a token of version 0 in batch 3 would be 3 > η = 1 versions old
  sched.taken = sched.closed = sched.unassigned = sched._open.index = 3
  sched.admitted, sched.consumed, sched.version = 8, 6, 3
  sched.put(old(6, [0, 3]))
  sched.put(old(7, [3]))
  with pytest.raises(StalenessError, match="staleness 3"):
    sched.take(3)


def test_resume_restarts_the_schedule_at_the_checkpointed_batch():
  """Resuming from the checkpoint of step s: version s, groups s·B … admitted afresh (nothing in flight is
  restored), each once, still within η."""
  B, eta, start, steps = 3, 2, 4, 12
  batches, stale, _, max_fill = simulate(eta=eta, B=B, steps=steps, start=start, seed=7)
  assert [g.index for b in batches for g in b] == list(range(start * B, steps * B))
  assert min(g.version for b in batches for g in b) == start
  assert all(s.max() <= eta for s in stale) and max(s.max() for s in stale) >= 1
  assert max_fill <= (eta + 1) * B


class _Tok:
  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


def test_batch_carries_per_token_versions_and_behaviour_logprobs():
  """Rows decoded under versions 4 and 5 keep, token by token, the log-probs the engine reported; they
  reach the loss as ``sampler_logprobs`` (π_behav of decoupled PPO) at the right positions."""
  comp = lambda rid, s, v, lp: FakeCompletion(rid, s, np.asarray([5, 6, 7][:len(v)], np.int32),
                                              np.asarray(lp, np.float32), np.asarray(v, np.int32))
  g0 = Group(index=0, prompt=1, request_id=10, version=4, n=2, rewards=np.asarray([1.0, 0.0]),
             completions={1: comp(10, 1, [5], [-0.5]), 0: comp(10, 0, [4, 4, 5], [-0.1, -0.2, -0.3])})
  g1 = Group(index=1, prompt=0, request_id=11, version=5, n=2, rewards=np.asarray([0.5, 0.5]),
             completions={0: comp(11, 0, [5, 5], [-1.0, -2.0]), 1: comp(11, 1, [5], [-3.0])})
  prompts = [np.asarray([1, 2], np.int32), np.asarray([3, 4, 9], np.int32)]
  ro, versions = groups_to_rollout([g0, g1], prompts, max_new=4, tokenizer=_Tok())
  assert ro.group_ids.tolist() == [0, 0, 1, 1] and ro.lengths.tolist() == [3, 1, 2, 1]
  assert versions.tolist() == [[4, 4, 5, -1], [5, -1, -1, -1], [5, 5, -1, -1], [5, -1, -1, -1]]
  np.testing.assert_array_equal(ro.logprobs[0], np.float32([-0.1, -0.2, -0.3, 0.0]))
  assert ro.rewards.tolist() == [1.0, 0.0, 0.5, 0.5] and ro.texts[0] == "5 6 7"
  seq = sequence_fields(ro, np.ones_like(ro.logprobs), ro.response_mask())[0]
  # a prompt of 3 tokens: response token k is the target at t = 2 + k
  np.testing.assert_array_equal(seq["sampler_logprobs"][2:5], np.float32([-0.1, -0.2, -0.3]))
  m = staleness_metrics(versions, ro.lengths, 6, 2)
  assert m["async/staleness/1"] == pytest.approx(5 / 7) and m["async/staleness/2"] == pytest.approx(2 / 7)
  assert m["async/versions_per_traj_max"] == 2.0 and m["async/staleness_max"] == 2.0


@pytest.mark.parametrize("eta", [0, 2])
def test_dynamic_sampling_filters_counts_and_stays_within_eta(eta):
  """DAPO dynamic sampling under the staleness bound: groups with all-equal rewards are counted and never
  trained, a batch waits for B informative groups (or ends after max_rounds rounds), every drawn group
  belongs to exactly one batch, no sample is trained twice, and no token is older than η."""
  B, n, steps, max_rounds = 3, 2, 30, 3
  batches, stale, _, max_fill = simulate(eta=eta, B=B, n=n, steps=steps, seed=11 + eta, flat=0.5,
                                         max_rounds=max_rounds, full=True)
  assert all(s.size == 0 or s.max() <= eta for s in stale)
  if eta == 0:
    assert all((s == 0).all() for s in stale)
  else:
    assert max(s.max() for s in stale if s.size) >= 1
  drawn = [g.index for b in batches for g in b.drawn]
  assert drawn == list(range(len(drawn)))  # whole rounds, in admission order, each drawn group in one batch
  trained = [(g.index, s) for b in batches for g in b.groups for s in g.completions]
  assert len(trained) == len(set(trained))  # no sample trained twice
  flat_groups = 0
  for b in batches:
    assert len(b.drawn) == b.rounds * B and b.rounds <= max_rounds
    zero_var = [g for g in b.drawn if np.var(g.rewards) == 0]  # an independent zero-variance count
    assert b.filtered == len(zero_var) and not {id(g) for g in zero_var} & {id(g) for g in b.groups}
    assert len(b.groups) + b.filtered + b.surplus == len(b.drawn)
    assert len(b.groups) == B or b.rounds == max_rounds  # full, or out of rounds
    assert b.surplus == 0 or len(b.groups) == B
    kept = [g.index for g in b.drawn if np.var(g.rewards) > 0][:B]  # the first informative groups
    assert [g.index for g in b.groups] == kept
    flat_groups += b.filtered
  assert flat_groups > 0 and sum(b.rounds > 1 for b in batches) > 0 and sum(b.surplus for b in batches) > 0
  assert max_fill <= (eta + 1) * B + B - 1  # + the open batch's informative groups waiting for more
