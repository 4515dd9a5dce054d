"""``jaxrl rs``: rejection sampling for SFT (DeepSeek-R1's stage 3): ``k`` completions per prompt from a local
checkpoint, the ones a reward accepts, deduplicated, written as an SFT data set, optionally trained on at once
with ``jaxrl sft`` (docs/eval.md, "Rejection sampling for SFT")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
from jaxrl.cli import eval as eval_cli
from jaxrl.cli import sft as sft_cli
from jaxrl.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
  """The options of ``jaxrl rs``."""
  p = argparse.ArgumentParser(prog="jaxrl rs", description="rejection sampling for SFT: k samples per prompt, "
                              "keep the ones the reward accepts, deduplicate, write an SFT data set (docs/eval.md)")
  eval_cli.add_sampling_args(p, unit="prompt")
  p.add_argument("--out", required=True, help="output directory (records, sft.jsonl, stats); a rerun with the "
                                              "same sampling settings resumes from its records")
  p.add_argument("--k", type=int, default=8, help="samples per prompt")
  p.add_argument("--keep-per-prompt", type=int, default=None, help="keep at most N samples per prompt")
  p.add_argument("--keep-truncated", action="store_true", help="keep accepted samples that hit --max-new-tokens")
  p.add_argument("--threshold", type=float, default=0.5, help="a sample is accepted when its reward is above")
  t = p.add_argument_group("sft", "train on the written data set at once")
  t.add_argument("--then-sft", default=None, metavar="CONFIG",
                 help="run jaxrl sft with this YAML config and data.train set to the written sft.jsonl")
  t.add_argument("--sft-override", action="append", default=[], metavar="KEY=VALUE",
                 help="a further jaxrl sft override (e.g. steps=100); repeatable")
  return p


def _setup(args):
  """Settings, scorer, problems and sampler from the arguments (a user's mistake raises)."""
  if args.keep_per_prompt is not None and args.keep_per_prompt < 1:
    raise ValueError(f"--keep-per-prompt must be >= 1, got {args.keep_per_prompt}")
  return eval_cli.setup(args, n=args.k, threshold=args.threshold)


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxrl rs``; prints the statistics table (and runs ``jaxrl sft``); returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    settings, scorer, problems, sampler = _setup(args)
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl rs: error: {e}", file=sys.stderr)
    return 2
  info = {"model": str(Path(args.model).resolve()), "data": str(Path(args.data).resolve()), "task": args.task,
          "reward": args.reward, "template": args.template, "backend": args.backend, "mesh": args.mesh}
  chunk = args.chunk or max(1, -(-2 * args.num_slots // args.k))
  try:
    with scorer:
      stats = eval_lib.rejection_sample(sampler, scorer, problems, settings, args.out, chunk=chunk,
                                        keep_per_prompt=args.keep_per_prompt, keep_truncated=args.keep_truncated,
                                        run_info=info)
  except ConfigError as e:  # records of other sampling settings in --out
    print(f"jaxrl rs: error: {e}", file=sys.stderr)
    return 2
  print(eval_lib.stats_markdown(stats))
  print(f"\ndata set: {stats['dataset']}\nstats: {Path(args.out) / eval_lib.STATS}")
  if args.then_sft is None:
    return 0
  if not stats["kept"]:
    print("jaxrl rs: error: no sample was kept; not running jaxrl sft", file=sys.stderr)
    return 2
  del sampler  # free the engine's KV cache before the trainer allocates
  return sft_cli.main(["--config", args.then_sft, f"data.train={json.dumps([stats['dataset']])}",
                       *args.sft_override])


if __name__ == "__main__":
  sys.exit(main())
