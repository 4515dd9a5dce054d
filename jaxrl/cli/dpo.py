"""``jaxrl dpo [--config FILE] [key=value ...]``: preference optimisation (DPO, IPO, SimPO, ORPO, ...) on pairs, or a
Bradley–Terry reward model (``loss.name: bradley_terry``)."""

from __future__ import annotations

from jaxrl import config as config_lib
from jaxrl import pref, sharding
from jaxrl.cli._args import config_parser


def main(argv: list[str]) -> int:
  """Trains with :class:`jaxrl.pref.DPOTrainer`; returns the exit status."""
  ns = config_parser("dpo", "preference optimisation on chosen/rejected pairs (default: tiny model, built-in "
                     "arithmetic pairs)").parse_args(argv)
  sharding.initialize()  # multi-host when JAXRL_COORDINATOR/... or JAXRL_AUTO_DISTRIBUTED=1 are set (docs/multihost.md)
  cfg = config_lib.load(pref.DPOConfig, ns.config, ns.overrides)
  pref.DPOTrainer(cfg).run()
  return 0
