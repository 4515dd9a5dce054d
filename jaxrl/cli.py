"""The ``jaxrl`` command: thin wrappers that parse arguments, call the library and print."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str):
  def wrap(fn):
    def add_args(p):
      for args, kwargs in getattr(fn, "_args", []):
        p.add_argument(*args, **kwargs)
    COMMANDS[name] = (help, add_args, fn)
    return fn
  return wrap


def arg(*args, **kwargs):
  def wrap(fn):
    fn._args = [(args, kwargs)] + getattr(fn, "_args", [])
    return fn
  return wrap


def _config_args(fn):
  fn = arg("overrides", nargs="*", help="config overrides key.sub=value")(fn)
  return arg("--config", help="YAML config file")(fn)
# Decorators apply bottom-up and each prepends, so arguments are added in top-to-bottom order.


@command("info", "backend, devices, processes, and the mesh and model a config would build")
@_config_args
def cmd_info(ns: argparse.Namespace) -> int:
  from jaxrl import info
  print(info.describe(ns.config, ns.overrides))
  return 0


@command("sft", "supervised fine-tuning with packing (default: tiny model on the built-in task)")
@_config_args
def cmd_sft(ns: argparse.Namespace) -> int:
  from jaxrl import config as config_lib
  from jaxrl import sft, sharding
  sharding.initialize()  # multi-host when JAXRL_COORDINATOR/... or JAXRL_AUTO_DISTRIBUTED=1 are set (docs/multihost.md)
  cfg = config_lib.load(sft.SFTConfig, ns.config, ns.overrides)
  sft.SFTTrainer(cfg).run()
  return 0


@command("latent", "Coconut: training with continuous latent thoughts (stage curriculum, ablations) and latent decoding")
@_config_args
def cmd_latent(ns: argparse.Namespace) -> int:
  from jaxrl import config as config_lib
  from jaxrl import latent
  latent.main(config_lib.load(latent.CoconutConfig, ns.config, ns.overrides))
  return 0


@command("rl", "RL (GRPO/DAPO/GRPO+/decoupled PPO) from a YAML recipe")
@arg("rest", nargs=argparse.REMAINDER, help="--config FILE [key=value ...]")
def cmd_rl(ns: argparse.Namespace) -> int:
  from jaxrl.rl._cli import main_rl
  return main_rl(ns.rest)


@command("rubric-arm", "Rubric-ARM: alternating GRPO of a rubric generator and a judge on preference pairs")
@arg("rest", nargs=argparse.REMAINDER, help="--config FILE [key=value ...]")
def cmd_rubric_arm(ns: argparse.Namespace) -> int:
  from jaxrl.rl._rubric_arm import main as rubric_arm_main
  return rubric_arm_main(ns.rest)


@command("sample", "generate completions from an HF directory with the KV-cache sampler")
@arg("rest", nargs=argparse.REMAINDER, help="--model DIR --prompt TEXT [--n N] [--logprobs] ...")
def cmd_sample(ns: argparse.Namespace) -> int:
  from jaxrl.sampling._cli import main as sample_main
  return sample_main(ns.rest)


@command("serve", "OpenAI-compatible HTTP server (chat/completions, streaming, logprobs) for an HF directory")
@arg("rest", nargs=argparse.REMAINDER, help="--model DIR [--host H] [--port P] ...")
def cmd_serve(ns: argparse.Namespace) -> int:
  from jaxrl.serve._cli import main as serve_main
  return serve_main(ns.rest)


@command("plan", "AOT-compile a recipe's programs for a TPU/GPU target here; bytes per device (docs/scaling.md)")
@arg("rest", nargs=argparse.REMAINDER, help="--config FILE --target NAME [--layers K] [--json FILE] [key=value ...]")
def cmd_plan(ns: argparse.Namespace) -> int:
  from jaxrl.plan import main as plan_main
  return plan_main(ns.rest)


@command("quickstart", "the main job: tiny model SFT warm start, then GRPO, before/after accuracy")
@arg("rest", nargs=argparse.REMAINDER, help="options of the quickstart (see --help)")
def cmd_quickstart(ns: argparse.Namespace) -> int:
  from jaxrl.quickstart import main as quickstart_main
  return quickstart_main(ns.rest)


BENCHES = {
    "attention": "jaxrl.bench.attention",
    "sample": "jaxrl.bench.sample",
    "sft": "jaxrl.bench.sft",
    "lora": "jaxrl.bench.lora",
    "precision": "jaxrl.bench.precision",
    "rl": "jaxrl.bench.rl",
    "rl-async": "jaxrl.bench.rl_async",
    "judge": "jaxrl.bench.judge",
}


@command("bench", "benchmarks against a peer in the same run; prints a table and writes JSON")
@arg("name", choices=sorted(BENCHES), help="which benchmark")
@arg("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
def cmd_bench(ns: argparse.Namespace) -> int:
  import importlib
  return importlib.import_module(BENCHES[ns.name]).main(ns.rest)


@command("convert", "HF checkpoint directory <-> jaxrl (load, re-shard, save), or a preset to a random HF dir")
@arg("--dtype", default=None, choices=["float32", "bfloat16"], help="parameter dtype to write")
@arg("--tokenizer", default=None, help="tokenizer dir to copy alongside (default: the source's, if any)")
@arg("--preset", default=None, help="instead of SRC, write a randomly initialised model of this preset")
@arg("src", nargs="?", default=None, help="input HF directory")
@arg("dst", help="output HF directory")
def cmd_convert(ns: argparse.Namespace) -> int:
  from jaxrl.models import convert
  print(convert(ns.src, ns.dst, dtype=ns.dtype, tokenizer=ns.tokenizer, preset=ns.preset))
  return 0


def _pass(name: str, module: str, attr: str):
  def run(rest: list[str]) -> int:
    import importlib
    return getattr(importlib.import_module(module), attr)(rest)
  PASSTHROUGH[name] = run
  return run


PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {}
_pass("rl", "jaxrl.rl._cli", "main_rl")
_pass("rubric-arm", "jaxrl.rl._rubric_arm", "main")
_pass("sample", "jaxrl.sampling._cli", "main")
_pass("quickstart", "jaxrl.quickstart", "main")
_pass("plan", "jaxrl.plan", "main")
_pass("serve", "jaxrl.serve._cli", "main")


def _user_error(e: BaseException) -> str | None:
  """``"config error"``, ``"data error"`` or ``"error"`` for a mistake in the user's config, data or
  paths; None for anything else (a bug keeps its traceback)."""
  from jaxrl.config import ConfigError
  from jaxrl.data._sources import DataError
  if isinstance(e, ConfigError):
    return "config error"
  if isinstance(e, DataError):
    return "data error"
  if isinstance(e, FileNotFoundError):
    return "error"
  from jaxrl.train import CheckpointError, NonFiniteError
  if isinstance(e, (CheckpointError, NonFiniteError)):  # no usable checkpoint; too many non-finite updates
    return "error"
  return None


def main(argv: list[str] | None = None) -> int:
  """Runs a command; user errors (config, data, missing files) end with one line on stderr and status 2."""
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    return _main(argv)
  except Exception as e:  # noqa: BLE001  (re-raised unless it is the user's mistake)
    from jaxrl.train._preempt import Preempted
    if isinstance(e, Preempted):  # SIGTERM/SIGINT: final checkpoint written; 128 + signal (docs/reliability.md)
      print(f"jaxrl {argv[0] if argv else ''}: {e}", file=sys.stderr)
      return e.exit_code
    kind = _user_error(e)
    if kind is None:
      raise
    print(f"jaxrl {argv[0] if argv else ''}: {kind}: {e}", file=sys.stderr)
    return 2


def _main(argv: list[str]) -> int:
  from jaxrl import _cache
  argv = _cache.from_argv(argv)  # a leading --xla-cache DIR|off; the persistent compilation cache is on
  # Commands that parse their own options get the rest of the line untouched (argparse would
  # otherwise take a leading `--model` or `--config` for an option of `jaxrl` itself).
  if argv and argv[0] in PASSTHROUGH:
    return PASSTHROUGH[argv[0]](argv[1:])
  parser = argparse.ArgumentParser(prog="jaxrl", description="JAX-native LLM post-training", epilog=_cache.HELP)
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (help_text, add_args, _) in COMMANDS.items():
    add_args(sub.add_parser(name, help=help_text, description=help_text))
  ns = parser.parse_args(argv)
  return COMMANDS[ns.command][2](ns)


if __name__ == "__main__":
  sys.exit(main())
