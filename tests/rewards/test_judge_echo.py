"""`Judge.sequence_logprob` (prompt log-probs through `/v1/completions` with `echo`) against a scripted
server, and AlignXplore's R_gen computed through it (eq. 6)."""

import collections

import pytest

pytest.importorskip("openai")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from jaxrl import rewards, serve  # noqa: E402


def _lp(prompt: str, i: int) -> float:
  """The scripted log-prob of character i: -0.5 after a preference description, else -1; 0.01·i apart."""
  return (-0.5 if prompt.startswith("User preference") else -1.0) - 0.01 * i


def _echo_app(calls):
  app = FastAPI()

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await request.json()
    calls["n"] += 1
    if not body.get("echo"):
      return JSONResponse({"error": {"message": "echo: not supported"}}, status_code=400)
    p = body["prompt"]  # one token per character
    lps = {"tokens": list(p), "token_logprobs": [None] + [_lp(p, i) for i in range(1, len(p))],
           "top_logprobs": None, "text_offset": list(range(len(p)))}
    return {"id": "x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": p + "!", "logprobs": lps, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(p), "completion_tokens": 1, "total_tokens": len(p) + 1}}
  return app


@pytest.fixture(scope="module")
def echo_server():
  calls = collections.Counter()
  with serve.ServerThread(_echo_app(calls), port=0) as srv:
    yield srv, calls


def test_sequence_logprob_sums_the_continuation_tokens(echo_server, tmp_path):
  srv, calls = echo_server
  judge = rewards.Judge(base_url=srv.url, model="m", max_retries=0, cache_path=str(tmp_path / "c.sqlite"))
  ctx, cont = "post\n", "yes!"
  expected = sum(_lp(ctx + cont, i) for i in range(len(ctx), len(ctx + cont)))
  before = calls["n"]
  assert judge.sequence_logprob(ctx, cont) == pytest.approx(expected, abs=1e-12)
  assert judge.sequence_logprob(ctx, cont) == pytest.approx(expected, abs=1e-12)  # from the cache
  assert calls["n"] - before == 1 and judge.stats["cache_hits"] == 1


def test_alignxplore_r_gen_through_echo_equals_eq6(echo_server):
  srv, _ = echo_server
  judge = {"base_url": srv.url, "model": "m", "max_retries": 0}
  completion = "<think>they like detail</think><preference>long answers</preference>"
  post, chosen, rejected = "Tell me about tea.", "Tea is a drink made from leaves.", "Tea."
  got = rewards.alignxplore_gen_reward("p", completion, post=post, chosen=chosen, rejected=rejected, logprob_fn=judge)
  lp = rewards.get_judge(judge).sequence_logprob
  ctx_d = f"User preference: long answers\n\n{post}"
  want = rewards.alignxplore_r_gen(lp(ctx_d, chosen), lp(post, chosen), lp(ctx_d, rejected), lp(post, rejected), True)
  assert got.value == want == 1.0  # the longer chosen answer gains more from the description
  w_given_d = sum(_lp(ctx_d + chosen, i) for i in range(len(ctx_d), len(ctx_d + chosen)))
  assert got.info["logprobs"][0] == pytest.approx(w_given_d)


def test_a_server_without_echo_is_a_judge_error(tmp_path):
  app = FastAPI()

  @app.post("/v1/completions")
  async def completions(request: Request):  # a server without echo (jaxrl serve has it: tests/serve/test_echo.py)
    return JSONResponse({"error": {"message": "echo: not supported", "param": "echo"}}, status_code=400)
  with serve.ServerThread(app, port=0) as srv:
    judge = rewards.Judge(base_url=srv.url, model="m", max_retries=0)
    with pytest.raises(rewards.JudgeError, match="http_400"):
      judge.sequence_logprob("a", "b")
