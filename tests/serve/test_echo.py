"""`/v1/completions` with `echo`: prompt log-probs from `jaxrl serve` equal the RL trainer's recompute, and
`Judge.sequence_logprob` (AlignXplore's R_gen, eq. 6) read through a real `jaxrl serve` equals it too."""

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from jaxrl import models, rewards
from jaxrl.rl._loss import make_logprob_fn


@pytest.fixture(scope="module")
def trainer_logprobs(tiny_dir):
  """The trainer's own recompute (``make_logprob_fn``, as for old/ref log-probs) of ``log p(ids[t] | ids[:t])``."""
  graphdef, params = nnx.split(models.load_pretrained(tiny_dir, dtype="float32"))
  fn = make_logprob_fn(graphdef, temperature=1.0, chunk_size=16)

  def per_token(ids):
    t = len(ids) - 1
    mb = {"tokens": jnp.asarray([ids[:-1]], jnp.int32), "targets": jnp.asarray([ids[1:]], jnp.int32),
          "positions": jnp.arange(t, dtype=jnp.int32)[None], "segment_ids": jnp.ones((1, t), jnp.int32)}
    return np.asarray(fn(params, mb))[0]
  return per_token


def test_echo_prompt_logprobs_equal_trainer_recompute(tiny_sampler, client, trainer_logprobs):
  prompt = "Q: 2+3=?\nA: 5"
  ids = tiny_sampler.tokenizer.encode(prompt)
  r = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=3)
  c = r.choices[0]
  assert c.text == prompt and r.usage.completion_tokens == 0
  lp = c.logprobs
  assert lp.tokens == [tiny_sampler.tokenizer.decode([t]) for t in ids]
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  want = trainer_logprobs(ids)
  np.testing.assert_allclose(lp.token_logprobs[1:], want, rtol=0, atol=1e-5)
  for got, ref in zip(lp.top_logprobs[1:], want):  # top-3 sorted, the chosen token's log-prob <= the best
    assert len(got) == 3 and max(got.values()) >= ref - 1e-5
  assert [prompt[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
  # echo with generation: the prompt part is unchanged and the completion follows it
  g = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=0, temperature=0)
  plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=0, temperature=0)
  gl, n = g.choices[0].logprobs, len(ids)
  assert g.choices[0].text == prompt + plain.choices[0].text
  np.testing.assert_allclose(gl.token_logprobs[1:n], want, rtol=0, atol=1e-5)
  np.testing.assert_allclose(gl.token_logprobs[n:], plain.choices[0].logprobs.token_logprobs, rtol=0, atol=1e-5)
  assert gl.text_offset[n] == len(prompt)
  with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 0 only with echo
    client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_judge_sequence_logprob_through_jaxrl_serve_equals_trainer(tiny_sampler, server, trainer_logprobs):
  judge = rewards.Judge(base_url=server[0].url, model="tiny", max_retries=0)
  context, continuation = "User preference: brief\n\nQ: 7*6?\n", "A: 42"
  ids = tiny_sampler.tokenizer.encode(context + continuation)
  n_ctx = len(tiny_sampler.tokenizer.encode(context))
  want = float(np.sum(trainer_logprobs(ids)[n_ctx - 1:], dtype=np.float64))  # the continuation's tokens
  assert judge.sequence_logprob(context, continuation) == pytest.approx(want, abs=1e-5)


def test_echo_temperature_and_tokenizer_fingerprint(tiny_dir, tiny_sampler, client):
  """``echo_temperature`` (a jaxrl extension) scores token-id prompts at ``log_softmax(logits / T)``, as the
  trainer's recompute at ``rollout.temperature``; ``/v1/models`` lists the tokenizer's fingerprint."""
  ids = tiny_sampler.tokenizer.encode("Q: 12*3=?\nA: 36")
  graphdef, params = nnx.split(models.load_pretrained(tiny_dir, dtype="float32"))
  t = len(ids) - 1
  mb = {"tokens": jnp.asarray([ids[:-1]], jnp.int32), "targets": jnp.asarray([ids[1:]], jnp.int32),
        "positions": jnp.arange(t, dtype=jnp.int32)[None], "segment_ids": jnp.ones((1, t), jnp.int32)}
  want = np.asarray(make_logprob_fn(graphdef, temperature=0.7, chunk_size=16)(params, mb))[0]
  r = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0, logprobs=0,
                                extra_body={"echo_temperature": 0.7})
  np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs[1:], want, rtol=0, atol=1e-5)
  with pytest.raises(openai.BadRequestError, match="echo_temperature: needs echo"):
    client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"echo_temperature": 0.7})
  with pytest.raises(openai.BadRequestError, match="echo_temperature: value 0.0 is out of range"):
    client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0, extra_body={"echo_temperature": 0})
  entry = client.models.list().data[0]
  assert entry.tokenizer_fingerprint == models.tokenizer_fingerprint(tiny_sampler.tokenizer)
  assert entry.tokenizer_fingerprint.startswith("sha256:")
