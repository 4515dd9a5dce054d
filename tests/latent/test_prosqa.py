"""The generated ProsQA-style task: deterministic, and the answer is the reachable option (BFS)."""

import re

import pytest

from jaxrl import latent


@pytest.mark.parametrize("seed,index,concepts,hops", [(0, 0, 8, (1, 3)), (0, 7, 8, (1, 3)), (3, 2, 12, (4, 6)),
                                                     (5, 40, 6, (2, 3))])
def test_prosqa_examples_are_correct_by_bfs(seed, index, concepts, hops):
  cfg = latent.ProsQAConfig(seed=seed, concepts=concepts, min_hops=hops[0], max_hops=hops[1], n_train=10)
  chain = latent.prosqa_chain(cfg, index)
  assert chain == latent.prosqa_chain(cfg, index)  # deterministic by seed and index
  m = re.search(r"(\w+) is a (\w+)\. Is \1 a (\w+) or a (\w+)\?$", chain.question)
  entity, start, a, b = m.groups()
  reach = latent.reachable(chain.question)
  assert chain.answer in (a, b) and chain.answer in reach
  assert ({a, b} - {chain.answer}).isdisjoint(reach)  # the distractor is unreachable
  assert hops[0] <= len(chain.steps) <= hops[1]
  # The steps are a proof path: each hop is a stated fact, the last reaches the answer.
  facts = set(re.findall(r"Every (\w+) is a (\w+)\.", chain.question))
  here = start
  for step in chain.steps:
    nxt = re.fullmatch(rf"{entity} is a (\w+)", step).group(1)
    assert (here, nxt) in facts, (here, nxt)
    here = nxt
  assert here == chain.answer


def test_prosqa_splits_are_disjoint_and_stable():
  cfg = latent.ProsQAConfig(n_train=30, n_heldout=10)
  train, heldout = latent.prosqa_chains(cfg, "train"), latent.prosqa_chains(cfg, "heldout")
  assert len(train) == 30 and len(heldout) == 10
  assert train[:5] == latent.prosqa_chains(latent.ProsQAConfig(n_train=5), "train")  # prefix-stable
  assert not {c.question for c in train} & {c.question for c in heldout}
  with pytest.raises(ValueError, match="concepts=4 must be at least"):
    latent.ProsQAConfig(concepts=4)


def test_prosqa_single_letter_names():
  cfg = latent.ProsQAConfig(concepts=6, min_hops=1, max_hops=2, name_length=1, n_train=20)
  for chain in latent.prosqa_chains(cfg):
    names = set(re.findall(r"Every (\w+) is a (\w+)\.", chain.question)[0]) | {chain.answer}
    assert all(len(x) == 1 for x in names) and chain.answer in latent.reachable(chain.question)
  with pytest.raises(ValueError, match="name_length=1 must be >= 1 and allow 15 distinct"):
    latent.ProsQAConfig(concepts=15, name_length=1)


def test_word_answers_match():
  assert latent.answer_match("Tom is a dar. Answer: lom<|im_end|>", "lom")
  assert not latent.answer_match("Answer: lomx", "lom")
  assert latent.answer_match("3+8=11. Answer: 11", "11")
