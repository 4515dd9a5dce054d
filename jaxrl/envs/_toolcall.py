"""Parsing tool calls out of a model's assistant turn.

Two formats, as the models' own chat templates write them:

* ``hermes`` (Qwen2.5/Qwen3, Hermes, the jaxrl tiny tokenizer's demos): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the turn.
* ``llama3`` (Llama 3.1/3.2 JSON tool calling): the whole turn, optionally after ``<|python_tag|>``,
  is one JSON object ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``).

A block that cannot be read (invalid JSON, no ``name``, arguments that are not an object, an
unclosed ``<tool_call>``) becomes a :class:`ToolCallError` of kind ``malformed``; the caller turns it
into an error observation, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: tool ``name`` with keyword ``arguments``."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
  """A tool-call block that could not be parsed (kind ``malformed``)."""

  kind: str
  message: str
  raw: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """The tool calls of one assistant turn, in order, and the blocks that failed to parse."""

  calls: tuple[ToolCall, ...]
  errors: tuple[ToolCallError, ...]

  @property
  def has_calls(self) -> bool:
    """The turn asked for a tool (well-formed or not): the episode continues with an observation."""
    return bool(self.calls or self.errors)


def _one_call(body: str, *, args_key: str) -> ToolCall | ToolCallError:
  raw = body.strip()
  try:
    obj = json.loads(raw)
  except json.JSONDecodeError as e:
    return ToolCallError("malformed", f"invalid JSON in tool call: {e.msg} at char {e.pos}", raw)
  if not isinstance(obj, dict):
    return ToolCallError("malformed", f"tool call must be a JSON object, got {type(obj).__name__}", raw)
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return ToolCallError("malformed", "tool call has no string 'name'", raw)
  args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
  if isinstance(args, str):  # OpenAI style: arguments as a JSON string
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      return ToolCallError("malformed", f"invalid JSON in arguments: {e.msg}", raw)
  if not isinstance(args, dict):
    return ToolCallError("malformed", f"arguments must be a JSON object, got {type(args).__name__}", raw)
  return ToolCall(name=name, arguments=args)


def parse_tool_calls(text: str, *, fmt: str = "hermes") -> ParsedTurn:
  """The tool calls in ``text`` (an assistant turn, special tokens included or not).

  Args:
    text: the decoded assistant turn.
    fmt: ``"hermes"`` or ``"llama3"`` (module docstring).

  Returns:
    A :class:`ParsedTurn`; no calls and no errors means the turn is a final answer.

  Example:
    >>> parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>').calls
    (ToolCall(name='calculator', arguments={'expression': '2*3'}),)
  """
  if fmt not in FORMATS:
    raise ValueError(f"tool call format {fmt!r} is not one of {list(FORMATS)}")
  calls: list[ToolCall] = []
  errors: list[ToolCallError] = []
  if fmt == "hermes":
    for m in _HERMES.finditer(text):
      got = _one_call(m.group(1), args_key="arguments")
      (errors if isinstance(got, ToolCallError) else calls).append(got)
    tail = _HERMES.sub("", text)
    if "<tool_call>" in tail:
      errors.append(ToolCallError("malformed", "unclosed <tool_call> block", tail[tail.index("<tool_call>"):]))
  else:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
      body = body[len(_PYTHON_TAG):].strip()
    if body.startswith("{") or tagged:
      for part in _split_top_level(body):
        got = _one_call(part, args_key="parameters")
        (errors if isinstance(got, ToolCallError) else calls).append(got)
  return ParsedTurn(tuple(calls), tuple(errors))


def _split_top_level(body: str) -> list[str]:
  """``body`` split at ``;`` outside JSON strings and brackets (Llama 3 parallel calls)."""
  parts, depth, start, in_str, esc = [], 0, 0, False, False
  for i, c in enumerate(body):
    if in_str:
      if esc:
        esc = False
      elif c == "\\":
        esc = True
      elif c == '"':
        in_str = False
      continue
    if c == '"':
      in_str = True
    elif c in "{[":
      depth += 1
    elif c in "}]":
      depth -= 1
    elif c == ";" and depth == 0:
      parts.append(body[start:i])
      start = i + 1
  parts.append(body[start:])
  return [p for p in parts if p.strip()]


def format_tool_call(name: str, arguments: dict[str, Any], *, fmt: str = "hermes") -> str:
  """The text a model writes to call ``name`` (for demonstrations and scripted policies)."""
  if fmt == "hermes":
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
  if fmt == "llama3":
    return json.dumps({"name": name, "parameters": arguments})
  raise ValueError(f"tool call format {fmt!r} is not one of {list(FORMATS)}")
