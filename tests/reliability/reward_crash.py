"""Reward functions that kill their process worker (imported by path in the worker processes)."""

import os
from pathlib import Path


def crash(prompt, completion, marker_dir):
  """``len(completion)``; ``die`` kills its worker the first time it is scored, ``kill`` every time."""
  if completion == "kill" or (completion == "die" and not (Path(marker_dir) / "died").exists()):
    (Path(marker_dir) / "died").touch()
    os._exit(1)
  return float(len(completion))
