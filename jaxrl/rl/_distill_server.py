"""A distillation teacher behind ``jaxrl serve`` (``distill.server``): the teacher's log-probs of the student's
sampled tokens, read as ``/v1/completions`` echo prompt log-probs.

Each sample's exact token ids, ``prompt_ids + response[:n]``, are sent as a token-id prompt (OpenAI's API allows
a list of ints) with ``max_tokens: 0, echo: true, logprobs: 0`` and ``echo_temperature: rollout.temperature``
(a ``jaxrl serve`` extension: ``log_softmax(logits / T)``, what the trainer's log-prob program computes for the
in-process teacher and the student). The echoed ``token_logprobs[t] = log π_teacher(ids[t] | ids[:t])``, so
response token ``k`` of a prompt of ``P`` tokens is at ``t = P + k``. ``prompts_per_request`` samples go in one
request (the server scores them in one forward), at most ``max_concurrency`` requests in flight.

Token ids mean the same on both sides only with the same tokenizer: at start the server's
``tokenizer_fingerprint`` (``/v1/models``; :func:`jaxrl.models.tokenizer_fingerprint`) must equal the student's,
or the trainer refuses naming both. Only ``mode: reverse_kl`` (GKD needs the full distributions). A request that
times out, loses its connection or is answered 429 or 5xx is retried up to ``max_retries`` times with exponential
backoff (``backoff_s · 2^attempt``, at most ``backoff_max_s``, ±25 % jitter; :attr:`ServerTeacher.retries` counts
them, the trainer logs ``distill/server_retries``); any other failure, or the last retry's, raises with the URL, the
samples it carried and the HTTP status and server message. No sample is ever dropped.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxrl import _extras, models


class ServerTeacher:
  """The teacher of ``distill.server`` (module docstring): :meth:`logprobs` of a rollout's response tokens.

  Args:
    cfg: the :class:`jaxrl.rl.TeacherServerConfig`.
    student_tokenizer: the student's tokenizer (its fingerprint must equal the server's).
    student: the student's source, for messages (:func:`jaxrl.rl._distill.describe_source`).
    temperature: ``rollout.temperature``; the log-probs are ``log_softmax(logits / temperature)``.
  """

  remote = True  # the trainer reads the teacher's log-probs from the packed batch, not from a program on its mesh

  def __init__(self, cfg, *, student_tokenizer, student: str, temperature: float):
    httpx = _extras.require("httpx")
    self.cfg, self.temperature, self._httpx = cfg, float(temperature), httpx
    self.base_url = cfg.base_url.rstrip("/")
    headers = {}
    if cfg.api_key_env is not None:
      key = os.environ.get(cfg.api_key_env)
      if not key:
        raise ValueError(f"distill.server.api_key_env: the environment variable {cfg.api_key_env} is not set")
      headers["Authorization"] = f"Bearer {key}"
    self.retries = 0  # retried requests so far (module docstring)
    self._lock = threading.Lock()
    self.client = httpx.Client(timeout=cfg.timeout_s, headers=headers,
                               limits=httpx.Limits(max_connections=cfg.max_concurrency))
    self.check_tokenizer(models.tokenizer_fingerprint(student_tokenizer), student)

  def close(self) -> None:
    self.client.close()

  def _call(self, method: str, route: str, what: str, body: dict | None = None) -> dict:
    """The JSON answer of ``method base_url+route``, retried as the module docstring says; raises
    ``RuntimeError`` naming the request (``what``), the URL and the HTTP status with the server's message."""
    url, cfg = self.base_url + route, self.cfg
    for attempt in range(cfg.max_retries + 1):
      tries = f" (gave up after {attempt + 1} tries)" if attempt else ""
      try:
        r = self.client.request(method, url, json=body)
      except self._httpx.TransportError as e:  # timeouts, refused or dropped connections
        failure, transient = f"failed: {type(e).__name__}: {e}", True
      except self._httpx.HTTPError as e:
        raise RuntimeError(f"distill.server: {method} {url} ({what}) failed: {type(e).__name__}: {e}") from e
      else:
        if r.status_code == 200:
          try:
            return r.json()
          except ValueError as e:
            raise RuntimeError(f"distill.server: {method} {url} ({what}) answered HTTP 200 with no JSON body") from e
        try:
          message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
          message = r.text[:300]
        failure, transient = f"answered HTTP {r.status_code}: {message}", r.status_code == 429 or r.status_code >= 500
      if not transient or attempt == cfg.max_retries:
        raise RuntimeError(f"distill.server: {method} {url} ({what}) {failure}{tries}")
      with self._lock:
        self.retries += 1
      time.sleep(min(cfg.backoff_s * 2**attempt, cfg.backoff_max_s) * random.uniform(0.75, 1.25))
    raise AssertionError("unreachable")

  def check_tokenizer(self, fingerprint: str, student: str) -> None:
    """Refuses a server that does not serve ``cfg.model`` or whose tokenizer fingerprint differs from the
    student's (``fingerprint``, from :func:`jaxrl.models.tokenizer_fingerprint`)."""
    where = f"{self.base_url}/models"
    listed = self._call("GET", "/models", "the teacher's tokenizer fingerprint").get("data") or []
    entry = next((m for m in listed if isinstance(m, dict) and m.get("id") == self.cfg.model), None)
    if entry is None:
      raise ValueError(f"distill.server.model: {self.cfg.model!r} is not served at {where} (it lists "
                       f"{[m.get('id') for m in listed if isinstance(m, dict)]})")
    theirs = entry.get("tokenizer_fingerprint")
    if theirs is None:
      raise ValueError(f"distill.server: {where} reports no tokenizer_fingerprint for {self.cfg.model!r}, so the "
                       "shared tokenizer cannot be checked; serve the teacher with jaxrl serve")
    if theirs != fingerprint:
      raise ValueError(f"distill.server: the teacher's tokenizer differs from the student's (fingerprints {theirs} "
                       f"vs {fingerprint}): student {student}, teacher {self.cfg.model!r} at {self.base_url}. "
                       "On-policy distillation needs a shared tokenizer")

  def _score(self, job: tuple[list[int], list[list[int]], list[int]]) -> list[list[float]]:
    """The teacher log-probs of the response tokens of one request's sequences (``(sample indices, token ids,
    prompt lengths)``)."""
    idx, seqs, prompt_lens = job
    what = f"rollout samples {idx[0]}..{idx[-1]}"
    body = {"model": self.cfg.model, "prompt": seqs, "max_tokens": 0, "echo": True, "logprobs": 0,
            "echo_temperature": self.temperature}
    choices = self._call("POST", "/completions", what, body).get("choices")
    if not isinstance(choices, list) or len(choices) != len(seqs):
      raise RuntimeError(f"distill.server: POST {self.base_url}/completions ({what}) answered "
                         f"{len(choices) if isinstance(choices, list) else 'no'} choices for {len(seqs)} prompts")
    out = []
    for c, ids, p in zip(sorted(choices, key=lambda c: c.get("index", 0)), seqs, prompt_lens):
      lp = (c.get("logprobs") or {}).get("token_logprobs")
      if not isinstance(lp, list) or len(lp) != len(ids) or any(x is None for x in lp[p:]):
        raise RuntimeError(f"distill.server: POST {self.base_url}/completions ({what}) echoed "
                           f"{len(lp) if isinstance(lp, list) else 'no'} prompt log-probs for a prompt of {len(ids)} "
                           "tokens (is echo with logprobs supported?)")
      out.append([float(x) for x in lp[p:]])  # response token k is ids[p + k]
    return out

  def logprobs(self, rollout) -> np.ndarray:
    """``[N, L]`` float32: ``log π_teacher`` of each sampled response token at ``temperature`` (0 past a sample's
    length), for the samples of ``rollout`` (a :class:`jaxrl.rl.Rollout`)."""
    out = np.zeros(rollout.tokens.shape, np.float32)
    todo = [i for i in range(rollout.num_samples) if rollout.lengths[i] > 0]
    per = self.cfg.prompts_per_request
    jobs = []
    for j in range(0, len(todo), per):
      idx = todo[j:j + per]
      seqs = [[int(t) for t in rollout.prompt_ids[i]] + [int(t) for t in rollout.tokens[i, :int(rollout.lengths[i])]]
              for i in idx]
      jobs.append((idx, seqs, [len(rollout.prompt_ids[i]) for i in idx]))
    with ThreadPoolExecutor(max_workers=self.cfg.max_concurrency, thread_name_prefix="distill-server") as pool:
      answers = list(pool.map(self._score, jobs))
    for (idx, _, _), got in zip(jobs, answers):
      for i, lp in zip(idx, got):
        out[i, :len(lp)] = lp
    return out
