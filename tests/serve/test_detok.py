"""`jaxrl.sampling.IncrementalDetokenizer` and `TokenBytes` against the full decode: byte-level BPE that splits
CJK, emoji and accented characters across tokens, random (often invalid UTF-8) token sequences, special tokens,
and the committed character tokenizer and the sentencepiece-style fixture."""

from pathlib import Path

import numpy as np
import pytest
from bytelevel_testlib import TARGET, make_bytelevel_tokenizer

from jaxrl import data, models, sampling
from jaxrl.sampling._detok import bytes_to_unicode

HF_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"


@pytest.fixture(scope="module")
def bl_tok(tmp_path_factory):
  return make_bytelevel_tokenizer(tmp_path_factory.mktemp("bytelevel"))


def _stream(tok, ids, **kw):
  detok = sampling.IncrementalDetokenizer(tok, **kw)
  deltas = [detok.step(t) for t in ids]
  deltas.append(detok.flush())
  assert detok.text == "".join(deltas)
  return deltas


def test_table_is_gpt2s():
  table = bytes_to_unicode()
  assert len(set(table.values())) == 256
  assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0xAD] == "Ń"


def test_the_tokenizer_splits_characters(bl_tok):
  """The fixture is what the other tests need: characters whose bytes span tokens."""
  ids = bl_tok.encode(TARGET, add_special_tokens=False)
  tb = sampling.TokenBytes(bl_tok)
  assert tb.byte_level
  naive = "".join(bl_tok.decode([t]) for t in ids)  # the old per-token decode
  assert "\ufffd" in naive and naive != TARGET
  partial = [t for t in ids if tb.text(t).startswith("bytes:")]
  assert len(partial) == 15  # 你 好 🙂 é ж: 2 tokens each, 東京: 5; "ét" and "\xb1\xe4" cross a character
  assert tb.text(bl_tok.convert_tokens_to_ids("ä½")) == "bytes:\\xe4\\xbd"
  assert b"".join(tb(t) for t in ids) == TARGET.encode()


def test_stream_of_split_characters(bl_tok):
  ids = bl_tok.encode(TARGET, add_special_tokens=False)
  deltas = _stream(bl_tok, ids)
  assert "".join(deltas) == TARGET
  assert all("\ufffd" not in d for d in deltas)
  # each character arrives whole with the token that completes it: 你 (2 tokens) then 好 (2 tokens) ...
  # each character arrives whole with the token that completes it; 東 ends inside the token that starts 京
  assert deltas == ["", "你", "", "好", ",", "", "🙂", " c", "af", "", "ét", "", "", "", "", "東京", "!", "", "ж", ""]


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_equal_full_decode(bl_tok, seed):
  """Random ids over the whole vocabulary (special tokens included): mostly invalid UTF-8, which must decode
  to the same U+FFFD runs as the full text; with and without skipping special tokens."""
  rng = np.random.default_rng(seed)
  for _ in range(60):
    ids = rng.integers(0, len(bl_tok), size=int(rng.integers(1, 40))).tolist()
    for skip in (True, False):
      want = bl_tok.decode(ids, skip_special_tokens=skip)
      assert "".join(_stream(bl_tok, ids, skip_special_tokens=skip)) == want, (ids, skip)


def test_random_valid_text_streams_without_replacement_chars(bl_tok):
  """Text drawn from the split characters: every delta is valid text (no U+FFFD ever sent), and the
  concatenation is the text."""
  rng = np.random.default_rng(0)
  alphabet = list("你好🙂éüж東京çñ ab!\n") + ["ét", "🎉"]
  for _ in range(40):
    text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 30))).tolist())
    ids = bl_tok.encode(text, add_special_tokens=False)
    deltas = _stream(bl_tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    tb = sampling.TokenBytes(bl_tok)
    assert b"".join(tb(t) for t in ids).decode() == text


def test_special_tokens_bytes_and_skipping(bl_tok):
  eos = bl_tok.convert_tokens_to_ids("<|im_end|>")
  ids = bl_tok.encode("你好", add_special_tokens=False) + [eos]
  assert "".join(_stream(bl_tok, ids)) == "你好"
  assert "".join(_stream(bl_tok, ids, skip_special_tokens=False)) == "你好<|im_end|>"
  tb = sampling.TokenBytes(bl_tok)
  assert tb(eos) == b"<|im_end|>" and tb.text(eos) == "<|im_end|>"


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_other_tokenizers_equal_full_decode(which):
  """A character vocabulary (Fuse decoder) and the sentencepiece-style fixture (Metaspace: the leading
  space of a window's first token is stripped in both decodes, so the deltas keep it)."""
  tok = models.load_tokenizer(data.tiny_tokenizer_dir() if which == "tiny" else HF_FIXTURES / "qwen3")
  rng = np.random.default_rng(1)
  texts = ["Q: 2+3=?\nA: 5", "def add(a, b):\n    return a + b\n", "the quick brown fox jumps"]
  for text in texts:
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True)
  for _ in range(30):
    ids = rng.integers(0, len(tok), size=int(rng.integers(1, 30))).tolist()
    assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True), ids
  tb = sampling.TokenBytes(tok)
  assert not tb.byte_level
  ids = tok.encode(texts[2], add_special_tokens=False)
  pieces = [tb.text(t) for t in ids]
  if which == "tiny":  # one character per token
    assert pieces == [tok.decode([t]) for t in ids] == list(texts[2])
  else:  # sentencepiece-style: the word marker is a leading space, as in OpenAI's token strings
    assert pieces == [p.replace("▁", " ") for p in tok.convert_ids_to_tokens(ids)]
    assert pieces[1].startswith(" ") and not tok.decode([ids[1]]).startswith(" ")
  assert "".join(pieces).strip() == texts[2]
