"""Auto-Rubric's packaged offline sentence embedder (WordLlama, the `embed` extra) and the hashing fallback."""

import sys

import numpy as np
import pytest

from jaxrl import rewards

# Two paraphrase pairs sharing no content word (the hashing embedder sees them as unrelated), two distractors.
SENTENCES = ["Be concise.", "Keep it brief.", "Cite sources.", "Give references for claims.",
             "Bananas grow in tropical climates.", "The stock market fell sharply today."]


def _cos(e):
  e = e / np.linalg.norm(e, axis=1, keepdims=True)
  return e @ e.T


def test_packaged_embedder_puts_paraphrases_closest(monkeypatch):
  pytest.importorskip("wordllama")
  for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):  # any download attempt would fail
    monkeypatch.setenv(var, "http://127.0.0.1:9")
  embed, name = rewards.default_embedder()
  assert isinstance(embed, rewards.WordLlamaEmbedder) and name == "wordllama-l2_supercat"
  e = embed(SENTENCES)
  assert e.shape == (6, 256) and e.dtype == np.float64
  sim = _cos(e)
  for a, b in ((0, 1), (2, 3)):
    others = [k for k in range(len(SENTENCES)) if k not in (a, b)]
    assert sim[a, b] > max(sim[a, others].max(), sim[b, others].max()), (a, b, np.round(sim, 3))
  hashed = _cos(rewards.HashingEmbedder()(SENTENCES))
  assert abs(hashed[0, 1]) < 1e-12 and abs(hashed[2, 3]) < 1e-12  # no shared words: hashing cannot tell
  picked, sel, used = rewards.select_rubric_texts(SENTENCES[:4], embed=embed, max_size=2)
  assert used == "wordllama-l2_supercat" and len(picked) == 2 and sel.indices == [SENTENCES.index(p) for p in picked]


def test_without_wordllama_the_default_is_hashing(monkeypatch):
  monkeypatch.setitem(sys.modules, "wordllama", None)  # import wordllama -> ImportError
  embed, name = rewards.default_embedder()
  assert isinstance(embed, rewards.HashingEmbedder) and name == "hashing (wordllama not installed)"
  _, _, used = rewards.select_rubric_texts(SENTENCES)
  assert used == "hashing (wordllama not installed)"
