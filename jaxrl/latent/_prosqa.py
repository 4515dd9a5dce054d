"""A ProsQA-style task generated locally: graph reachability over a random DAG of made-up concepts.

ProsQA (Hao et al. 2024, Coconut §4.1 and appendix A) states a directed acyclic graph of concepts as
``Every X is a Y.`` sentences, says which concept an entity belongs to, and asks which of two concepts
it also belongs to; exactly one is reachable. The worked chain is a proof path, one hop a step::

    question: Every fep is a dar. Every dar is a lom. Every kiv is a dar. ... Tom is a fep.
              Is Tom a lom or a kiv?
    steps:    Tom is a dar; Tom is a lom
    answer:   lom

Construction (per example, from ``numpy.random.default_rng([seed, index])``, so an example does not
depend on how many are drawn): the concepts are split into a *reachable* side (the proof path from
the entity's concept to the answer, plus dead-end branches off it) and an *unreachable* side (holding
the distractor). Edges go forward in a random topological order and never from the reachable side
to the unreachable one (unreachable → reachable edges are allowed and add misleading in-links), so the
distractor is unreachable by construction; :func:`reachable` checks it by breadth-first search.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from jaxrl.latent._data import Chain

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_ENTITIES = ("Tom", "Ann", "Sam", "Eva", "Max", "Zoe", "Bob", "Ida")
_FACT = re.compile(r"Every (\w+) is a (\w+)\.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProsQAConfig:
  """Config section ``data.prosqa``: sizes of the generated graph-reachability task."""

  n_train: int = 4000
  "Training examples."
  n_heldout: int = 128
  "Held-out examples (a disjoint index range of the same generator)."
  concepts: int = 8
  "Concepts per graph (nodes)."
  min_hops: int = 1
  "Fewest proof steps."
  max_hops: int = 3
  "Most proof steps (the curriculum's useful max_stage)."
  extra_edges: int = 4
  "Distracting edges added beyond the proof path."
  name_length: int = 3
  """Letters per concept name, consonant-vowel alternating (3: ``fep``). 1 makes every concept a single
  consonant, so with a character tokenizer each option and the answer is one token."""
  seed: int = 0

  def __post_init__(self):
    if not 1 <= self.min_hops <= self.max_hops:
      raise ValueError(f"data.prosqa: need 1 <= min_hops <= max_hops, got {self.min_hops}, {self.max_hops}")
    if self.concepts < self.max_hops + 3:
      raise ValueError(f"data.prosqa.concepts={self.concepts} must be at least max_hops + 3 = {self.max_hops + 3} "
                       "(the path, a dead end and the distractor)")
    if self.name_length < 1 or self.concepts > _name_count(self.name_length):
      raise ValueError(f"data.prosqa: name_length={self.name_length} must be >= 1 and allow {self.concepts} "
                       f"distinct concept names (it allows {_name_count(max(self.name_length, 1))})")
    if self.n_train < 1 or self.n_heldout < 0 or self.extra_edges < 0:
      raise ValueError(f"data.prosqa: n_train >= 1, n_heldout >= 0, extra_edges >= 0; got {self.n_train}, "
                       f"{self.n_heldout}, {self.extra_edges}")


def _name_count(length: int) -> int:
  """Distinct consonant-vowel alternating names of ``length`` letters."""
  return len(_CONSONANTS) ** ((length + 1) // 2) * len(_VOWELS) ** (length // 2)


def _names(rng: np.random.Generator, n: int, length: int = 3) -> list[str]:
  names: list[str] = []
  while len(names) < n:
    w = "".join(rng.choice(list(_VOWELS if i % 2 else _CONSONANTS)) for i in range(length))
    if w not in names:
      names.append(str(w))
  return names


def prosqa_chain(cfg: ProsQAConfig, index: int) -> Chain:
  """Example ``index`` of the task (deterministic in ``cfg.seed`` and ``index``)."""
  rng = np.random.default_rng([cfg.seed, index])
  hops = int(rng.integers(cfg.min_hops, cfg.max_hops + 1))
  names = _names(rng, cfg.concepts, cfg.name_length)
  order = rng.permutation(cfg.concepts)  # a random topological order: edges go from earlier to later
  rank = {int(v): i for i, v in enumerate(order)}
  # Reachable side: the path (hops + 1 concepts, in topological order) and at least one dead end.
  n_reach = int(rng.integers(hops + 2, cfg.concepts)) if cfg.concepts > hops + 2 else hops + 2
  reach = [int(v) for v in rng.choice(cfg.concepts, n_reach, replace=False)]
  unreach = [v for v in range(cfg.concepts) if v not in reach]
  path = sorted(reach[:hops + 1], key=rank.get)
  edges = {(a, b) for a, b in zip(path, path[1:])}
  dead = reach[hops + 1:]
  for v in dead:  # hang every dead end off the reachable side (a tempting branch)
    preds = [u for u in reach if rank[u] < rank[v] and u not in dead] or [u for u in reach if rank[u] < rank[v]]
    if preds:
      edges.add((int(rng.choice(preds)), v))
  candidates = [(a, b) for a in range(cfg.concepts) for b in range(cfg.concepts)
                if rank[a] < rank[b] and not (a in reach and b in unreach) and (a, b) not in edges]
  for i in rng.permutation(len(candidates))[:cfg.extra_edges]:
    edges.add(candidates[int(i)])
  start, answer = path[0], path[-1]
  distractor = int(rng.choice(unreach))
  entity = str(rng.choice(list(_ENTITIES)))
  facts = [f"Every {names[a]} is a {names[b]}." for a, b in sorted(edges)]
  facts = [facts[int(i)] for i in rng.permutation(len(facts))]
  options = [names[answer], names[distractor]]
  if rng.random() < 0.5:
    options.reverse()
  question = " ".join(facts) + f" {entity} is a {names[start]}. Is {entity} a {options[0]} or a {options[1]}?"
  steps = tuple(f"{entity} is a {names[v]}" for v in path[1:])
  return Chain(question=question, steps=steps, answer=names[answer])


def prosqa_chains(cfg: ProsQAConfig, split: str = "train") -> list[Chain]:
  """The ``train`` split (indices ``[0, n_train)``) or ``heldout`` (the next ``n_heldout``)."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  lo, n = (0, cfg.n_train) if split == "train" else (cfg.n_train, cfg.n_heldout)
  return [prosqa_chain(cfg, i) for i in range(lo, lo + n)]


def reachable(question: str) -> set[str]:
  """Concepts the question's entity belongs to, by breadth-first search over its ``Every X is a Y.`` facts."""
  graph = collections.defaultdict(list)
  for a, b in _FACT.findall(question):
    graph[a].append(b)
  m = re.search(r"(\w+) is a (\w+)\. Is ", question)
  if m is None:
    raise ValueError(f"no '<entity> is a <concept>. Is ...' in {question!r}")
  seen, queue = {m.group(2)}, collections.deque([m.group(2)])
  while queue:
    for b in graph[queue.popleft()]:
      if b not in seen:
        seen.add(b)
        queue.append(b)
  return seen
