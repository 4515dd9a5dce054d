"""The ``jaxrl`` command: one table of commands, each run by a function that parses its own arguments.

Owns command dispatch, argument parsing and the one-line report of a user's mistake. It is the top
layer: it may import every package of ``jaxrl``; nothing in the library imports it. A command's module
is imported only when that command runs (``jaxrl --help`` loads no trainer, model or data stack).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from jaxrl import _cache, _extras
from jaxrl.config import ConfigError

COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("backend, devices, processes, and the mesh and model a config would build", "jaxrl.cli.info:main"),
    "sft": ("supervised fine-tuning with packing (default: tiny model on the built-in task)",
            "jaxrl.cli.sft:main"),
    "dpo": ("preference optimisation (DPO, IPO, SimPO, ORPO...) or a Bradley-Terry reward model on chosen/rejected "
            "pairs", "jaxrl.cli.dpo:main"),
    "latent": ("Coconut: training with continuous latent thoughts (stage curriculum, ablations) and latent decoding",
               "jaxrl.cli.latent:main"),
    "rl": ("RL (GRPO/DAPO/GRPO+/decoupled PPO) from a YAML recipe", "jaxrl.cli.rl:main"),
    "rubric-arm": ("Rubric-ARM: alternating GRPO of a rubric generator and a judge on preference pairs",
                   "jaxrl.cli.rubric_arm:main"),
    "sample": ("generate completions from an HF directory with the KV-cache sampler", "jaxrl.cli.sample:main"),
    "serve": ("OpenAI-compatible HTTP server (chat/completions, streaming, logprobs) for an HF directory",
              "jaxrl.cli.serve:main"),
    "eval": ("score a local HF checkpoint on a JSONL benchmark: avg@k, unbiased pass@k, maj@k (docs/eval.md)",
             "jaxrl.cli.eval:main"),
    "caprl-curate": ("CapRL QA curation: keep questions a vision model answers with the image and a text model "
                     "cannot without it", "jaxrl.cli.vlrl:curate_main"),
    "rubicap-rubrics": ("RubiCap rubric synthesis: teacher-committee captions in, per-image weighted rubrics out",
                        "jaxrl.cli.vlrl:rubrics_main"),
    "vision-r1-coldstart": ("Vision-R1 modality bridging: image QA in, reasoning that passes the hard reward out "
                            "as SFT records", "jaxrl.cli.vlrl:coldstart_main"),
    "rs": ("rejection sampling: k samples per prompt, the accepted ones as an SFT data set", "jaxrl.cli.rs:main"),
    "plan": ("AOT-compile a recipe's programs for a TPU/GPU target here; bytes per device (docs/scaling.md)",
             "jaxrl.plan:main"),
    "quickstart": ("the main job: tiny model SFT warm start, then GRPO, before/after accuracy", "jaxrl.quickstart:main"),
    "bench": ("benchmarks against a peer in the same run; prints a table and writes JSON", "jaxrl.cli.bench:main"),
    "convert": ("HF checkpoint directory <-> jaxrl (load, re-shard, save), or a preset to a random HF dir",
                "jaxrl.cli.convert:main"),
}
"""Command name -> (help line, ``module:function`` that runs it with the rest of the command line)."""

NEEDS: dict[str, tuple[str, ...]] = {"serve": ("fastapi", "uvicorn")}
"""Command name -> the optional modules it cannot start without, checked before it loads anything."""


def _runner(target: str) -> Callable[[list[str]], int]:
  module, attr = target.split(":")
  return lambda rest: getattr(importlib.import_module(module), attr)(rest)


PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {name: _runner(t) for name, (_, t) in COMMANDS.items()}
"""Command name -> its runner: every command gets the rest of the line untouched (argparse would otherwise
take a leading ``--model`` or ``--config`` for an option of ``jaxrl`` itself)."""


def _user_error(e: BaseException) -> str | None:
  """``"config error"``, ``"data error"`` or ``"error"`` for a mistake in the user's config, data or
  paths; None for anything else (a bug keeps its traceback)."""
  from jaxrl.data import DataError  # lazy: grain and the tokenizer stack, needed only once a command failed
  from jaxrl.train import CheckpointError, NonFiniteError  # lazy: Orbax and optax, needed only once a command failed
  if isinstance(e, ConfigError):
    return "config error"
  if isinstance(e, DataError):
    return "data error"
  if isinstance(e, FileNotFoundError):
    return "error"
  if isinstance(e, (CheckpointError, NonFiniteError)):  # no usable checkpoint; too many non-finite updates
    return "error"
  return None


def main(argv: list[str] | None = None) -> int:
  """Runs a command; user errors (config, data, missing files, a missing optional extra) end with one line
  on stderr and status 2."""
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    return _main(argv)
  except Exception as e:  # noqa: BLE001  (re-raised unless it is the user's mistake)
    from jaxrl.train import Preempted  # lazy: Orbax and optax, needed only once a command failed
    if isinstance(e, Preempted):  # SIGTERM/SIGINT: final checkpoint written; 128 + signal (docs/reliability.md)
      print(f"jaxrl {argv[0] if argv else ''}: {e}", file=sys.stderr)
      return e.exit_code
    missing = _extras.missing_extra(e)
    if missing is not None:  # one line: what is missing and the pip install that brings it
      print(f"jaxrl {argv[0] if argv else ''}: error: {missing}", file=sys.stderr)
      return 2
    kind = _user_error(e)
    if kind is None:
      raise
    print(f"jaxrl {argv[0] if argv else ''}: {kind}: {e}", file=sys.stderr)
    return 2


def _main(argv: list[str]) -> int:
  argv = _cache.from_argv(argv)  # a leading --xla-cache DIR|off; the persistent compilation cache is on
  if argv and argv[0] in PASSTHROUGH:
    for module in NEEDS.get(argv[0], ()):
      _extras.require(module)
    return PASSTHROUGH[argv[0]](argv[1:])
  parser = argparse.ArgumentParser(prog="jaxrl", description="JAX-native LLM post-training", epilog=_cache.HELP)
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (help_text, _) in COMMANDS.items():
    sub.add_parser(name, help=help_text, description=help_text)
  parser.parse_args(argv)  # --help, or an unknown command: argparse prints and exits
  return 2
