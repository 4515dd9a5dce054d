"""Streaming CJK, emoji and accented text split across byte-level BPE tokens, through the official `openai`
client, for the sampler and engine backends: the concatenated stream equals the non-streamed text, and the
log-probs' `bytes` rebuild every character."""

import numpy as np
import openai
import pytest
from bytelevel_testlib import TARGET, make_bytelevel_tokenizer, make_chain_model

from jaxrl import sampling, serve

CHAT = [{"role": "user", "content": "Say it."}]


@pytest.fixture(scope="module")
def bl_tok(tmp_path_factory):
  return make_bytelevel_tokenizer(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="module")
def chain_model(bl_tok):
  """Greedy after a newline: TARGET, then eos (the chat prompt and the completion prompts end in '\\n')."""
  newline = bl_tok.convert_tokens_to_ids("Ċ")
  return make_chain_model(bl_tok, bl_tok.encode(TARGET, add_special_tokens=False), start=newline)


@pytest.fixture(scope="module", params=["sampler", "engine"])
def bl_client(request, bl_tok, chain_model):
  if request.param == "sampler":
    backend = sampling.Sampler(chain_model, bl_tok, max_len=64)
  else:
    backend = sampling.Engine(chain_model, bl_tok, num_slots=4, max_len=64, block_size=8, num_blocks=40,
                              max_top_logprobs=3)
  app = serve.create_app(backend, model_name="bl", batch_wait_s=0.0, max_top_logprobs=3)
  with serve.ServerThread(app, port=0) as srv:
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300), bl_tok


def _rebuild(entries, tok) -> str:
  """The text the `bytes` of log-prob entries spell (special tokens are not part of the text)."""
  raw = b"".join(bytes(e.bytes) for e in entries if e.token not in tok.all_special_tokens)
  return raw.decode("utf-8", errors="replace")


def _chat_stream(client, **kw):
  parts, entries, finish = {}, {}, {}
  for chunk in client.chat.completions.create(stream=True, **kw):
    for ch in chunk.choices:
      parts.setdefault(ch.index, []).append(ch.delta.content or "")
      if ch.logprobs is not None:
        entries.setdefault(ch.index, []).extend(ch.logprobs.content)
      if ch.finish_reason:
        finish[ch.index] = ch.finish_reason
  return parts, entries, finish


def test_chat_stream_equals_response_and_bytes_rebuild(bl_client):
  client, tok = bl_client
  kw = dict(model="bl", messages=CHAT, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
  whole = client.chat.completions.create(**kw)
  msg = whole.choices[0]
  assert msg.message.content == TARGET and msg.finish_reason == "stop"
  content = msg.logprobs.content
  assert len(content) == whole.usage.completion_tokens == len(tok.encode(TARGET, add_special_tokens=False)) + 1
  assert _rebuild(content, tok) == TARGET
  assert [c.token for c in content[:4]] == ["bytes:\\xe4\\xbd", "bytes:\\xa0", "bytes:\\xe5", "bytes:\\xa5\\xbd"]
  assert bytes(content[0].bytes) + bytes(content[1].bytes) == "你".encode()
  assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].bytes is not None for c in content)
  parts, entries, finish = _chat_stream(client, **kw)
  deltas = parts[0][1:]  # after the role chunk
  assert "".join(deltas) == TARGET and finish == {0: "stop"}
  assert not any("\ufffd" in d for d in deltas)
  assert [e.token for e in entries[0]] == [c.token for c in content]
  assert [e.bytes for e in entries[0]] == [c.bytes for c in content]
  assert "你" in deltas and "🙂" in deltas and "ét" in deltas and "東京" in deltas  # whole characters only


def test_completion_stream_offsets_and_stop(bl_client):
  client, tok = bl_client
  kw = dict(model="bl", prompt="Q:\n", max_tokens=24, temperature=0, logprobs=2)
  whole = client.completions.create(**kw).choices[0]
  assert whole.text == TARGET
  lp = whole.logprobs
  ids = tok.encode(TARGET, add_special_tokens=False)
  assert lp.tokens[:len(ids)] == [sampling.TokenBytes(tok).text(t) for t in ids]
  # text_offset: where the character a token contributes to starts (a non-decreasing index into the text)
  assert lp.text_offset[:4] == [0, 0, 1, 1] and lp.text_offset == sorted(lp.text_offset)
  assert lp.text_offset[-1] == len(TARGET)  # the eos token
  streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
  assert streamed == TARGET
  stop = client.completions.create(stop=["京"], **{**kw, "logprobs": None}).choices[0]
  assert stop.text == TARGET[:TARGET.index("京")] and stop.finish_reason == "stop"
  streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=["京"], **kw))
  assert streamed == stop.text  # 東 is sent, though its last byte shares a token with 京


def _token_bytes(token: str) -> bytes:
  """A client's reading of a legacy-completions token string (OpenAI's "bytes:\\x.." for partial ones)."""
  if token.startswith("bytes:"):
    return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
  return token.encode()


def test_random_bytes_stream_equals_response(bl_client):
  """Sampled rows off the chain (the prompt does not end in a newline): random bytes, mostly invalid UTF-8
  (U+FFFD in the text) and split characters; the stream still concatenates to the text, and the token
  strings rebuild it."""
  client, tok = bl_client
  kw = dict(model="bl", prompt="x:", max_tokens=24, temperature=1.0, seed=7, n=2, logprobs=0)
  whole = client.completions.create(**kw)
  texts = [c.text for c in whole.choices]
  assert texts[0] != texts[1] and any("\ufffd" in t for t in texts)
  got, offsets = {0: "", 1: ""}, {0: [], 1: []}
  for chunk in client.completions.create(stream=True, **kw):
    for ch in chunk.choices:
      got[ch.index] += ch.text
      offsets[ch.index] += ch.logprobs.text_offset if ch.logprobs else []
  assert [got[0], got[1]] == texts
  for j, c in enumerate(whole.choices):
    assert offsets[j] == c.logprobs.text_offset
    raw = b"".join(_token_bytes(t) for t in c.logprobs.tokens if t not in tok.all_special_tokens)
    assert raw.decode("utf-8", errors="replace") == c.text
