"""Stage-k examples and column-aligned rows: thought counts, markers, loss masks (table-driven)."""

import json

import numpy as np
import pytest
from latent_testlib import tokenizer_and_tokens

from jaxrl import latent

STEPS = ("4*2=8", "3+8=11", "11-1=10")


@pytest.mark.parametrize("s,k,c,pad,kind,markers,want", [
    # (chain steps, stage, c, pad_thoughts, slot kind, markers, expected slots)
    (3, 0, 1, False, "latent", True, 0),
    (3, 1, 1, False, "latent", True, 1),
    (3, 2, 2, False, "latent", True, 4),
    (3, 3, 2, False, "latent", True, 6),
    (1, 2, 2, False, "latent", True, 2),  # chain shorter than k: min(k, s)·c
    (2, 5, 3, False, "latent", True, 6),
    (1, 2, 2, True, "latent", True, 4),  # padded to k·c
    (2, 2, 1, False, "pause", True, 2),
    (2, 2, 1, False, "none", True, 0),  # w/o thought: steps dropped, no slots
    (3, 0, 1, False, "none", False, 0),  # CoT
    (3, 9, 1, False, "none", False, 0),  # no-CoT
])
def test_stage_example_and_rows(s, k, c, pad, kind, markers, want):
  tok, ids = tokenizer_and_tokens()
  chain = latent.Chain("4*2+3-1=?", STEPS[:s], "10")
  ex = latent.stage_example(chain, k, c=c, tokenizer=tok, tokens=ids, markers=markers, kind=kind, pad_thoughts=pad)
  assert ex.n_thoughts == want
  kept = STEPS[min(k, s):s]
  text = tok.decode(ex.suffix.tolist())
  assert text == ("<eot>" if markers else "") + latent.completion_text(kept, "10") + tok.eos_token
  assert (ex.prompt[-1] == ids.bot) == markers and (ex.suffix[0] == ids.eot) == markers
  assert not ex.suffix_loss[0] if markers else ex.suffix_loss.all()

  # A second, longer example forces padding in both directions.
  other = latent.stage_example(latent.Chain("1+2+3+4+5=?", ("1+2=3",) * 4, "15"), k, c=c, tokenizer=tok,
                               tokens=ids, markers=markers, kind=kind, pad_thoughts=pad)
  layout = latent.Layout.fit([ex, other])
  rows = latent.make_rows([ex, other], layout, ids)
  t = layout.length
  assert all(v.shape == (2, t) for v in rows.values())
  end = layout.prefix + layout.thoughts  # column of the first suffix token
  r = {key: v[0] for key, v in rows.items()}
  n_latent = want if kind == "latent" else 0
  assert r["thought_mask"].sum() == n_latent
  assert r["thought_mask"][end - n_latent:end].all()
  if kind == "pause":
    assert (r["tokens"][end - want:end] == ids.pause).all()
  first = end - want  # first slot column
  if markers:
    assert r["tokens"][first - 1] == ids.bot and r["tokens"][end] == ids.eot
  real = r["segment_ids"] == 1
  assert real.sum() == len(ex.prompt) + want + len(ex.suffix)
  np.testing.assert_array_equal(r["positions"][real], np.arange(real.sum()))
  # Loss only where the target is a trained suffix token: never on the question, the slots or <eot>.
  trained = np.flatnonzero(r["loss_mask"])
  np.testing.assert_array_equal(r["targets"][trained], ex.suffix[ex.suffix_loss])
  assert trained.min() == end - 1 + (1 if markers else 0)
  assert not r["loss_mask"][:end - 1].any()


def test_arithmetic_chains_match_the_builtin_task():
  chains = latent.arithmetic_chains(50, seed=0, difficulty=2)
  for ch in chains:
    assert 1 <= len(ch.steps) <= 2 and ch.steps[-1].endswith(f"={ch.answer}")


def test_read_chains_names_file_line_and_key(tmp_path):
  path = tmp_path / "chains.jsonl"
  path.write_text(json.dumps({"question": "q", "steps": ["a"], "answer": 1}) + "\n"
                  + json.dumps({"question": "q", "steps": "a", "answer": 1}) + "\n")
  with pytest.raises(ValueError, match=r"chains.jsonl:2: 'steps' must be a list"):
    latent.read_chains(path)


def test_latent_tokens_must_fit_the_embedding():
  tok, _ = tokenizer_and_tokens()
  with pytest.raises(ValueError, match="vocab_size=100"):
    latent.latent_tokens(tok, 100)
