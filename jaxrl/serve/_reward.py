"""``jaxrl serve`` for a reward model: ``POST /v1/rewards`` scores (prompt, completion) pairs.

A directory with ``reward_head.safetensors`` (a Bradley–Terry reward model exported by ``jaxrl dpo``,
docs/pref.md) is served with :func:`create_reward_app` instead of the OpenAI generation routes. A request is
``{"prompt": [...], "completion": [...]}`` (equal-length lists; a prompt is a string or a chat-message list,
a completion a string) and the answer ``{"object": "list", "model", "rewards": [...]}``: each the
:meth:`jaxrl.pref.RewardModel.score` of the pair, computed on one worker thread (requests are scored one at a
time, each in batches of ``rows`` packed rows).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jaxrl import pref


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
  """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
  return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": None}}, status_code=status)


def _pairs(body: Any) -> tuple[list[Any], list[str]] | str:
  """``(prompts, completions)`` of a request body, or the one-line reason it is refused."""
  if not isinstance(body, dict):
    return "the request body must be a JSON object"
  prompts, completions = body.get("prompt"), body.get("completion")
  if not isinstance(prompts, list) or not isinstance(completions, list) or not prompts:
    return "'prompt' and 'completion' must be non-empty lists"
  if len(prompts) != len(completions):
    return f"'prompt' has {len(prompts)} entries, 'completion' {len(completions)}"
  if not all(isinstance(c, str) for c in completions):
    return "every 'completion' must be a string"
  return prompts, completions


def create_reward_app(rm: pref.RewardModel, *, model_name: str = "jaxrl-rm") -> FastAPI:
  """The FastAPI app serving ``rm``: ``POST /v1/rewards``, ``GET /v1/models``, ``GET /health``."""
  app = FastAPI(title="jaxrl serve (reward model)")
  lock = threading.Lock()  # one scoring call at a time (one jitted program, one set of device buffers)

  def score(prompts, completions) -> list[float]:
    with lock:
      return [float(v) for v in rm.score(prompts, completions)]

  @app.post("/v1/rewards")
  async def rewards(request: Request):
    try:
      body = await request.json()
    except ValueError:
      return _error(400, "the request body is not JSON")
    parsed = _pairs(body)
    if isinstance(parsed, str):
      return _error(400, parsed)
    model = body.get("model")
    if model is not None and model != model_name:
      return _error(404, f"The model `{model}` does not exist (this server serves `{model_name}`).", "model")
    try:
      values = await asyncio.to_thread(score, *parsed)
    except ValueError as e:  # an over-long pair, a malformed prompt (jaxrl.data.DataError)
      return _error(400, str(e))
    return {"object": "list", "model": model_name, "rewards": values}

  @app.get("/v1/models")
  async def list_models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "jaxrl",
                                        "max_model_len": rm.seq_len}]}

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  return app
