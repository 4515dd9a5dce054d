"""Agentic RL: environments, tool calling, multi-turn rollouts and ARPO's adaptive branching.

* :class:`Env` / :func:`register_env` / :func:`env_factory`: the gym-like interface
  (``reset(record) -> messages``, ``step(turn) -> (observation, reward, done, info)``) and registry;
  ``"single_turn"`` (a reward function) and ``"tools"`` (tool use, hierarchical reward) are built in.
* :func:`parse_tool_calls`: Qwen/Hermes ``<tool_call>{json}</tool_call>`` and Llama 3 JSON calls.
* :data:`TOOLS`: ``calculator``, ``python`` (sandboxed), ``search`` (BM25 over local JSONL);
  :class:`ToolExecutor` runs calls concurrently with timeouts; bad calls become error observations.
* :class:`MultiTurnRollout`: episodes on :class:`jaxrl.sampling.Sampler`, tool tokens masked out of
  the loss; ``arpo=ArpoConfig(...)`` adds entropy-based branching (:mod:`jaxrl.envs._arpo`).
* :class:`AgenticTrainer` / :class:`AgenticRLConfig`: the RL trainer driven by an environment
  (``jaxrl rl`` picks them when the config has an ``env:`` section); its rollout source is
  :class:`EpisodeRollout` (a :class:`jaxrl.rl.RolloutSource`). See ``docs/agentic.md``.

Layer (docs/design.md): may import ``rl`` and the layers below; not ``plan``, ``serve``, ``bench`` or ``cli``.
"""

from jaxrl.envs._arpo import ArpoConfig, branch_probability, entropy_delta, shared_prefix_ids
from jaxrl.envs._base import ENVS, Env, SingleTurnEnv, StepResult, env_factory, prompt_messages, register_env
from jaxrl.envs._multiturn import (
    AgentBatch,
    MultiTurnRollout,
    ObservationEncoder,
    SamplingOptions,
    Trajectory,
    turn_request_id,
)
from jaxrl.envs._tool_env import ToolEnv
from jaxrl.envs._toolcall import ParsedTurn, ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from jaxrl.envs._tools import (
    BM25,
    ERROR_KINDS,
    TOOLS,
    Calculator,
    PythonTool,
    SearchTool,
    ToolExecutor,
    ToolResult,
    calculate,
    make_tool,
    register_tool,
)

__all__ = [
    "BM25",
    "ENVS",
    "ERROR_KINDS",
    "TOOLS",
    "AgentBatch",
    "AgenticRLConfig",
    "AgenticTrainer",
    "EnvSection",
    "EpisodeRollout",
    "agent_metrics",
    "ArpoConfig",
    "Calculator",
    "Env",
    "MultiTurnRollout",
    "ObservationEncoder",
    "ParsedTurn",
    "PythonTool",
    "SamplingOptions",
    "SearchTool",
    "SingleTurnEnv",
    "StepResult",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "ToolExecutor",
    "ToolResult",
    "Trajectory",
    "branch_probability",
    "calculate",
    "entropy_delta",
    "env_factory",
    "format_tool_call",
    "make_tool",
    "parse_tool_calls",
    "prompt_messages",
    "register_env",
    "register_tool",
    "shared_prefix_ids",
    "turn_request_id",
]

_TRAINER = ("AgenticRLConfig", "AgenticTrainer", "EnvSection", "EpisodeRollout", "agent_metrics")


def __getattr__(name: str):
  # The trainer pulls in jax and jaxrl.rl; imported on first use, so processes that only run tools
  # (reward pool workers unpickling a tool call) import the light modules above.
  if name in _TRAINER:
    from jaxrl.envs import _trainer  # lazy: the trainer pulls in JAX; reward-pool workers import envs without it
    return getattr(_trainer, name)
  raise AttributeError(f"module 'jaxrl.envs' has no attribute {name!r}")
