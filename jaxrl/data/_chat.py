"""Chat-template tokenisation with per-token loss masks and assistant-turn ids.

The mask is computed turn by turn, not from offsets or template markers, so it works with any
tokenizer whose chat template is *prefix-stable* (rendering the first ``i`` messages gives a prefix
of rendering ``i + 1``). For each trained assistant message ``i``:

  head_i = render(messages[:i], add_generation_prompt=True)   # ends with the assistant header
  full_i = render(messages[:i + 1])
  trained text = full_i[len(head_i):] up to and including the last end-of-turn string

and the text between trained spans is untrained. Each piece is tokenised on its own, which is how
the model sees a prompt at sampling time (prompt tokens, then generated tokens).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.data._sources import DataError, record_messages


def _render(tokenizer, messages, *, add_generation_prompt: bool) -> str:
  clean = [{k: v for k, v in m.items() if k != "train"} for m in messages]
  return tokenizer.apply_chat_template(
      clean, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer, messages: list[dict[str, Any]], *,
                end_of_turn: str | None = None) -> dict[str, np.ndarray]:
  """Tokenises a conversation with the tokenizer's chat template.

  Args:
    tokenizer: a ``transformers`` tokenizer with a chat template.
    messages: ``[{"role", "content", "train"?}, ...]``; assistant messages are trained unless
      ``"train": false``.
    end_of_turn: string that closes an assistant turn (trained; text after it, such as a newline,
      is not). Default: ``tokenizer.eos_token``.

  Returns:
    ``tokens`` [L] int32, ``loss_mask`` [L] bool (the token is a trained assistant token),
    ``turn_id`` [L] int32 (1, 2, ... per trained assistant turn; 0 on untrained tokens).

  Raises:
    DataError: if the template is not prefix-stable for this conversation.
  """
  eot = tokenizer.eos_token if end_of_turn is None else end_of_turn
  pieces: list[tuple[str, int]] = []  # (text, turn id; 0 = untrained)
  done, turn = "", 0
  for i, message in enumerate(messages):
    if message["role"] != "assistant" or not message.get("train", True):
      continue
    if i == 0:
      raise DataError("conversation starts with a trained assistant turn; a chat template needs "
                      "a system or user message before it")
    head = _render(tokenizer, messages[:i], add_generation_prompt=True)
    full = _render(tokenizer, messages[:i + 1], add_generation_prompt=False)
    if not head.startswith(done) or not full.startswith(head):
      raise DataError(f"chat template is not prefix-stable at message {i}; cannot locate the "
                      "assistant turn's tokens")
    body = full[len(head):]
    cut = body.rfind(eot) + len(eot) if eot and eot in body else len(body)
    turn += 1
    pieces += [(head[len(done):], 0), (body[:cut], turn), (body[cut:], 0)]
    done = full
  rest = _render(tokenizer, messages, add_generation_prompt=False)
  if not rest.startswith(done):
    raise DataError("chat template is not prefix-stable at the last message")
  pieces.append((rest[len(done):], 0))
  pieces = [(text, t) for text, t in pieces if text]
  ids = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
  lengths = [len(x) for x in ids]
  tokens = np.asarray([tok for x in ids for tok in x], np.int32)
  turn_id = np.repeat(np.asarray([t for _, t in pieces], np.int32), lengths)
  return {"tokens": tokens, "loss_mask": turn_id > 0, "turn_id": turn_id}


def encode_record(tokenizer, record: dict[str, Any], *,
                  end_of_turn: str | None = None) -> dict[str, np.ndarray]:
  """Tokenises a ``messages`` or ``prompt``/``completion`` record (see ``record_messages``).

  Returns:
    :func:`encode_chat`'s arrays plus ``sample_id`` [L] int32, the record's ``_index`` (the
    source position; 0 if absent) on every token.

  Raises:
    DataError: naming the record's ``_where`` (``file:line``) when it has one.
  """
  try:
    out = encode_chat(tokenizer, record_messages(record), end_of_turn=end_of_turn)
  except DataError as e:
    where = record.get("_where") if isinstance(record, dict) else None
    raise DataError(f"{where}: {e}" if where else str(e)) from None
  out["sample_id"] = np.full(out["tokens"].shape, int(record.get("_index", 0)), np.int32)
  return out


def encode_prompt(tokenizer, record: dict[str, Any]) -> np.ndarray:
  """Prompt token ids for sampling: the messages before the last assistant turn, plus the header.

  A ``prompt``/``completion`` record uses its prompt; a ``messages`` record drops its last
  assistant message and what follows.

  Returns:
    [L] int32 token ids ending with the generation prompt.
  """
  if "messages" in record:
    messages = record_messages(record)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    messages = messages[:assistant[-1]] if assistant else messages
  elif isinstance(record.get("prompt"), str):
    messages = [{"role": "user", "content": record["prompt"]}]
  elif isinstance(record.get("prompt"), list):
    messages = list(record["prompt"])
  else:
    raise DataError(f"record needs 'messages' or 'prompt'; has keys {sorted(record)}")
  text = _render(tokenizer, messages, add_generation_prompt=True)
  return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
