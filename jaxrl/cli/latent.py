"""``jaxrl latent [--config FILE] [key=value ...]``: Coconut training and latent decoding (docs/latent.md)."""

from __future__ import annotations

from jaxrl import config as config_lib
from jaxrl import latent
from jaxrl.cli._args import config_parser


def main(argv: list[str]) -> int:
  """Runs :func:`jaxrl.latent.main` on the loaded :class:`~jaxrl.latent.CoconutConfig`; returns the exit status."""
  ns = config_parser("latent", "Coconut: training with continuous latent thoughts (stage curriculum, ablations) "
                     "and latent decoding").parse_args(argv)
  latent.main(config_lib.load(latent.CoconutConfig, ns.config, ns.overrides))
  return 0
