"""Where the peers' harnesses live: the repository's top-level ``benchmarks/`` folder.

They are plain scripts run by the peers' own virtualenvs (TRL, Tunix, HF transformers) and import no
jaxrl module, so they are not part of the installed package: ``jaxrl bench`` runs them from a checkout.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
"""``benchmarks/`` next to the ``jaxrl/`` package directory of a checkout."""


def harness(path: Path) -> Path:
  """``path`` (a script under :data:`BENCHMARKS`) if it exists; a one-line ``FileNotFoundError`` if not."""
  if not path.is_file():
    raise FileNotFoundError(f"peer harness {path} not found: jaxrl bench runs its peers from a checkout of the "
                            "jaxrl repository (benchmarks/ next to jaxrl/; pip install -e .)")
  return path
