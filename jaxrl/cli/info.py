"""``jaxrl info [--config FILE] [key=value ...]``: backend, devices, processes, and what a config would build."""

from __future__ import annotations

from jaxrl import info
from jaxrl.cli._args import config_parser


def main(argv: list[str]) -> int:
  """Prints :func:`jaxrl.info.describe` of the config; returns the exit status."""
  ns = config_parser("info", "backend, devices, processes, and the mesh and model a config would build").parse_args(argv)
  print(info.describe(ns.config, ns.overrides))
  return 0
