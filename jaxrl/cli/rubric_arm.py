"""``jaxrl rubric-arm --config FILE [key=value ...]``: Rubric-ARM's alternating GRPO of a rubric generator
and a judge on preference pairs (:class:`jaxrl.rl.RubricARM`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxrl import config as config_lib
from jaxrl.rl import RubricARM, RubricARMConfig


def main(argv: list[str] | None = None) -> int:
  """``jaxrl rubric-arm --config FILE [key=value ...]``; returns the exit status (2 on a config error)."""
  parser = argparse.ArgumentParser(prog="jaxrl rubric-arm",
                                   description="Rubric-ARM: alternating GRPO of a rubric generator and a judge")
  parser.add_argument("--config", help="YAML config file")
  parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
  ns = parser.parse_args(argv)
  try:
    cfg = config_lib.load(RubricARMConfig, ns.config, ns.overrides)
  except config_lib.ConfigError as e:
    print(f"jaxrl rubric-arm: config error: {e}", file=sys.stderr)
    return 2
  arm = RubricARM(cfg)
  try:
    arm.run()
  finally:
    arm.close()
  print(f"wrote {cfg.out_dir} (phases: {Path(cfg.out_dir) / 'phases.jsonl'})")
  return 0
