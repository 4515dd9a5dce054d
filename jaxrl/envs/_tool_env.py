"""The tool-use environment: parse tool calls, run them, answer with tool-role observations.

Reward (ARPO's hierarchical reward, notes 000 §ARPO "Hierarchical Reward Design", after Tool-Star):

.. math::

    R = \\begin{cases} \\max(\\text{Acc} + r_M, \\text{Acc}) & \\text{format good and Acc} > 0 \\\\
                       0 & \\text{format good and Acc} = 0 \\\\
                       -1 & \\text{otherwise} \\end{cases},\\qquad
    r_M = \\text{multi\\_tool\\_bonus if at least two different tools were called, else } 0

"Format good" means every tool call of the episode parsed and the final turn holds an answer the
accuracy reward can read (its ``info["reason"]`` is not ``no_answer``); an episode cut by the turn
limit has no final answer. (The notes' ``r_M`` rewards using *search and python*; with arbitrary
tool sets we read it as "two or more different tools".)
"""

from __future__ import annotations

import collections
from typing import Any

from jaxrl.envs._base import Env, StepResult, _last_user, prompt_messages, register_env
from jaxrl.envs._toolcall import parse_tool_calls
from jaxrl.envs._tools import ERROR_KINDS, ToolCallError, ToolExecutor, ToolResult, make_tool
from jaxrl.rewards import load_reward
from jaxrl.rewards import coerce_reward

DEFAULT_SYSTEM = ("You can call tools: {tools}. Call one as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}"
                  "</tool_call>; the result comes back as a tool message. End with 'Answer: <value>'.")


@register_env("tools")
class ToolEnv(Env):
  """Multi-turn tool use scored with the hierarchical reward (module docstring).

  Build episodes with :func:`jaxrl.envs.env_factory` (``"tools"``, ``tools={...}``, ...), which
  creates the tools and their :class:`ToolExecutor` once.

  Args:
    executor: the shared :class:`ToolExecutor`.
    fmt: tool-call format, ``"hermes"`` or ``"llama3"``.
    max_turns: assistant turns per episode; a turn that still calls a tool at the limit ends the
      episode without an answer.
    max_tool_calls: tool calls per episode; calls past it get a ``limit`` error observation.
    reward_fn, reward_kwargs: the accuracy reward (``Acc``), e.g. ``jaxrl.rl:arithmetic_reward``.
    multi_tool_bonus: ``r_M``.
    format_penalty: the reward when the format is bad (``-1`` in the notes).
    system_prompt: prepended as a system message (``{tools}`` is replaced by the tool names);
      ``""`` for none.
    tool_role: role of observation messages (``"tool"``; ``"user"`` for templates without one).
  """

  def __init__(self, *, executor: ToolExecutor, fmt: str = "hermes", max_turns: int = 4, max_tool_calls: int = 4,
               reward_fn: str = "jaxrl.rl:arithmetic_reward", reward_kwargs: dict[str, Any] | None = None,
               multi_tool_bonus: float = 0.1, format_penalty: float = -1.0, system_prompt: str = DEFAULT_SYSTEM,
               tool_role: str = "tool", _reward=None):
    if max_turns < 1 or max_tool_calls < 0:
      raise ValueError(f"env: max_turns must be >= 1 and max_tool_calls >= 0, got {max_turns}, {max_tool_calls}")
    self.executor, self.fmt = executor, fmt
    self.max_turns, self.max_tool_calls = int(max_turns), int(max_tool_calls)
    self.multi_tool_bonus, self.format_penalty = float(multi_tool_bonus), float(format_penalty)
    self.system_prompt, self.tool_role = system_prompt, tool_role
    self._reward = _reward or load_reward(reward_fn, **dict(reward_kwargs or {}))
    parse_tool_calls("", fmt=fmt)  # validates fmt

  @classmethod
  def build_factory(cls, *, tools: dict[str, dict[str, Any]] | None = None, timeout_s: float = 10.0,
                    max_output_chars: int = 2000, workers: int = 8, runner=None, **kwargs: Any):
    """Creates the tools (``{name: options}``) and one executor (its calls in ``runner``'s process pool
    when given one, see :class:`ToolExecutor`); returns the episode constructor."""
    tools = {"calculator": {}} if tools is None else tools
    executor = ToolExecutor([make_tool(name, **(opts or {})) for name, opts in tools.items()], timeout_s=timeout_s,
                            max_output_chars=max_output_chars, workers=workers, runner=runner)
    reward = load_reward(kwargs.get("reward_fn", "jaxrl.rl:arithmetic_reward"),
                         **dict(kwargs.get("reward_kwargs") or {}))
    cls(executor=executor, _reward=reward, **kwargs)  # validate now
    return lambda: cls(executor=executor, _reward=reward, **kwargs)

  def reset(self, record):
    from jaxrl.rl import reward_fields  # lazy: jaxrl.rl pulls in JAX; reward-pool workers import envs without it
    self.fields = reward_fields(record)
    self.messages = prompt_messages(record)
    if self.system_prompt and not any(m["role"] == "system" for m in self.messages):
      names = ", ".join(f"{n}({', '.join(t.parameters)})" for n, t in self.executor.tools.items())
      self.messages = [{"role": "system", "content": self.system_prompt.format(tools=names)}] + self.messages
    self.turns, self.calls, self.malformed = 0, 0, 0
    self.errors: dict[str, int] = collections.Counter()
    self.used: set[str] = set()
    return list(self.messages)

  def step(self, turn):
    self.turns += 1
    parsed = parse_tool_calls(turn, fmt=self.fmt)
    if not parsed.has_calls:
      return self._final(turn)
    if self.turns >= self.max_turns:
      return StepResult(None, self.format_penalty, True, {"reason": "turn_limit"})
    results: list[ToolResult] = []
    todo: list = list(parsed.errors) + list(parsed.calls)
    room = max(self.max_tool_calls - self.calls, 0)
    over = [ToolResult(c.name if not isinstance(c, ToolCallError) else "",
                       f"error: tool-call limit of {self.max_tool_calls} per episode reached", "limit")
            for c in todo[room:]]
    results = self.executor.run(todo[:room]) + over
    self.calls += len(todo)
    self.malformed += len(parsed.errors)
    for r in results:
      if r.error:
        self.errors[r.error] += 1
      elif r.name:
        self.used.add(r.name)
    obs = [{"role": self.tool_role, "content": r.content} for r in results]
    return StepResult(obs, 0.0, False, {"tool_results": results})

  def _final(self, turn: str) -> StepResult:
    res = coerce_reward(self._reward(_last_user(self.messages), turn, **self.fields))
    acc = float(res.value)
    good = self.malformed == 0 and res.info.get("reason") != "no_answer"
    if not good:
      reward = self.format_penalty
    elif acc > 0:
      bonus = self.multi_tool_bonus if len(self.used) >= 2 else 0.0
      reward = max(acc + bonus, acc)
    else:
      reward = 0.0
    return StepResult(None, reward, True, {"accuracy": acc, "format_ok": good, **res.info})

  def metrics(self) -> dict[str, float]:
    out = {"tool_calls": float(self.calls), "turns": float(self.turns), "tools_used": float(len(self.used)),
           "tool_errors": float(sum(self.errors.values()))}
    for k in ERROR_KINDS:
      out[f"tool_errors/{k}"] = float(self.errors.get(k, 0))
    return out

  def fork(self):
    new = super().fork()
    new.errors = collections.Counter(self.errors)
    return new
