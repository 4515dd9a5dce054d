"""Tools an agent can call, and :class:`ToolExecutor`, which runs a turn's calls concurrently.

A tool is an object with ``name``, ``description``, ``parameters`` (``{arg: (type, required)}``)
and ``__call__(**arguments) -> str``. Built in (registered by name in :data:`TOOLS`):

* ``calculator``: exact arithmetic (integers and fractions, ``+ - * / ^ **``, parentheses) through
  the math-answer parser of :mod:`jaxrl.rewards`; no ``eval``.
* ``python``: a program run in the reward sandbox (:func:`jaxrl.rewards.run_program`); stdout is the
  result.
* ``search``: BM25 (Okapi, Lucene's non-negative IDF) over a local JSONL collection
  (``{"id", "title"?, "text"}`` per line), implemented here in numpy; no network.

Every bad call ends as a :class:`ToolResult` with ``error`` set, never an exception. Error kinds:
``malformed`` (the call text did not parse; from :mod:`jaxrl.envs._toolcall`), ``unknown_tool``,
``bad_arguments`` (missing / unexpected / wrongly typed), ``timeout`` (the executor stops waiting
after ``timeout_s``; a pure-Python tool's thread cannot be killed and finishes in the background,
the sandboxed ``python`` tool is killed by its own limit), ``output_too_long`` (the output is cut to
``max_output_chars``), ``tool_error`` (the tool raised or its program failed) and ``limit`` (over
the episode's tool-call budget).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.envs._toolcall import ToolCall, ToolCallError
from jaxrl.rewards import SandboxConfig, evaluate_expression, parse_expression, run_program

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "timeout", "output_too_long", "tool_error", "limit")

TOOLS: dict[str, Callable[..., Any]] = {}
"""Tool factories by name: ``TOOLS[name](**options) -> tool``."""


def register_tool(name: str):
  """Class/function decorator adding a tool factory to :data:`TOOLS` under ``name``."""
  def deco(factory):
    if name in TOOLS:
      raise ValueError(f"tool {name!r} is already registered")
    TOOLS[name] = factory
    return factory
  return deco


def make_tool(name: str, **options: Any):
  """``TOOLS[name](**options)``; an unknown name raises naming the registered ones."""
  if name not in TOOLS:
    raise ValueError(f"unknown tool {name!r}; registered: {sorted(TOOLS)}")
  return TOOLS[name](**options)


class ToolArgumentError(ValueError):
  """The call's arguments do not match the tool's ``parameters``."""


def check_arguments(tool, arguments: dict[str, Any]) -> None:
  """Raises :class:`ToolArgumentError` for missing, unexpected or wrongly typed arguments."""
  spec = tool.parameters
  unknown = sorted(set(arguments) - set(spec))
  if unknown:
    raise ToolArgumentError(f"unexpected argument(s) {unknown} for {tool.name}; expected {sorted(spec)}")
  for arg, (tp, required) in spec.items():
    if arg not in arguments:
      if required:
        raise ToolArgumentError(f"missing required argument {arg!r} for {tool.name}")
      continue
    v = arguments[arg]
    if isinstance(v, bool) and tp is not bool or not isinstance(v, tp):
      raise ToolArgumentError(f"argument {arg!r} of {tool.name} must be {tp.__name__}, got {type(v).__name__}")


# ---------------------------------------------------------------------------------------------------
# calculator


def calculate(expression: str) -> str:
  """Exact value of an arithmetic ``expression``: an integer, else a reduced fraction ``p/q``.

  Example:
    >>> calculate("123456789 * 987654321")
    '121932631112635269'
  """
  if len(expression) > 1000:
    raise ValueError("expression longer than 1000 characters")
  value = evaluate_expression(parse_expression(expression.replace("**", "^")), domain="exact")
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@register_tool("calculator")
class Calculator:
  """Exact arithmetic on integers and fractions."""

  name = "calculator"
  description = "Evaluate an arithmetic expression exactly (integers, + - * / ^, parentheses)."
  parameters = {"expression": (str, True)}

  def __call__(self, *, expression: str) -> str:
    return calculate(expression)


# ---------------------------------------------------------------------------------------------------
# python


@register_tool("python")
class PythonTool:
  """Runs a Python program in the reward sandbox; the result is its stdout.

  Args:
    timeout_s: the sandbox's wall limit (it kills the program's process group).
    memory_mb: address-space limit.
  """

  name = "python"
  description = "Run a Python program and return what it prints."
  parameters = {"code": (str, True)}

  def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 1024):
    self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)

  def __call__(self, *, code: str) -> str:
    res = run_program(code, timeout_s=self.timeout_s, config=SandboxConfig(memory_mb=self.memory_mb))
    if res.status == "timeout":
      raise TimeoutError(f"python program timed out after {self.timeout_s:g} s")
    if not res.ok:
      tail = res.stderr.strip().splitlines()[-1:] or [res.status]
      raise RuntimeError(f"{res.status}: {tail[0]}")
    return res.stdout


# ---------------------------------------------------------------------------------------------------
# search: BM25 over a JSONL collection

_WORD = re.compile(r"\w+")


def bm25_tokenize(text: str) -> list[str]:
  """Lower-cased ``\\w+`` words."""
  return _WORD.findall(text.lower())


class BM25:
  r"""Okapi BM25 over a fixed list of documents.

  .. math::

      s(D, Q) = \sum_{q \in Q} \operatorname{IDF}(q)\,
        \frac{f(q, D)\,(k_1 + 1)}{f(q, D) + k_1 (1 - b + b\,|D| / \overline{|D|})},\qquad
      \operatorname{IDF}(q) = \ln\!\left(1 + \frac{N - n(q) + 0.5}{n(q) + 0.5}\right)

  (Robertson & Zaragoza 2009; the ``1 +`` inside the log is Lucene's, so IDF is never negative.)
  Query words are counted with multiplicity. Args: ``docs`` (texts), ``k1``, ``b``.
  """

  def __init__(self, docs: Sequence[str], *, k1: float = 1.5, b: float = 0.75):
    if not docs:
      raise ValueError("BM25 needs at least one document")
    self.k1, self.b = float(k1), float(b)
    toks = [bm25_tokenize(d) for d in docs]
    self.vocab: dict[str, int] = {}
    rows, cols = [], []
    for j, words in enumerate(toks):
      for w in words:
        rows.append(self.vocab.setdefault(w, len(self.vocab)))
        cols.append(j)
    self.tf = np.zeros((len(self.vocab), len(docs)), np.float64)  # [V, N] term frequencies
    np.add.at(self.tf, (np.asarray(rows, np.int64), np.asarray(cols, np.int64)), 1.0)
    self.doc_len = np.asarray([len(w) for w in toks], np.float64)  # [N]
    n_q = (self.tf > 0).sum(axis=1)  # [V] documents containing each word
    self.idf = np.log1p((len(docs) - n_q + 0.5) / (n_q + 0.5))  # [V]

  def scores(self, query: str) -> np.ndarray:  # [N] float64
    """BM25 score of every document for ``query``."""
    out = np.zeros(self.tf.shape[1], np.float64)
    avg = self.doc_len.mean() if self.doc_len.mean() > 0 else 1.0
    norm = self.k1 * (1.0 - self.b + self.b * self.doc_len / avg)  # [N]
    for w in bm25_tokenize(query):
      v = self.vocab.get(w)
      if v is None:
        continue
      f = self.tf[v]
      out += self.idf[v] * f * (self.k1 + 1.0) / (f + norm)
    return out

  def top(self, query: str, k: int) -> list[tuple[int, float]]:
    """The ``k`` best ``(document index, score)`` with score > 0, best first (ties: lower index)."""
    s = self.scores(query)
    order = sorted(np.flatnonzero(s > 0).tolist(), key=lambda j: (-s[j], j))[:k]
    return [(j, float(s[j])) for j in order]


@register_tool("search")
class SearchTool:
  """BM25 search over a local JSONL collection (``{"id", "title"?, "text"}`` per line).

  Args:
    collection: path of the JSONL file.
    top_k: default number of results.
    k1, b: BM25 parameters.
  """

  name = "search"
  description = "Search the local document collection; returns the best matching passages."
  parameters = {"query": (str, True), "top_k": (int, False)}

  def __init__(self, *, collection: str, top_k: int = 3, k1: float = 1.5, b: float = 0.75):
    path = Path(collection)
    if not path.is_file():
      raise ValueError(f"search.collection: file not found: {collection}")
    self.docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
      if line.strip():
        rec = json.loads(line)
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
          raise ValueError(f"{collection}:{i}: a document needs a string 'text'")
        self.docs.append(rec)
    self.top_k = int(top_k)
    self.index = BM25([f"{d.get('title', '')} {d['text']}" for d in self.docs], k1=k1, b=b)

  def __call__(self, *, query: str, top_k: int | None = None) -> str:
    hits = self.index.top(query, max(1, min(int(top_k or self.top_k), 20)))
    if not hits:
      return "no results"
    lines = []
    for j, _ in hits:
      d = self.docs[j]
      title = f"{d['title']}: " if d.get("title") else ""
      lines.append(f"[{d.get('id', j)}] {title}{d['text']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Running calls


class ToolResult:
  """The outcome of one call: ``content`` (the observation text) and ``error`` (a kind or None)."""

  __slots__ = ("name", "content", "error", "wall_s")

  def __init__(self, name: str, content: str, error: str | None, wall_s: float = 0.0):
    self.name, self.content, self.error, self.wall_s = name, content, error, wall_s

  def __repr__(self) -> str:
    return f"ToolResult({self.name!r}, error={self.error!r}, content={self.content[:40]!r})"


def _invoke(tool, arguments: dict[str, Any]) -> tuple[str, str | None]:
  """One call, in the executor's pool or a reward worker process: ``(content, error kind or None)``."""
  try:
    check_arguments(tool, arguments)
  except ToolArgumentError as e:
    return f"error: {e}", "bad_arguments"
  try:
    out = tool(**arguments)
  except TimeoutError as e:
    return f"error: {e}", "timeout"
  except Exception as e:  # noqa: BLE001  a tool failure is an observation, not a crash
    return f"error: {type(e).__name__}: {e}", "tool_error"
  return str(out), None


class ToolExecutor:
  """Runs tool calls concurrently with a per-call timeout, in its own threads or in the reward pool.

  With ``runner`` (a :class:`jaxrl.rewards.RewardRunner`; the agentic trainer passes its own, set by
  ``reward.runner``) every call runs in the runner's pool. With ``executor: process`` a tool that
  crashes (``os._exit``, a segfault) takes down a worker, not the trainer: the pool is started again,
  the calls lost with it run once more, and a call that breaks its worker twice is a ``tool_error``
  observation. A call still running at its timeout is a ``timeout`` observation, and after the turn's
  calls are collected the pool's workers are killed and replaced, so a hung tool holds no worker.
  (Other calls in flight in that pool at that moment, of other trajectories, are run once more.)
  Tools (and their arguments) must pickle for process workers. A runner with thread workers is not
  used (a hung tool would hold one of the reward threads for good): the executor keeps its own threads.

  Args:
    tools: the available tools (objects with ``name``).
    timeout_s: wall seconds the executor waits for one call.
    max_output_chars: longer outputs are cut and reported as ``output_too_long``.
    workers: pool threads (shared by every trajectory of a rollout); unused with ``runner``.
    runner: run the calls in this reward runner's pool instead.
  """

  def __init__(self, tools: Sequence[Any], *, timeout_s: float = 10.0, max_output_chars: int = 2000,
               workers: int = 8, runner=None):
    if not timeout_s > 0:
      raise ValueError(f"tool timeout_s must be > 0, got {timeout_s!r}")
    if max_output_chars < 1:
      raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars!r}")
    self.tools = {t.name: t for t in tools}
    self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)
    self.runner = runner if runner is not None and runner.config.executor == "process" else None
    self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-tool")

  def describe(self) -> list[dict[str, Any]]:
    """OpenAI-style function specs of the tools (for system prompts / chat templates)."""
    out = []
    for t in self.tools.values():
      props = {a: {"type": {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, "object")}
               for a, (tp, _) in t.parameters.items()}
      out.append({"type": "function", "function": {
          "name": t.name, "description": t.description,
          "parameters": {"type": "object", "properties": props,
                         "required": [a for a, (_, req) in t.parameters.items() if req]}}})
    return out

  def _submit(self, call: ToolCall) -> cf.Future:
    if self.runner is None:
      return self._pool.submit(_invoke, self.tools[call.name], call.arguments)
    return self.runner.submit_call(_invoke, self.tools[call.name], call.arguments)

  def _result(self, call: ToolCall, fut: cf.Future, deadline: float) -> tuple[str, str | None, bool]:
    """Waits for one call until ``deadline``; a call lost with a dead worker is run once more.
    Returns ``(content, error kind or None, still running)``."""
    for attempt in range(2):
      try:
        return (*fut.result(timeout=max(0.0, deadline - time.monotonic())), False)
      except cf.TimeoutError:
        return f"error: tool {call.name!r} timed out after {self.timeout_s:g} s", "timeout", not fut.cancel()
      except cf.BrokenExecutor:  # its worker process died (this call or another one in that pool)
        if attempt == 1 or time.monotonic() >= deadline:
          return f"error: tool {call.name!r} crashed its worker process", "tool_error", False
        fut = self._submit(call)
      except Exception as e:  # noqa: BLE001  e.g. a result that does not unpickle
        return f"error: {type(e).__name__}: {e}", "tool_error", False
    raise AssertionError("unreachable")

  def run(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
    """Results of ``calls`` in order; every failure is a result with ``error`` set."""
    t0 = time.monotonic()
    futures: list[cf.Future | ToolResult] = []
    for c in calls:
      if isinstance(c, ToolCallError):
        futures.append(ToolResult("", f"error: {c.message}", c.kind))
      elif c.name not in self.tools:
        futures.append(ToolResult(c.name, f"error: unknown tool {c.name!r}; available: {sorted(self.tools)}",
                                  "unknown_tool"))
      else:
        futures.append(self._submit(c))
    out, hung = [], False
    for c, f in zip(calls, futures):
      if isinstance(f, ToolResult):
        out.append(f)
        continue
      content, err, running = self._result(c, f, t0 + self.timeout_s)
      hung = hung or running
      if len(content) > self.max_output_chars:
        content = content[:self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
        err = err or "output_too_long"
      out.append(ToolResult(c.name, content, err, time.monotonic() - t0))
    if hung and self.runner is not None:  # a hung worker would hold its process forever: kill and replace
      self.runner.replace_pool(kill=True)
    return out

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
