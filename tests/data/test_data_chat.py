"""Chat-template tokenisation: loss masks on assistant tokens only, turn ids, ``train: false``."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxrl.data import DataError, encode_chat, encode_prompt, encode_record, tiny_tokenizer_dir


@pytest.fixture(scope="module")
def tok():
  return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "3+4=?"},
    {"role": "assistant", "content": "3+4=7. Answer: 7"},
    {"role": "user", "content": "Then *2=?"},
    {"role": "assistant", "content": "7*2=14. Answer: 14"},
]


def _trained_texts(tok, out):
  """Decoded text of each turn id's tokens."""
  return {int(t): tok.decode(out["tokens"][out["turn_id"] == t]) for t in np.unique(out["turn_id"]) if t}


def test_only_assistant_tokens_are_trained(tok):
  out = encode_chat(tok, CONVERSATION)
  assert tok.decode(out["tokens"]) == tok.apply_chat_template(CONVERSATION, tokenize=False)
  assert _trained_texts(tok, out) == {1: "3+4=7. Answer: 7<|im_end|>", 2: "7*2=14. Answer: 14<|im_end|>"}
  np.testing.assert_array_equal(out["loss_mask"], out["turn_id"] > 0)
  assert out["tokens"].dtype == np.int32 and out["turn_id"].dtype == np.int32


def test_train_false_turn_is_not_trained_and_turns_stay_distinct(tok):
  messages = [dict(m) for m in CONVERSATION]
  messages[2]["train"] = False
  out = encode_chat(tok, messages)
  assert _trained_texts(tok, out) == {1: "7*2=14. Answer: 14<|im_end|>"}
  assert tok.decode(out["tokens"]) == tok.apply_chat_template(CONVERSATION, tokenize=False)


def test_prompt_completion_record_trains_the_completion(tok):
  out = encode_record(tok, {"prompt": "1+2=?", "completion": "1+2=3. Answer: 3", "_index": 5})
  assert _trained_texts(tok, out) == {1: "1+2=3. Answer: 3<|im_end|>"}
  assert set(out["sample_id"].tolist()) == {5}
  assert len(out["sample_id"]) == len(out["tokens"])


def test_prompt_ends_with_generation_header(tok):
  ids = encode_prompt(tok, {"messages": CONVERSATION})
  assert tok.decode(ids).endswith("Then *2=?<|im_end|>\n<|im_start|>assistant\n")
  assert tok.decode(encode_prompt(tok, {"prompt": "5+5=?"})) == (
      "<|bos|><|im_start|>user\n5+5=?<|im_end|>\n<|im_start|>assistant\n")


def test_record_error_names_its_location(tok):
  with pytest.raises(DataError, match="data.jsonl:4: 'completion' is empty"):
    encode_record(tok, {"prompt": "x", "completion": "", "_where": "data.jsonl:4"})


def test_non_prefix_stable_template_is_an_error(tok):
  class Reversed:
    eos_token = tok.eos_token

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
      return "".join(m["content"] for m in reversed(messages)) + ("|" if add_generation_prompt else "")

  with pytest.raises(DataError, match="not prefix-stable"):
    encode_chat(Reversed(), CONVERSATION)
