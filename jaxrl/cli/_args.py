"""The argument parser of the commands that take ``--config FILE [key=value ...]``."""

from __future__ import annotations

import argparse


def config_parser(name: str, help_text: str) -> argparse.ArgumentParser:
  """``jaxrl NAME [--config FILE] [key=value ...]``."""
  p = argparse.ArgumentParser(prog=f"jaxrl {name}", description=help_text)
  p.add_argument("--config", help="YAML config file")
  p.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
  return p
