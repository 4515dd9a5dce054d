"""An OpenAI-compatible judge client: provider table, HTTP with retries, bounded concurrency, accounting.

A `Judge` sends chat requests through the official ``openai`` package to any OpenAI-compatible server
(`jaxrl serve`, vLLM, OpenAI, Qwen's DashScope compatible mode, LongCat ...). What happens to a request:

* at most ``max_concurrency`` requests are in flight per `Judge` (a semaphore shared by all threads);
* a 429, a 5xx, a timeout or a dropped connection is retried up to ``max_retries`` times with
  exponential backoff (``backoff_s · 2^attempt``, capped at ``backoff_max_s``, with ±25 % jitter);
  anything else (400, 401, 404 ...) fails at once;
* a provider that refuses ``logprobs`` (a 400 whose message names it, or a profile that says so, e.g.
  ``longcat``) is asked again without them, and the judge stays text-only from then on (``degraded``);
* every completed response is stored in an SQLite cache keyed by the SHA-256 of the request (base URL,
  model and body; never the key), so a repeated request costs nothing and a restarted run re-reads it;
* `stats` counts requests, HTTP calls, retries, cache hits, errors, tokens and cost.

With ``launch`` (`JudgeLaunch`) the judge starts `jaxrl serve` of a local model directory itself, in a
subprocess on a free loopback port, and `close_judges` (called by ``RLTrainer.close``) stops it.
`Judge.sequence_logprob` reads prompt log-probs through ``/v1/completions`` with ``echo`` (servers that
support it: `jaxrl serve`, vLLM, OpenAI's legacy completions).

A request that still fails raises `JudgeError`; a response without a readable score raises
`JudgeScoreError`. Inside a `RewardRunner` both become that sample's ``error_value`` with the reason
recorded and counted against ``max_errors``: a sample is never dropped and never scored twice.

The API key is read from the environment variable named by ``api_key_env`` and is never logged,
cached or put in an error message.

The judge is split over four modules: this client (providers, config, `Judge`, the per-process judge
registry), `_judge_cache` (SQLite), `_judge_parse` (the response record, errors, score parsing) and
`_judge_launch` (the `jaxrl serve` subprocess).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxrl import _extras
from jaxrl.config import from_dict
from jaxrl.rewards._judge_cache import ResponseCache, request_key
from jaxrl.rewards._judge_launch import JudgeLaunch, ServeProcess
from jaxrl.rewards._judge_parse import (
  JudgeError,
  JudgeResponse,
  JudgeScoreError,
  expected_score,
  parse_choice,
  parse_score,
)

__all__ = ["PROVIDERS", "Judge", "JudgeConfig", "ProviderProfile", "close_judges", "get_judge"]


@dataclasses.dataclass(frozen=True)
class ProviderProfile:
  """What an OpenAI-compatible provider accepts."""

  base_url: str | None
  """Default base URL (``None``: must be given)."""
  logprobs: bool = True
  """Whether ``logprobs``/``top_logprobs`` may be requested."""
  max_top_logprobs: int | None = 20
  """Most ``top_logprobs`` the provider returns (OpenAI: 20); None: no client-side cap (the server's own)."""


PROVIDERS: dict[str, ProviderProfile] = {
  "openai": ProviderProfile("https://api.openai.com/v1"),
  # DashScope's OpenAI-compatible mode: the base URL works as is with the openai client.
  "qwen": ProviderProfile("https://dashscope.aliyuncs.com/compatible-mode/v1"),
  # LongCat rejects `logprobs` (per the API notes): text-only scoring.
  "longcat": ProviderProfile("https://api.longcat.chat/openai/v1", logprobs=False),
  "jaxrl": ProviderProfile(None, max_top_logprobs=None),  # `jaxrl serve --max-top-logprobs`
  "vllm": ProviderProfile(None, max_top_logprobs=None),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """Where the judge is and how to call it. Unset ``base_url``/``model`` come from the environment."""

  provider: str = "jaxrl"
  "A key of PROVIDERS: what the server accepts (``longcat`` is text-only)."
  base_url: str | None = None
  "e.g. ``http://127.0.0.1:8000/v1``; default ``$JAXRL_JUDGE_BASE_URL``, else the provider's URL."
  model: str | None = None
  "Model name sent with each request; default ``$JAXRL_JUDGE_MODEL``, else ``judge``."
  api_key_env: str = "JAXRL_JUDGE_API_KEY"
  "Name of the environment variable holding the API key (the key itself never goes in a config)."
  max_concurrency: int = 8
  "Requests in flight at once (per process)."
  timeout_s: float = 60.0
  "Per-attempt timeout."
  max_retries: int = 4
  "Retries after a 429, 5xx, timeout or connection error."
  backoff_s: float = 0.5
  backoff_max_s: float = 8.0
  cache_path: str | None = None
  "SQLite file of cached responses; None: no cache."
  max_tokens: int = 256
  temperature: float = 0.0
  seed: int | None = 0
  top_logprobs: int = 0
  "Top log-probs per token requested by plain `chat` calls (0: none)."
  score_top_logprobs: int = 20
  ("Top log-probs requested for logprob (expected-score) scoring; the score tokens must be among them. "
   "OpenAI returns at most 20; `jaxrl serve --max-top-logprobs V` can return the whole vocabulary.")
  prompt_price_per_1k: float = 0.0
  "Cost per 1000 prompt tokens (for the `cost` counter)."
  completion_price_per_1k: float = 0.0
  launch: JudgeLaunch | None = None
  "Start `jaxrl serve` of a local model for this judge (then leave ``base_url`` unset)."

  def __post_init__(self):
    if self.launch is not None and self.base_url is not None:
      raise ValueError("judge.base_url: leave it unset with judge.launch (the launched server's URL is used)")
    if self.provider not in PROVIDERS:
      raise ValueError(f"judge.provider: {self.provider!r} is not one of {sorted(PROVIDERS)}")
    for key in ("max_concurrency", "max_tokens"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        raise ValueError(f"judge.{key}: must be a positive int, got {getattr(self, key)!r}")
    if not isinstance(self.max_retries, int) or self.max_retries < 0:
      raise ValueError(f"judge.max_retries: must be an int >= 0, got {self.max_retries!r}")
    for key in ("timeout_s", "backoff_s", "backoff_max_s"):
      if not getattr(self, key) > 0:
        raise ValueError(f"judge.{key}: must be > 0, got {getattr(self, key)!r}")
    if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
      raise ValueError(f"judge.top_logprobs: must be an int >= 0, got {self.top_logprobs!r}")
    if not isinstance(self.score_top_logprobs, int) or self.score_top_logprobs < 1:
      raise ValueError(f"judge.score_top_logprobs: must be an int >= 1, got {self.score_top_logprobs!r}")

  def resolved_base_url(self) -> str:
    url = self.base_url or os.environ.get("JAXRL_JUDGE_BASE_URL") or PROVIDERS[self.provider].base_url
    if not url:
      raise ValueError("judge.base_url: not set (give judge.base_url or $JAXRL_JUDGE_BASE_URL)")
    return url.rstrip("/")

  def resolved_model(self) -> str:
    return self.model or os.environ.get("JAXRL_JUDGE_MODEL") or "judge"


_STATS = ("requests", "http_calls", "retries", "cache_hits", "errors", "degraded", "prompt_tokens",
          "completion_tokens")


class Judge:
  """A thread-safe judge client (see the module docstring). Share one per process with `get_judge`."""

  def __init__(self, config: JudgeConfig | None = None, **kwargs):
    openai = _extras.require("openai")  # optional (the serve extra): imported only when a judge is built

    self.config = config = config or JudgeConfig(**kwargs)
    self.profile = PROVIDERS[config.provider]
    self.model = config.resolved_model()
    self.server: ServeProcess | None = None
    if config.launch is not None:
      self.server = ServeProcess(config.launch, served_name=self.model)
      self.base_url = self.server.url
      # Cache keys name the served directory, not the (per-run) port, so a rerun reuses the cache.
      self._cache_url = "launch:" + os.path.abspath(config.launch.model)
    else:
      self.base_url = self._cache_url = config.resolved_base_url()
    self.logprobs_ok = self.profile.logprobs
    self._openai = openai
    self._client = openai.OpenAI(base_url=self.base_url, api_key=os.environ.get(config.api_key_env) or "none",
                                 max_retries=0, timeout=config.timeout_s)
    self._slots = threading.BoundedSemaphore(config.max_concurrency)
    self._lock = threading.Lock()
    self.stats: dict[str, float] = {k: 0 for k in _STATS} | {"cost": 0.0}
    self._cache = ResponseCache(config.cache_path)

  def close(self) -> None:
    """Stops the judge's launched server (if any); the client stays usable against other servers."""
    if self.server is not None:
      self.server.stop()

  def __repr__(self) -> str:  # no key here, ever
    return f"Judge(base_url={self.base_url!r}, model={self.model!r}, provider={self.config.provider!r})"

  # ------------------------------------------------------------------------------------------------

  def chat(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = None,
           top_logprobs: int | None = None, temperature: float | None = None,
           seed: int | None = None) -> JudgeResponse:
    """One chat completion (cached, retried, degraded as needed). Raises `JudgeError`.

    ``seed`` overrides the config's for this request (part of the cache key: repeated sampling rounds
    at a temperature above 0 pass distinct seeds so they are distinct requests)."""
    c = self.config
    k = c.top_logprobs if top_logprobs is None else int(top_logprobs)
    body: dict[str, Any] = {"model": self.model, "messages": [dict(m) for m in messages],
                            "max_tokens": int(max_tokens or c.max_tokens),
                            "temperature": c.temperature if temperature is None else float(temperature)}
    if seed is not None or c.seed is not None:
      body["seed"] = int(seed if seed is not None else c.seed)
    if k and self.logprobs_ok:
      cap = self.profile.max_top_logprobs
      body["logprobs"], body["top_logprobs"] = True, k if cap is None else min(k, cap)
    self._count("requests")
    key = request_key(self._cache_url, body)
    hit = self._cache.get(key)
    if hit is not None:
      self._count("cache_hits")
      return dataclasses.replace(hit, cached=True)
    try:
      resp = self._call(body)
    except JudgeError:
      self._count("errors")
      raise
    self._cache.put(key, resp)
    return resp

  def sequence_logprob(self, context: str, continuation: str) -> float:
    """``log P(continuation | context)``: the summed prompt log-probs of the continuation's tokens, from one
    ``/v1/completions`` request with ``echo: true, logprobs: 0, max_tokens: 1`` over ``context +
    continuation`` (cached and retried like `chat`). Servers that return prompt log-probs with ``echo``
    (`jaxrl serve`, vLLM, OpenAI's legacy completions) serve it; one that does not answers a 400
    (→ `JudgeError`). ``max_tokens: 1`` rather than 0 because some servers reject 0 (the generated
    token's offset lies past the text and is not counted).

    Tokens whose ``text_offset`` lies in ``[len(context), len(context + continuation))`` count, so the
    context should end at a token boundary (e.g. a newline). Raises `JudgeError` (``malformed``) when the
    answer has no prompt log-probs.
    """
    text = context + continuation
    body: dict[str, Any] = {"model": self.model, "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 1,
                            "temperature": 0.0}
    self._count("requests")
    key = request_key(self._cache_url, "completions", body)
    hit = self._cache.get(key)
    if hit is None:
      try:
        hit = self._call(body, endpoint="completions")
      except JudgeError:
        self._count("errors")
        raise
      self._cache.put(key, hit)
    else:
      self._count("cache_hits")
    total, counted = 0.0, 0
    for off, lp in zip(hit.tokens or [], hit.top_logprobs or []):
      if len(context) <= int(off) < len(text):
        if lp.get("logprob") is None:
          raise JudgeError("malformed", f"no log-prob for the continuation token at offset {off}")
        total += float(lp["logprob"])
        counted += 1
    if not counted:
      raise JudgeError("malformed", "the echo response has no log-probs for the continuation's tokens")
    return total

  def _call(self, body: dict[str, Any], *, endpoint: Literal["chat", "completions"] = "chat") -> JudgeResponse:
    c, oa = self.config, self._openai
    attempt = 0
    while True:
      try:
        with self._slots:
          self._count("http_calls")
          if endpoint == "completions":
            return self._parse_echo(self._client.completions.create(**body))
          raw = self._client.chat.completions.create(**body)
        return self._parse(raw)
      except oa.BadRequestError as e:
        if endpoint == "chat" and "logprobs" in body and "logprob" in str(e).lower():
          # The provider refuses log-probs: degrade to text-only scoring for good.
          with self._lock:
            self.logprobs_ok = False
          self._count("degraded")
          body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
          continue
        raise JudgeError("http_400", _short(e)) from None
      except (oa.RateLimitError, oa.InternalServerError, oa.APITimeoutError, oa.APIConnectionError) as e:
        reason = _reason(e)
        if attempt >= c.max_retries:
          raise JudgeError(reason, f"gave up after {attempt + 1} attempts: {_short(e)}") from None
        self._count("retries")
        delay = min(c.backoff_s * 2**attempt, c.backoff_max_s) * random.uniform(0.75, 1.25)
        attempt += 1
        time.sleep(delay)
      except oa.APIStatusError as e:
        raise JudgeError(f"http_{e.status_code}", _short(e)) from None

  def _parse_echo(self, raw) -> JudgeResponse:
    """An echo completion as a JudgeResponse: ``tokens`` holds the text offsets and ``top_logprobs`` one
    ``{"logprob": lp}`` per token (the first prompt token has none), so the cache stores it as is."""
    if not getattr(raw, "choices", None) or getattr(raw.choices[0], "logprobs", None) is None:
      raise JudgeError("malformed", "the echo response has no choices with logprobs")
    lp = raw.choices[0].logprobs
    offsets, values = list(lp.text_offset or []), list(lp.token_logprobs or [])
    if len(offsets) != len(values):
      raise JudgeError("malformed", "the echo response's text_offset and token_logprobs differ in length")
    pt, _ = self._account(raw, completion=False)
    return JudgeResponse(text=raw.choices[0].text or "", tokens=[str(o) for o in offsets],
                         top_logprobs=[{"logprob": v} for v in values], prompt_tokens=pt)

  def _parse(self, raw) -> JudgeResponse:
    if not getattr(raw, "choices", None):
      raise JudgeError("malformed", "the response has no choices")
    ch = raw.choices[0]
    text = (ch.message.content if ch.message is not None else None) or ""
    tops = tokens = None
    lp = getattr(ch, "logprobs", None)
    if lp is not None and getattr(lp, "content", None):
      tokens, tops = [t.token for t in lp.content], []
      for t in lp.content:
        top = {a.token: float(a.logprob) for a in (t.top_logprobs or [])}
        top.setdefault(t.token, float(t.logprob))  # the chosen token counts even when outside the top k
        tops.append(top)
    pt, ct = self._account(raw)
    return JudgeResponse(text=text, top_logprobs=tops, tokens=tokens, prompt_tokens=pt, completion_tokens=ct)

  def _account(self, raw, *, completion: bool = True) -> tuple[int, int]:
    """Adds a response's token usage and its cost to `stats`; returns (prompt, completion) tokens.
    ``completion=False`` (echo log-prob requests) counts the prompt tokens only."""
    usage = getattr(raw, "usage", None)
    pt = int(getattr(usage, "prompt_tokens", 0) or 0)
    ct = int(getattr(usage, "completion_tokens", 0) or 0) if completion else 0
    with self._lock:
      self.stats["prompt_tokens"] += pt
      self.stats["completion_tokens"] += ct
      self.stats["cost"] += pt / 1000 * self.config.prompt_price_per_1k + ct / 1000 * self.config.completion_price_per_1k
    return pt, ct

  def _count(self, key: str) -> None:
    with self._lock:
      self.stats[key] += 1

  # -- scoring -------------------------------------------------------------------------------------

  def score(self, messages, *, lo: int = 0, hi: int = 9, mode: Literal["auto", "text", "logprobs"] = "auto",
            max_tokens: int | None = None) -> tuple[float, dict[str, Any]]:
    """A score in ``[lo, hi]`` for a judge prompt that asks for one.

    ``logprobs`` (or ``auto`` when the provider allows log-probs): the expected score over the score
    tokens' top log-probs (`expected_score`); a response without them falls back to the text.
    ``text``: `parse_score` of the answer. Raises `JudgeScoreError` when neither gives a score.
    """
    want_lp = mode == "logprobs" or (mode == "auto" and self.logprobs_ok)
    resp = self.chat(messages, max_tokens=max_tokens, top_logprobs=self.config.score_top_logprobs if want_lp else 0)
    if want_lp and resp.top_logprobs:
      s = expected_score(resp.top_logprobs, lo=lo, hi=hi)
      if s is not None:
        return s, {"source": "logprobs", "text": resp.text[:200]}
    s = parse_score(resp.text, hi=hi)
    if s is None or not lo <= s <= hi:
      raise JudgeScoreError(resp.text)
    return s, {"source": "text", "text": resp.text[:200]}

  def choice(self, messages, *, options: str = "AB", max_tokens: int | None = None,
             mode: Literal["auto", "text", "logprobs"] = "auto") -> tuple[dict[str, float], dict[str, Any]]:
    """Probabilities of the letter options (``{"A": pA, "B": pB}``), from log-probs or the text's letter."""
    want_lp = mode == "logprobs" or (mode == "auto" and self.logprobs_ok)
    resp = self.chat(messages, max_tokens=max_tokens, top_logprobs=self.config.score_top_logprobs if want_lp else 0)
    if want_lp and resp.top_logprobs:
      for top in resp.top_logprobs:
        probs = {o: sum(math.exp(v) for t, v in top.items() if t.strip() == o) for o in options}
        total = sum(probs.values())
        if total > 0:
          return {o: p / total for o, p in probs.items()}, {"source": "logprobs", "text": resp.text[:200]}
    letter = parse_choice(resp.text, options)
    if letter is None:
      raise JudgeScoreError(resp.text)
    return {o: float(o == letter) for o in options}, {"source": "text", "text": resp.text[:200]}


def _reason(e) -> str:
  status = getattr(e, "status_code", None)
  if status is not None:
    return f"http_{status}"
  return "timeout" if "Timeout" in type(e).__name__ else "connection"


def _short(e) -> str:
  return re.sub(r"\s+", " ", str(e))[:200]



# The only process-global state of the judge: one `Judge` per config (so every reward call of a run shares
# one concurrency limit, cache and set of counters), the configs whose server failed to launch (not
# retried per sample), and the lock guarding both. `close_judges` empties them for launched judges.
_JUDGES: dict[str, Judge] = {}
_LAUNCH_FAILED: dict[str, JudgeError] = {}
_JUDGES_LOCK = threading.Lock()


def close_judges() -> int:
  """Stops every judge server this process launched (``judge.launch``) and forgets those judges, so a
  later `get_judge` starts a fresh server; returns how many were stopped. ``RLTrainer.close`` calls it."""
  with _JUDGES_LOCK:
    launched = {k: j for k, j in _JUDGES.items() if j.server is not None}
    for k, j in launched.items():
      j.close()
      del _JUDGES[k]
    _LAUNCH_FAILED.clear()
  return len(launched)


def get_judge(spec: Judge | JudgeConfig | Mapping[str, Any] | None) -> Judge:
  """The process-wide `Judge` for a config (dict from YAML, `JudgeConfig` or a `Judge`), built once, so
  every reward call of a run shares one concurrency limit, cache and set of counters."""
  if isinstance(spec, Judge):
    return spec
  if spec is None:
    cfg = JudgeConfig()
  elif isinstance(spec, JudgeConfig):
    cfg = spec
  elif isinstance(spec, Mapping):
    cfg = from_dict(JudgeConfig, dict(spec), prefix="judge")
  else:
    raise TypeError(f"judge: expected a dict, JudgeConfig or Judge, got {type(spec).__name__}")
  key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
  with _JUDGES_LOCK:
    if key in _LAUNCH_FAILED:  # a judge server that did not start is not started again for every sample
      raise _LAUNCH_FAILED[key]
    if key not in _JUDGES:
      try:
        _JUDGES[key] = Judge(cfg)
      except JudgeError as e:
        if e.reason == "launch":
          _LAUNCH_FAILED[key] = e
        raise
    return _JUDGES[key]
