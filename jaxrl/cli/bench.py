"""``jaxrl bench NAME [options]``: a benchmark of :mod:`jaxrl.bench` against a peer in the same run.

The peers' harnesses are scripts in the repository's ``benchmarks/`` folder (:mod:`jaxrl.bench._harness`).
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "attention": "jaxrl.bench.attention",
    "sample": "jaxrl.bench.sample",
    "sft": "jaxrl.bench.sft",
    "lora": "jaxrl.bench.lora",
    "precision": "jaxrl.bench.precision",
    "rl": "jaxrl.bench.rl",
    "rl-async": "jaxrl.bench.rl_async",
    "dpo": "jaxrl.bench.dpo",
    "judge": "jaxrl.bench.judge",
    "device": "jaxrl.bench.device",
}
"""Benchmark name -> its module (imported when it runs); each has ``main(argv) -> int``."""


def main(argv: list[str]) -> int:
  """Runs benchmark ``argv[0]`` with the rest of the line; returns its exit status."""
  p = argparse.ArgumentParser(prog="jaxrl bench",
                              description="benchmarks against a peer in the same run; prints a table and writes JSON")
  p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
  p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
  ns = p.parse_args(argv)
  return importlib.import_module(BENCHES[ns.name]).main(ns.rest)
