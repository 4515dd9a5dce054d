"""A tiny byte-level BPE tokenizer whose merges split CJK characters, emoji and accented letters across
tokens (built locally, no download), and a model whose greedy completion is a chosen token chain."""

from pathlib import Path

import numpy as np

from jaxrl import data, models
from jaxrl.sampling._detok import bytes_to_unicode

# Every merge below is a pair of byte-level pieces; the comments give the bytes and what they split.
_B = bytes_to_unicode()


def _p(raw: bytes) -> str:
  return "".join(_B[b] for b in raw)


MERGES = [
    (b"\xe4", b"\xbd"),  # 你 = e4 bd a0 -> [e4 bd][a0]
    (b"\xa5", b"\xbd"),  # 好 = e5 a5 bd -> [e5][a5 bd]
    (b"\xf0", b"\x9f"),  # 🙂 = f0 9f 99 82 -> [f0 9f][99 82]
    (b"\x99", b"\x82"),
    (b"\xa9", b"t"),  # ét = c3 a9 74 -> [c3][a9 t] (a token holding the end of é and a whole letter)
    (b"\xb1", b"\xe4"),  # 東京 = e6 9d b1 | e4 ba ac -> [e6][9d][b1 e4][ba][ac] (a token across two characters)
    (b" ", b"c"),
    (b"a", b"f"),
]
# ж (d0 b6) stays split into its two byte tokens; " c" and "af" are ASCII merges.
TARGET = "你好,🙂 cafét東京!ж"
"""The greedy completion of the chain model (after a prompt ending in a newline): no token repeats."""


def make_bytelevel_tokenizer(out_dir: Path):
  """Byte-level BPE (GPT-2 style: ``ByteLevel`` pre-tokenizer and decoder) over the 256 byte pieces, the
  :data:`MERGES` and the tiny tokenizer's special tokens and chat template; saved to ``out_dir``."""
  from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
  from tokenizers import models as tok_models
  from transformers import PreTrainedTokenizerFast

  vocab = {t: i for i, t in enumerate(data.SPECIAL_TOKENS)}
  for b in range(256):
    vocab[_B[b]] = len(vocab)
  merges = []
  for a, b in MERGES:
    merges.append((_p(a), _p(b)))
    vocab[_p(a + b)] = len(vocab)
  backend = Tokenizer(tok_models.BPE(vocab=vocab, merges=merges))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in data.SPECIAL_TOKENS])
  pad, unk, bos, eos, im_start, im_end = data.SPECIAL_TOKENS
  tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=im_end, pad_token=pad,
                                unk_token=unk, extra_special_tokens=[eos, im_start, im_end],
                                chat_template=data.CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
  tok.save_pretrained(str(out_dir))
  return models.load_tokenizer(out_dir)


def make_chain_model(tok, chain: list[int], *, start: int, hidden: int = 64, seed: int = 0):
  """A 2-layer model that ignores context (attention and MLP outputs are zero) and maps each token to its
  successor: ``start -> chain[0] -> chain[1] -> ... -> eos``; after a token off the chain every token is
  equally likely.

  Embeddings of chain tokens are random unit-scale vectors, the others zero; the lm_head column of
  ``succ(x)`` is ``8 * embed[x]`` (normalised), so the successor's logit (~8 * hidden) dwarfs every other
  (~8 * sqrt(hidden))."""
  eos = tok.convert_tokens_to_ids(tok.eos_token)
  src = [start] + list(chain)
  dst = list(chain) + [eos]
  assert len(set(src)) == len(src), "the chain must not repeat a token"
  vocab = len(tok)
  cfg = models.ModelConfig.tiny(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
                                num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
  model = models.init_model(cfg, seed=seed)
  rng = np.random.default_rng(seed)
  embed = np.zeros((vocab, hidden), np.float32)  # off the chain: a zero vector, uniform logits
  embed[src] = rng.normal(size=(len(src), hidden))
  head = np.zeros((hidden, vocab), np.float32)
  for s, d in zip(src, dst):
    head[:, d] = 8.0 * embed[s] / np.sqrt(np.mean(embed[s] ** 2))
  model.embed[...] = embed
  model.lm_head[...] = head
  model.layers.attn.o_proj[...] = np.zeros_like(model.layers.attn.o_proj[...])
  model.layers.mlp.down_proj[...] = np.zeros_like(model.layers.mlp.down_proj[...])
  return model
