"""``jaxrl rl --config FILE [key=value ...]``: load an :class:`RLConfig`, train, print the outcome."""

from __future__ import annotations

import argparse
import sys

from jaxrl import config as config_lib
from jaxrl import sharding
from jaxrl.envs import AgenticRLConfig, AgenticTrainer
from jaxrl.rl import RLConfig, make_trainer


def main(argv: list[str] | None = None) -> int:
  """Runs RL from a YAML config plus overrides; returns the exit status (2 on a config error)."""
  parser = argparse.ArgumentParser(prog="jaxrl rl", description="GRPO / DAPO / GRPO+ / decoupled PPO")
  parser.add_argument("--config", help="YAML config file")
  parser.add_argument("--target", default=None,
                      help="apply the recipe's plan.overrides for this hardware target first (docs/scaling.md)")
  parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
  ns = parser.parse_args(argv)
  sharding.initialize()  # multi-host when JAXRL_COORDINATOR/... or JAXRL_AUTO_DISTRIBUTED=1 are set (docs/multihost.md)
  config_cls = RLConfig
  try:
    if ns.config and "env" in config_lib.read_yaml(ns.config):  # agentic RL: jaxrl.envs (docs/agentic.md)
      config_cls = AgenticRLConfig
    cfg = config_lib.load(config_cls, ns.config, ns.overrides)
    if ns.target:  # the recipe's variant for that hardware, then the command line's overrides again
      cfg = config_lib.load(config_cls, ns.config, [*cfg.plan.for_target(ns.target), *ns.overrides])
  except (config_lib.ConfigError, ValueError) as e:
    print(f"jaxrl rl: config error: {e}", file=sys.stderr)
    return 2
  if config_cls is not RLConfig:
    trainer = AgenticTrainer(cfg)
  else:  # with asynchronous: AReaL / one-off pipelining on rollout + trainer sub-meshes (docs/async.md)
    trainer = make_trainer(cfg)
  try:
    out = trainer.run()
  finally:
    trainer.close()
  before = out.get("eval_before", {}).get("eval/accuracy")
  after = out.get("eval_after", {}).get("eval/accuracy")
  if before is not None and after is not None:
    print(f"held-out accuracy: {before:.3f} -> {after:.3f}")
  print(f"wrote {cfg.out_dir} (plot: {out.get('plot')})")
  return 0
