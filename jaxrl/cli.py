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


@command("info", "backend, devices, processes, and the mesh and model a config would build")
@_config_args
def cmd_info(ns: argparse.Namespace) -> int:
  from jaxrl import info
  print(info.describe(ns.config, ns.overrides))
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="jaxrl", description="JAX-native LLM post-training")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (help_text, add_args, _) in COMMANDS.items():
    add_args(sub.add_parser(name, help=help_text, description=help_text))
  ns = parser.parse_args(argv)
  from jaxrl.config import ConfigError
  try:
    return COMMANDS[ns.command][2](ns)
  except ConfigError as e:
    print(f"jaxrl {ns.command}: config error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
