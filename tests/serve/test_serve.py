"""`jaxrl serve` through the official `openai` client: log-probs, chat template, sampling, streaming, batching."""

import concurrent.futures as cf

import numpy as np
import openai
import pytest

from jaxrl import serve

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3=?"}]


def test_chat_template_is_the_tokenizers(tiny_sampler, client):
  tok = tiny_sampler.tokenizer
  want = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  ids = serve.render_chat(tok, MESSAGES)
  assert ids == tok.encode(want, add_special_tokens=False)
  r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
  assert r.usage.prompt_tokens == len(ids)


def test_chat_logprobs_equal_sampler(tiny_sampler, client):
  ids = serve.render_chat(tiny_sampler.tokenizer, MESSAGES)
  r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                     logprobs=True, top_logprobs=3)
  ref = tiny_sampler.generate([ids], n=1, max_new_tokens=12, temperature=0.0, return_top_logprobs=3)
  n = int(ref.lengths[0])
  content = r.choices[0].logprobs.content
  assert len(content) == n == r.usage.completion_tokens
  np.testing.assert_allclose([c.logprob for c in content], ref.logprobs[0, :n], rtol=0, atol=1e-5)
  np.testing.assert_allclose([[t.logprob for t in c.top_logprobs] for c in content],
                             ref.top_logprobs.logprobs[0, :n], rtol=0, atol=1e-5)
  piece = lambda t: tiny_sampler.tokenizer.decode([int(t)])
  assert [c.token for c in content] == [piece(t) for t in ref.tokens[0, :n]]
  assert r.choices[0].message.content == ref.texts[0]


def test_sampled_rows_equal_sampler_rows(tiny_sampler, client):
  """n samples with temperature/top-k/seed: each row is the sampler's row for its request id."""
  prompt = "7*6="
  r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=10, temperature=0.8, top_p=0.9,
                                seed=11, logprobs=2, extra_body={"top_k": 20})
  ids = tiny_sampler.tokenizer.encode(prompt)
  ref = tiny_sampler.generate([ids] * 3, n=1, max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=20, seed=0,
                              request_ids=[serve.row_request_id(11, 0, j) for j in range(3)], return_top_logprobs=2)
  for j, c in enumerate(r.choices):
    n = int(ref.lengths[j])
    assert c.text == ref.texts[j]
    np.testing.assert_allclose(c.logprobs.token_logprobs, ref.logprobs[j, :n], rtol=0, atol=1e-5)
  assert len({c.text for c in r.choices}) > 1  # the rows are different draws


def test_stream_equals_response(client):
  kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=5, n=2)
  whole = client.chat.completions.create(**kw)
  parts, finish = {0: "", 1: ""}, {}
  for chunk in client.chat.completions.create(stream=True, **kw):
    for ch in chunk.choices:
      parts[ch.index] += ch.delta.content or ""
      if ch.finish_reason:
        finish[ch.index] = ch.finish_reason
  assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]
  assert [finish[0], finish[1]] == [c.finish_reason for c in whole.choices]


def test_concurrent_requests_share_a_batch_and_keep_their_rows(server, client):
  _, app = server
  prompts = ["1+1=", "9-4=", "3*3=", "8/2="]
  kw = dict(model="tiny", max_tokens=8, temperature=1.0, seed=3)
  alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
  before = len(app.state.batcher.batch_sizes)
  with cf.ThreadPoolExecutor(4) as pool:
    together = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
  assert together == alone
  assert max(app.state.batcher.batch_sizes[before:]) > 1


def test_stop_max_tokens_and_models(client):
  r = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0)
  text = r.choices[0].text
  if len(text) >= 3:
    stop = text[2]
    s = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert s.choices[0].text == text[:text.index(stop)] and s.choices[0].finish_reason == "stop"
  short = client.completions.create(model="tiny", prompt="abc", max_tokens=2, temperature=0)
  assert short.usage.completion_tokens <= 2
  assert [m.id for m in client.models.list().data] == ["tiny"]


def test_bad_request_names_the_field(client):
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
  with pytest.raises(openai.BadRequestError, match="messages"):
    client.chat.completions.create(model="tiny", messages=[])


def test_cli_names_a_missing_model_dir(tmp_path, capsys):
  from jaxrl import cli
  assert cli.main(["serve", "--model", str(tmp_path / "nope"), "--port", "0"]) == 2
  assert "nope" in capsys.readouterr().err
