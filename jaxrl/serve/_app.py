"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Request fields follow OpenAI's: ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``,
``n``, ``stop``, ``seed``, ``stream``, ``logprobs`` (chat: a bool with ``top_logprobs: k``; completions:
the int ``k``), plus ``top_k`` (vLLM's extension, sent by the ``openai`` client through ``extra_body``).
Unknown fields are ignored; a bad value is a 400 naming the field. Returned log-probs are the sampler's:
``log_softmax(logits / T)`` of the full distribution (``T = 1`` for greedy requests).

``/v1/completions`` with ``echo: true`` prepends the prompt to the text and, with ``logprobs``, the
prompt tokens to the log-prob fields (``token_logprobs`` is ``None`` for the first token, as in OpenAI's
API; ``text_offset`` indexes the returned text), as vLLM does; ``max_tokens: 0`` then scores the prompt
without generating. Prompt log-probs come from one forward pass of the backend's current weights at
temperature 1 (:mod:`jaxrl.serve._score`), or ``echo_temperature`` (a jaxrl extension: ``log_softmax(logits / T)``,
what an RL trainer sampling at ``T`` computes); ``echo`` is not served with ``stream``. ``/v1/models`` lists
the tokenizer's :func:`jaxrl.models.tokenizer_fingerprint` as ``tokenizer_fingerprint`` (a client checks that its
token ids mean the same here).

Streaming sends one server-sent event per generated token and ``data: [DONE]``. With the batch sampler
as backend the events are sent once the completion is generated; the event format is the same for a
backend that produces tokens incrementally. A token's text is what it completes
(:class:`jaxrl.sampling.IncrementalDetokenizer`): a character split over several byte-level tokens
arrives whole with its last token (the tokens before it carry ``""``), so the concatenated deltas equal
the non-streamed text exactly. Log-prob entries carry OpenAI's ``bytes`` (the token's raw bytes, from
:class:`jaxrl.sampling.TokenBytes`); a token that is part of a character is shown as
``"bytes:\\xe4\\xbd"`` (OpenAI's convention) and ``text_offset`` is where its character starts.

Refusals follow OpenAI's API, with the body ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``context_length_exceeded`` when prompt tokens + ``max_tokens`` (or ``max_completion_tokens``)
  exceed the server's context (``max_len``); the message names both numbers and the limit. Without
  ``max_tokens`` a chat completion may use the rest of the context (``max_len - prompt``, as in OpenAI's
  and vLLM's chat API) and a completion 16 tokens (the legacy API's default), capped at the context left.
* 404 ``model_not_found`` for a ``model`` other than the served name (a request without ``model`` is
  served, as vLLM does).
* 400 for an ``image_url`` part with a remote ``http(s)`` URL (send a ``data:`` URL or a local file), an
  unreadable image, or any image for a model without a vision tower (:mod:`jaxrl.serve._vision`)
* 400 for a message role other than ``system``, ``developer``, ``user``, ``assistant``, ``tool``
  (``developer`` is rendered as ``system`` unless the chat template names a developer role).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl import data as data_lib
from jaxrl import models
from jaxrl.sampling import IncrementalDetokenizer, TokenBytes
from jaxrl.serve import _vision
from jaxrl.serve._batcher import Batcher, GenRequest, RowResult
from jaxrl.serve._score import PromptScorer

__all__ = ["ServerThread", "create_app", "render_chat"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "interrupted": "length"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default


class RequestError(ValueError):
  """A 400 that names the request field (``param``) and, where OpenAI has one, its error ``code``."""

  def __init__(self, param: str, message: str, code: str | None = None):
    super().__init__(f"{param}: {message}")
    self.param, self.code = param, code


def render_chat(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
  """The prompt ids of a chat: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``."""
  ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 may return a BatchEncoding
    ids = ids["input_ids"]
  return [int(t) for t in ids]


def _num(body: dict, key: str, default, kind, ok) -> Any:
  value = body.get(key, default)
  if value is None:
    value = default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
    raise RequestError(key, f"expected a number, got {value!r}")
  value = kind(value)
  if not ok(value):
    raise RequestError(key, f"value {value!r} is out of range")
  return value


def _stops(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
    raise RequestError("stop", "expected a non-empty string or a list of up to 4 of them")
  return tuple(stop)


def _max_tokens(body: dict, prompts: list[list[int]], max_len: int, default: int | None, echo: bool) -> int:
  """The completion budget: the request's ``max_tokens`` (refused past the context), else ``default``
  (``None``: the rest of the context) capped at what the longest prompt leaves."""
  field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  where = "prompt" if "prompt" in body else "messages"
  longest = max(len(p) for p in prompts)
  left = max_len - longest
  if body.get(field) is None:
    if left < 1:
      raise RequestError(where, f"This model's maximum context length is {max_len} tokens. However, your {where} "
                         f"resulted in {longest} tokens, which leaves no room for a completion. Please reduce the "
                         f"length of the {where}.", "context_length_exceeded")
    return left if default is None else min(default, left)
  max_tokens = _num(body, field, 0, int, lambda v: v >= (0 if echo else 1))
  if longest + max_tokens > max_len:
    raise RequestError(where, f"This model's maximum context length is {max_len} tokens. However, you requested "
                       f"{longest + max_tokens} tokens ({longest} in the {where}, {max_tokens} in the completion). "
                       f"Please reduce the length of the {where} or completion.", "context_length_exceeded")
  return max_tokens


def _gen_request(body: dict, prompts: list[list[int]], top_logprobs: int, max_len: int, *,
                 default_max_tokens: int | None, echo: bool = False, echo_temperature: float = 1.0,
                 prompt_texts: tuple[str | None, ...] = (), images: tuple = ()) -> GenRequest:
  max_tokens = _max_tokens(body, prompts, max_len, default_max_tokens, echo)
  seed = body.get("seed")
  if seed is None:
    seed = random.getrandbits(31)
  return GenRequest(
      prompts=prompts, n=_num(body, "n", 1, int, lambda v: 1 <= v <= 128), max_tokens=max_tokens,
      temperature=_num(body, "temperature", 1.0, float, lambda v: 0 <= v <= 100),
      top_p=_num(body, "top_p", 1.0, float, lambda v: 0 < v <= 1), top_k=max(_num(body, "top_k", 0, int, lambda v: v >= -1), 0),
      seed=_num({"seed": seed}, "seed", 0, int, lambda v: True), stop=_stops(body), top_logprobs=top_logprobs,
      echo=echo, echo_temperature=echo_temperature, prompt_texts=tuple(prompt_texts), images=images)


def _starts(deltas: list[str], start: int = 0) -> list[int]:
  """Where each token's text starts (OpenAI's ``text_offset``), given the text each token completes."""
  return list(itertools.accumulate((len(d) for d in deltas), initial=start))[:-1]


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
  """OpenAI's error response: ``{"error": {"message", "type", "param", "code"}}``."""
  return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
                      status_code=status)


def _cut_stop(text: str, stop: tuple[str, ...]) -> str:
  cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
  return text[:min(cuts)] if cuts else text


class _Api:
  def __init__(self, tokenizer, batcher: Batcher, model_name: str, max_len: int, max_top_logprobs: int,
               scorer=None, image_config: data_lib.ImageConfig | None = None):
    self.tok, self.batcher, self.model_name, self.max_len = tokenizer, batcher, model_name, max_len
    self.max_top_logprobs, self.scorer = max_top_logprobs, scorer
    self.image_config = image_config or data_lib.ImageConfig()
    self.vision = getattr(getattr(batcher.backend, "cfg", None), "vision", None)  # a VLM's tower config
    self.created = int(time.time())
    self.token_bytes = TokenBytes(tokenizer)
    template = str(getattr(tokenizer, "chat_template", None) or "")
    self.developer_role = "developer" if "developer" in template else "system"  # a template may know it

  def piece(self, tid: int) -> str:
    """A token's display string (``"bytes:\\x.."`` for part of a character)."""
    return self.token_bytes.text(tid)

  def text(self, row: RowResult, stop) -> str:
    return _cut_stop(self.tok.decode(row.tokens, skip_special_tokens=True), stop)

  def deltas(self, tokens: list[int], text: str, *, skip_special_tokens: bool = True) -> list[str]:
    """The text each token completes (incremental detokenization), cut to ``text`` (the full decode, or its
    part before a stop string): ``"".join(deltas) == text``."""
    detok, out, sent = IncrementalDetokenizer(self.tok, skip_special_tokens=skip_special_tokens), [], 0
    for t, tid in enumerate(tokens):
      d = detok.step(tid) + (detok.flush() if t == len(tokens) - 1 else "")
      d = d[:max(len(text) - sent, 0)]
      sent += len(d)
      out.append(d)
    return out

  async def generate(self, req: GenRequest) -> list[list[RowResult]]:
    if req.max_tokens:
      rows = await asyncio.wrap_future(self.batcher.submit(req))
    else:  # echo only: no generation
      rows = [[RowResult([], [], [], [], "length", len(p)) for _ in range(req.n)] for p in req.prompts]
    if req.echo:  # one forward over the request's prompts, on the batcher's thread
      scorer, prompts, k, temp = self.scorer, req.prompts, req.top_logprobs, req.echo_temperature
      scored = await asyncio.wrap_future(self.batcher.call(lambda: scorer(prompts, k, temp)))
      rows = [[dataclasses.replace(r, prompt_logprobs=sc) for r in per] for per, sc in zip(rows, scored)]
    return rows

  def usage(self, req: GenRequest, rows: list[list[RowResult]]) -> dict:
    prompt = sum(len(p) for p in req.prompts)
    completion = sum(len(r.tokens) for per in rows for r in per)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

  # -- chat ----------------------------------------------------------------------------------------

  def chat_request(self, body: dict) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
      raise RequestError("messages", "expected a non-empty list of {role, content} objects")
    msgs = []
    for i, m in enumerate(messages):
      if m["role"] not in _ROLES:
        raise RequestError(f"messages.[{i}].role", f"{m['role']!r} is not one of {', '.join(map(repr, _ROLES))}")
      content = m.get("content")
      if isinstance(content, list) and _vision.has_image_parts([m]):  # kept whole for encode_image_chat
        msgs.append({"role": self.developer_role if m["role"] == "developer" else m["role"], "content": content})
        continue
      if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
      if not isinstance(content, str):
        raise RequestError("messages", f"content of a {m['role']!r} message must be text")
      msgs.append({"role": self.developer_role if m["role"] == "developer" else m["role"], "content": content})
    k = 0
    if body.get("logprobs"):
      k = _num(body, "top_logprobs", 0, int, lambda v: 0 <= v <= self.max_top_logprobs)
    elif body.get("top_logprobs"):
      raise RequestError("top_logprobs", "needs logprobs: true")
    if _vision.has_image_parts(msgs):
      try:
        vl = _vision.encode_image_chat(self.tok, msgs, images=self.image_config, vision=self.vision)
      except _vision.ImageRequestError as e:
        raise RequestError(e.param, str(e)) from None
      return _gen_request(body, [vl["tokens"].tolist()], k, self.max_len, default_max_tokens=None, images=(vl,))
    return _gen_request(body, [render_chat(self.tok, msgs)], k, self.max_len, default_max_tokens=None)

  def chat_logprobs(self, row: RowResult, k: int, sl=slice(None)) -> dict:
    content = []
    ids, lps = row.tokens[sl], row.logprobs[sl]
    tops_i, tops_v = (row.top_ids[sl], row.top_logprobs[sl]) if k else ([[]] * len(ids), [[]] * len(ids))
    entry = lambda tid, lp: {"token": self.piece(tid), "logprob": lp, "bytes": list(self.token_bytes(tid))}
    for tid, lp, ti, tv in zip(ids, lps, tops_i, tops_v):
      content.append({**entry(tid, lp), "top_logprobs": [entry(a, v) for a, v in zip(ti, tv)]})
    return {"content": content}

  def chat_response(self, body: dict, req: GenRequest, rows: list[list[RowResult]]) -> dict:
    want = bool(body.get("logprobs"))
    choices = [{"index": j, "message": {"role": "assistant", "content": self.text(r, req.stop)},
                "logprobs": self.chat_logprobs(r, req.top_logprobs) if want else None,
                "finish_reason": _FINISH[r.finish_reason]} for j, r in enumerate(rows[0])]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": self.usage(req, rows)}

  def chat_stream(self, body: dict, req: GenRequest, rows: list[list[RowResult]]) -> Iterator[str]:
    cid, created, want = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), bool(body.get("logprobs"))

    def chunk(choices, **extra):
      return "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                    "model": self.model_name, "choices": choices, **extra}) + "\n\n"

    for j, r in enumerate(rows[0]):
      yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
      for t, delta in enumerate(self.deltas(r.tokens, self.text(r, req.stop))):
        lp = self.chat_logprobs(r, req.top_logprobs, slice(t, t + 1)) if want else None
        yield chunk([{"index": j, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}])
      yield chunk([{"index": j, "delta": {}, "logprobs": None, "finish_reason": _FINISH[r.finish_reason]}])
    if (body.get("stream_options") or {}).get("include_usage"):
      yield chunk([], usage=self.usage(req, rows))
    yield "data: [DONE]\n\n"

  # -- completions ---------------------------------------------------------------------------------

  def completion_request(self, body: dict) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
      prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
      raise RequestError("prompt", "expected a string, a list of strings, or token-id lists")
    ids = []
    for p in prompt:
      if isinstance(p, str):
        p = list(self.tok.encode(p, add_special_tokens=True))
      if not isinstance(p, list) or not p or not all(isinstance(t, int) and t >= 0 for t in p):
        raise RequestError("prompt", "each prompt must be non-empty text or token ids")
      ids.append(p)
    k = 0
    if body.get("logprobs") is not None:
      k = _num(body, "logprobs", 0, int, lambda v: 0 <= v <= self.max_top_logprobs)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
      raise RequestError("echo", f"expected a boolean, got {echo!r}")
    if echo and body.get("stream"):
      raise RequestError("echo", "not supported with stream")
    if echo and self.scorer is None:
      raise RequestError("echo", "this backend cannot score prompts")
    if body.get("echo_temperature") is not None and not echo:
      raise RequestError("echo_temperature", "needs echo: true")
    temp = _num(body, "echo_temperature", 1.0, float, lambda v: 0 < v <= 100)
    texts = tuple(p if isinstance(p, str) else None for p in prompt)
    return _gen_request(body, ids, k, self.max_len, default_max_tokens=_COMPLETION_DEFAULT_MAX_TOKENS, echo=echo,
                        echo_temperature=temp, prompt_texts=texts)

  def prompt_text(self, req: GenRequest, p: int) -> str:
    text = req.prompt_texts[p] if p < len(req.prompt_texts) else None
    return text if text is not None else self.tok.decode(req.prompts[p], skip_special_tokens=False)

  def prompt_offsets(self, req: GenRequest, p: int) -> list[int]:
    """Start of each prompt token in the echoed prompt text: the tokenizer's offset mapping of a text
    prompt (when it re-encodes to the same ids), else the running length of the decoded pieces."""
    ids, text = req.prompts[p], (req.prompt_texts[p] if p < len(req.prompt_texts) else None)
    if text is not None:
      try:
        enc = self.tok(text, add_special_tokens=True, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
          return [int(a) for a, _ in enc["offset_mapping"]]
      except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer has no offsets
        pass
    return _starts(self.deltas(ids, self.tok.decode(ids, skip_special_tokens=False), skip_special_tokens=False))

  def echo_logprobs(self, req: GenRequest, p: int, row: RowResult, k: int) -> dict:
    """The prompt's part of a completion's ``logprobs`` (the first token has none, as in OpenAI's API)."""
    ids, sc = req.prompts[p], row.prompt_logprobs
    top = [None] + [{self.piece(a): v for a, v in zip(ti, tv)} for ti, tv in zip(sc.top_ids, sc.top_logprobs)] \
        if k else [None] * len(ids)
    return {"tokens": [self.piece(t) for t in ids], "token_logprobs": [None] + list(sc.logprobs),
            "top_logprobs": top, "text_offset": self.prompt_offsets(req, p)}

  def completion_logprobs(self, row: RowResult, k: int, offsets: list[int], sl=slice(None)) -> dict:
    """OpenAI's completion ``logprobs`` of ``row.tokens[sl]``; ``offsets``: every token's ``text_offset``."""
    tokens = [self.piece(t) for t in row.tokens[sl]]
    top = [{self.piece(a): v for a, v in zip(ti, tv)} for ti, tv in zip(row.top_ids[sl], row.top_logprobs[sl])] \
        if k else [None] * len(tokens)
    return {"tokens": tokens, "token_logprobs": row.logprobs[sl], "top_logprobs": top, "text_offset": offsets[sl]}

  def completion_choices(self, body, req, rows):
    want = body.get("logprobs") is not None
    out = []
    for per in rows:
      for r in per:
        out.append((len(out), r, want))
    return out

  def completion_choice(self, i: int, req: GenRequest, p: int, r: RowResult, want: bool) -> dict:
    text, lp = self.text(r, req.stop), None
    deltas = self.deltas(r.tokens, text) if want else []
    if want:
      lp = self.completion_logprobs(r, req.top_logprobs, _starts(deltas))
    if req.echo:
      head = self.prompt_text(req, p)
      if want:
        gen = self.completion_logprobs(r, req.top_logprobs, _starts(deltas, len(head)))
        lp = {key: v + gen[key] for key, v in self.echo_logprobs(req, p, r, req.top_logprobs).items()}
      text = head + text
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": _FINISH[r.finish_reason]}

  def completion_response(self, body: dict, req: GenRequest, rows: list[list[RowResult]]) -> dict:
    per_prompt = [p for p, per in enumerate(rows) for _ in per]
    choices = [self.completion_choice(i, req, per_prompt[i], r, want)
               for i, r, want in self.completion_choices(body, req, rows)]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": self.usage(req, rows)}

  def completion_stream(self, body: dict, req: GenRequest, rows: list[list[RowResult]]) -> Iterator[str]:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices, **extra):
      return "data: " + json.dumps({"id": cid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "choices": choices, **extra}) + "\n\n"

    for i, r, want in self.completion_choices(body, req, rows):
      deltas = self.deltas(r.tokens, self.text(r, req.stop))
      offsets = _starts(deltas)
      for t, delta in enumerate(deltas):
        lp = self.completion_logprobs(r, req.top_logprobs, offsets, slice(t, t + 1)) if want else None
        yield chunk([{"index": i, "text": delta, "logprobs": lp, "finish_reason": None}])
      yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": _FINISH[r.finish_reason]}])
    if (body.get("stream_options") or {}).get("include_usage"):
      yield chunk([], usage=self.usage(req, rows))
    yield "data: [DONE]\n\n"


def create_app(backend, tokenizer=None, *, model_name: str = "jaxrl", max_batch_rows: int = 64,
               batch_wait_s: float = 0.01, max_top_logprobs: int = 20,
               image_config: data_lib.ImageConfig | None = None):
  """The FastAPI app serving ``backend`` (a :class:`jaxrl.sampling.Sampler` or a generate-compatible engine).

  Args:
    backend: has ``generate(...)`` like :meth:`jaxrl.sampling.Sampler.generate` and ``max_len``.
    tokenizer: a transformers tokenizer with a chat template (default ``backend.tokenizer``).
    model_name: the id listed by ``/v1/models``; a request naming another model is refused (404).
    max_batch_rows, batch_wait_s: see :class:`jaxrl.serve.Batcher`.
    max_top_logprobs: most ``top_logprobs`` a request may ask for (OpenAI's limit is 20; up to the
      vocabulary size lets a judge read the probability of every score token); capped at an
      :class:`jaxrl.sampling.Engine` backend's own ``max_top_logprobs``.
    image_config: a VLM backend's image processing (``jaxrl.data.ImageConfig.from_hf(checkpoint)``; default
      :class:`jaxrl.data.ImageConfig` ()): chat ``image_url`` parts (data URLs, local files) become its images.

  The app's ``state.batcher`` is the batching queue (``batch_sizes`` records each ``generate`` call).
  """
  tokenizer = tokenizer if tokenizer is not None else backend.tokenizer
  if tokenizer is None:
    raise ValueError("create_app: the backend has no tokenizer; pass tokenizer=")
  cap = getattr(backend, "max_top_logprobs", None)  # an Engine holds at most this many per token
  if cap is not None:
    max_top_logprobs = min(max_top_logprobs, cap)
  scorer = PromptScorer(backend) if hasattr(backend, "graphdef") and hasattr(backend, "params") else None
  batcher = Batcher(backend, max_batch_rows=max_batch_rows, batch_wait_s=batch_wait_s)
  api = _Api(tokenizer, batcher, model_name, backend.max_len, max_top_logprobs, scorer, image_config)
  fingerprint = models.tokenizer_fingerprint(tokenizer)
  @contextlib.asynccontextmanager
  async def lifespan(_app):
    yield
    batcher.close()

  app = FastAPI(title="jaxrl serve", lifespan=lifespan)
  app.state.batcher = batcher

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_request, exc: StarletteHTTPException):  # unknown route, wrong method: OpenAI's shape
    return _error(exc.status_code, str(exc.detail))

  async def handle(request: Request, make, respond, stream):
    try:
      body = await request.json()
    except ValueError:
      return _error(400, "the request body is not JSON")
    if not isinstance(body, dict):
      return _error(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
      return _error(404, f"The model `{model}` does not exist (this server serves `{model_name}`).", "model",
                   "model_not_found")
    try:
      req = make(body)
    except RequestError as e:
      return _error(400, str(e), e.param, e.code)
    try:
      rows = await api.generate(req)
    except ValueError as e:
      return _error(400, str(e))
    if body.get("stream"):
      return StreamingResponse(stream(body, req, rows), media_type="text/event-stream")
    return JSONResponse(respond(body, req, rows))

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await handle(request, api.chat_request, api.chat_response, api.chat_stream)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await handle(request, api.completion_request, api.completion_response, api.completion_stream)

  @app.get("/v1/models")
  async def list_models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": api.created,
                                        "owned_by": "jaxrl", "max_model_len": backend.max_len,
                                        "tokenizer_fingerprint": fingerprint}]}

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  return app


class ServerThread:
  """Runs an ASGI app with uvicorn on a background thread (tests, and RL runs that start their own judge).

  ``port=0`` picks a free port; :attr:`url` is ``http://host:port/v1`` once :meth:`start` returns.
  """

  def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    import uvicorn
    self.host = host
    self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))
    self.thread = threading.Thread(target=self.server.run, name="jaxrl-serve", daemon=True)
    self.port: int | None = None

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}/v1"

  def start(self, timeout_s: float = 60.0) -> ServerThread:
    self.thread.start()
    deadline = time.monotonic() + timeout_s
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"jaxrl serve: the server on {self.host} did not start within {timeout_s} s")
      time.sleep(0.02)
    self.port = self.server.servers[0].sockets[0].getsockname()[1]
    return self

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)

  def __enter__(self) -> ServerThread:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
