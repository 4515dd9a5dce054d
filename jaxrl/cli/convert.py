"""``jaxrl convert SRC DST`` (HF directory -> re-sharded HF directory) or ``jaxrl convert --preset NAME DST``."""

from __future__ import annotations

import argparse

from jaxrl import models


def main(argv: list[str]) -> int:
  """Runs :func:`jaxrl.models.convert` and prints what it wrote; returns the exit status."""
  p = argparse.ArgumentParser(prog="jaxrl convert", description="HF checkpoint directory <-> jaxrl (load, "
                              "re-shard, save), or a preset to a random HF dir")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="parameter dtype to write")
  p.add_argument("--tokenizer", default=None, help="tokenizer dir to copy alongside (default: the source's, if any)")
  p.add_argument("--preset", default=None, help="instead of SRC, write a randomly initialised model of this preset")
  p.add_argument("src", nargs="?", default=None, help="input HF directory")
  p.add_argument("dst", help="output HF directory")
  ns = p.parse_args(argv)
  print(models.convert(ns.src, ns.dst, dtype=ns.dtype, tokenizer=ns.tokenizer, preset=ns.preset))
  return 0
