"""The tiny character-level chat tokenizer committed as ``jaxrl/assets/tiny_tokenizer``.

It covers the built-in arithmetic task (digits, operators, letters, punctuation, whitespace): one
token per character plus the special tokens of a ChatML-like chat template. Tests and the
quickstart load it with the ordinary ``transformers.AutoTokenizer.from_pretrained(dir)`` path, so
the code that handles a real Hugging Face tokenizer is the code that runs here.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

PAD, UNK, BOS, EOS, IM_START, IM_END = (
    "<|pad|>", "<|unk|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, IM_START, IM_END)
"""Special tokens, ids 0..5 in this order (``<|pad|>`` is id 0)."""

CHARACTERS = tuple(c for c in string.printable if c not in "\r\x0b\x0c")
"""Every printable ASCII character plus ``\\n`` and ``\\t``: one token each."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}<|im_end|>"
    "{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML-like: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message after one ``<|bos|>``.

Assistant content and its ``<|im_end|>`` sit inside ``{% generation %}`` markers, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` works too; jaxrl's own masks
(:func:`jaxrl.data.encode_chat`) do not rely on the markers.
"""


WORD_PIECES = r" ?[A-Za-z]+| ?\d+|[\s\S]"
"""How `build_tiny_tokenizer` with ``words`` splits text: a run of letters or of digits with the space before it,
else one character."""


def build_tiny_tokenizer(out_dir: str | Path, *, model_max_length: int = 4096, words: Sequence[str] | None = None):
  """Builds the character-level chat tokenizer and saves it as a Hugging Face tokenizer dir.

  Args:
    out_dir: directory to write (``tokenizer.json``, ``tokenizer_config.json``,
      ``chat_template.jinja``).
    model_max_length: the ``model_max_length`` recorded in the config.
    words: a word-level vocabulary instead of the characters: text splits into `WORD_PIECES` (a word, a
      number, a character) and a piece not in `words` is ``<|unk|>`` (the tiny CapRL answerer's tokenizer:
      `jaxrl.rewards.build_caption_answerer_tokenizer`).

  Returns:
    The ``transformers.PreTrainedTokenizerFast`` that was saved.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  pieces = CHARACTERS if words is None else tuple(dict.fromkeys(words))
  if words is not None and set(pieces) & set(SPECIAL_TOKENS):
    raise ValueError("words: must not contain the special tokens")
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + pieces)}
  backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]" if words is None else WORD_PIECES), behavior="isolated")
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  tokenizer = PreTrainedTokenizerFast(
      tokenizer_object=backend,
      bos_token=BOS, eos_token=IM_END, pad_token=PAD, unk_token=UNK,
      extra_special_tokens=[EOS, IM_START, IM_END],
      chat_template=CHAT_TEMPLATE,
      model_max_length=model_max_length,
      clean_up_tokenization_spaces=False,
  )
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  tokenizer.save_pretrained(str(out_dir))
  return tokenizer


def tokenizer_dir(tokenizer: str | None, hf_dir: str | None, *, vision: bool = False) -> str:
  """The tokenizer directory a trainer's config names: its ``tokenizer``, else its model's ``hf_dir``, else
  the built-in tiny tokenizer's (:func:`tiny_tokenizer_dir`; with ``vision``, :func:`tiny_vl_tokenizer_dir`)."""
  return tokenizer or hf_dir or str(tiny_vl_tokenizer_dir() if vision else tiny_tokenizer_dir())


def tiny_vl_tokenizer_dir() -> Path:
  """Path of the committed tiny tokenizer with the Qwen2-VL vision tokens added: ``<|vision_start|>`` 103,
  ``<|vision_end|>`` 104, ``<|image_pad|>`` 105, ``<|video_pad|>`` 106 (107 tokens; configs/sft_vl_tiny.yaml)."""
  return Path(str(resources.files("jaxrl") / "assets" / "tiny_vl_tokenizer"))


def tiny_tokenizer_dir() -> Path:
  """Path of the committed tiny tokenizer (load it with ``AutoTokenizer.from_pretrained``)."""
  return Path(str(resources.files("jaxrl") / "assets" / "tiny_tokenizer"))
