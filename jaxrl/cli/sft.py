"""``jaxrl sft [--config FILE] [key=value ...]``: supervised fine-tuning with packing."""

from __future__ import annotations

from jaxrl import config as config_lib
from jaxrl import sft, sharding
from jaxrl.cli._args import config_parser


def main(argv: list[str]) -> int:
  """Trains with :class:`jaxrl.sft.SFTTrainer`; returns the exit status."""
  ns = config_parser("sft", "supervised fine-tuning with packing (default: tiny model on the built-in task)"
                     ).parse_args(argv)
  sharding.initialize()  # multi-host when JAXRL_COORDINATOR/... or JAXRL_AUTO_DISTRIBUTED=1 are set (docs/multihost.md)
  cfg = config_lib.load(sft.SFTConfig, ns.config, ns.overrides)
  sft.SFTTrainer(cfg).run()
  return 0
