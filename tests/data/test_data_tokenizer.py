"""The committed tiny tokenizer: loadable by transformers, reproducible, covers the task."""

import json

import pytest
from transformers import AutoTokenizer

from jaxrl.data import SPECIAL_TOKENS, build_tiny_tokenizer, encode_chat, tiny_tokenizer_dir


@pytest.fixture(scope="module")
def tok():
  return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def test_committed_tokenizer_loads_with_auto_tokenizer(tok):
  assert len(tok) <= 256
  assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)
  assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|im_end|>")
  assert tok.pad_token_id == 0
  assert tok.chat_template


def test_task_text_round_trips_one_token_per_character(tok):
  text = "Q: 12+4*2=? A: 4*2=8; 12+8=20.\nAnswer: -20\tThen *3=?"
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert len(ids) == len(text)
  assert tok.unk_token_id not in ids
  assert tok.decode(ids) == text


def test_special_tokens_are_single_tokens(tok):
  ids = tok("<|im_start|>user\n7<|im_end|>", add_special_tokens=False)["input_ids"]
  assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "u", "s", "e", "r", "\n", "7", "<|im_end|>"]


def test_rebuilt_tokenizer_equals_committed_asset(tmp_path):
  build_tiny_tokenizer(tmp_path)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert json.loads((tmp_path / name).read_text()) == json.loads(
        (tiny_tokenizer_dir() / name).read_text()), name
  assert (tmp_path / "chat_template.jinja").read_text() == (
      tiny_tokenizer_dir() / "chat_template.jinja").read_text()


def test_turn_by_turn_mask_agrees_with_generation_markers(tok):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4=?"},
              {"role": "assistant", "content": "3+4=7. Answer: 7"},
              {"role": "user", "content": "Then *2=?"}, {"role": "assistant", "content": "7*2=14"}]
  hf = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                               return_assistant_tokens_mask=True)
  ours = encode_chat(tok, messages)
  assert ours["tokens"].tolist() == hf["input_ids"]
  assert ours["loss_mask"].astype(int).tolist() == hf["assistant_masks"]
