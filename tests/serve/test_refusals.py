"""OpenAI-conformant refusals of `jaxrl serve` through the official `openai` client: a context the request
cannot fit (400), an unknown model (404), an unknown message role (400); the accepted cases around them."""

import httpx
import openai
import pytest

from jaxrl import serve

MAX_LEN = 128  # conftest's sampler


def _prompt_of(tok, n: int) -> str:
  """A completion prompt of exactly ``n`` tokens (the character tokenizer: one token per character, plus bos)."""
  text = "a" * (n - len(tok.encode("", add_special_tokens=True)))
  assert len(tok.encode(text, add_special_tokens=True)) == n
  return text


def test_context_overflow_is_a_400_naming_the_numbers(tiny_sampler, client):
  ids = serve.render_chat(tiny_sampler.tokenizer, [{"role": "user", "content": "hi"}])
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10**9)
  err = e.value.body
  assert err["code"] == "context_length_exceeded" and err["param"] == "messages" and err["type"] == "invalid_request_error"
  assert f"maximum context length is {MAX_LEN} tokens" in err["message"]
  assert f"requested {len(ids) + 10**9} tokens ({len(ids)} in the messages, {10**9} in the completion)" in err["message"]
  with pytest.raises(openai.BadRequestError, match="max_completion_tokens|context length"):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                   max_completion_tokens=MAX_LEN)
  prompt = _prompt_of(tiny_sampler.tokenizer, MAX_LEN - 4)
  ok = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)  # exactly the context
  assert ok.usage.prompt_tokens == MAX_LEN - 4 and 1 <= ok.usage.completion_tokens <= 4
  with pytest.raises(openai.BadRequestError, match=f"requested {MAX_LEN + 1} tokens \\({MAX_LEN - 4} in the prompt, 5 "):
    client.completions.create(model="tiny", prompt=prompt, max_tokens=5)
  with pytest.raises(openai.BadRequestError, match="resulted in 130 tokens"):  # no room at all, no max_tokens
    client.completions.create(model="tiny", prompt=_prompt_of(tiny_sampler.tokenizer, 130))


def test_without_max_tokens_the_rest_of_the_context_is_the_budget(tiny_sampler, client):
  tok = tiny_sampler.tokenizer
  messages = [{"role": "user", "content": "b" * 100}]
  n = len(serve.render_chat(tok, messages))
  r = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
  assert r.usage.prompt_tokens == n and 1 <= r.usage.completion_tokens <= MAX_LEN - n
  ref = tiny_sampler.generate([serve.render_chat(tok, messages)], max_new_tokens=MAX_LEN - n, temperature=0.0)
  assert r.choices[0].message.content == ref.texts[0]  # the budget is max_len - prompt, not a default
  # completions keep the legacy default of 16, capped at what the prompt leaves
  c = client.completions.create(model="tiny", prompt=_prompt_of(tok, MAX_LEN - 3), temperature=0)
  assert c.usage.completion_tokens <= 3


def test_unknown_model_is_a_404(server, client):
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
  assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
  assert "gpt-4o" in e.value.body["message"] and "tiny" in e.value.body["message"]
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="tiny2", prompt="1+1=", max_tokens=2)
  # no model at all is served (as vLLM does); the error body has exactly OpenAI's four fields
  r = httpx.post(f"{server[0].url}/completions", json={"prompt": "1+1=", "max_tokens": 2, "temperature": 0},
                 timeout=120)
  assert r.status_code == 200 and r.json()["model"] == "tiny"
  bad = httpx.post(f"{server[0].url}/completions", json={"model": "x", "prompt": "1+1="}, timeout=120)
  assert bad.status_code == 404 and set(bad.json()) == {"error"}
  assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
  nowhere = httpx.get(f"{server[0].url}/nowhere", timeout=120)
  assert nowhere.status_code == 404 and set(nowhere.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_role_is_a_400_and_known_roles_pass(tiny_sampler, client):
  with pytest.raises(openai.BadRequestError, match="wizard") as e:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"},
                                                           {"role": "wizard", "content": "abracadabra"}], max_tokens=2)
  assert e.value.body["param"] == "messages.[1].role"
  tok = tiny_sampler.tokenizer
  msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+3=?"},
          {"role": "assistant", "content": "5"}, {"role": "tool", "content": "ok"}, {"role": "user", "content": "?"}]
  r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
  as_system = [{**msgs[0], "role": "system"}] + msgs[1:]
  assert r.usage.prompt_tokens == len(serve.render_chat(tok, as_system))  # developer renders as system
