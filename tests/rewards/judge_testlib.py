"""A scripted fake OpenAI-compatible judge on 127.0.0.1 for fault tests.

The last user message picks the behaviour with a tag: ``[[ok:TEXT]]`` answers TEXT; ``[[429x2:TEXT]]``
answers 429 twice, then TEXT; ``[[500]]`` always 500; ``[[slow:S:TEXT]]`` sleeps S seconds first;
``[[lp:TEXT]]`` answers TEXT with top log-probs putting 0.5/0.25/0.25 on "7"/"8"/"x" at the first token.
With ``refuse_logprobs`` every request carrying ``logprobs`` gets LongCat's 400. ``calls[tag]`` counts
the requests that reached the server per tag.
"""

import asyncio
import collections
import math
import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jaxrl import serve


def _answer(text, top=None):
  choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "logprobs": None}
  if top is not None:
    choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None,
                                       "top_logprobs": [{"token": a, "logprob": v, "bytes": None} for a, v in alts]}
                                      for t, lp, alts in top]}
  return {"id": "x", "object": "chat.completion", "created": 0, "model": "fake", "choices": [choice],
          "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def fake_judge_app(*, refuse_logprobs: bool = False, calls=None):
  app = FastAPI()
  app.state.calls = calls if calls is not None else collections.Counter()
  app.state.bodies = []

  @app.post("/v1/chat/completions")
  async def chat(request: Request):
    body = await request.json()
    app.state.bodies.append(body)
    text = body["messages"][-1]["content"]
    m = re.search(r"\[\[(\w+)(?::([^\]]*))?\]\]", text)
    kind, arg = (m.group(1), m.group(2) or "") if m else ("ok", "Score: 5")
    tag = m.group(0) if m else "none"
    app.state.calls[tag] += 1
    if refuse_logprobs and body.get("logprobs"):
      return JSONResponse({"error": {"message": "logprobs is not supported", "type": "invalid_request_error"}},
                          status_code=400)
    if kind.startswith("429x"):
      if app.state.calls[tag] <= int(kind[4:]):
        return JSONResponse({"error": {"message": "rate limited"}}, status_code=429)
      return _answer(arg)
    if kind == "500":
      return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    if kind == "slow":
      secs, _, rest = arg.partition(":")
      await asyncio.sleep(float(secs))
      return _answer(rest)
    if kind == "lp":
      top = [(arg[:1] or "7", math.log(0.5), [("7", math.log(0.5)), ("8", math.log(0.25)), ("x", math.log(0.25))])]
      return _answer(arg, top if body.get("logprobs") else None)
    return _answer(arg)

  return app


def start_fake(**kw) -> serve.ServerThread:
  return serve.ServerThread(fake_judge_app(**kw), port=0).start()
