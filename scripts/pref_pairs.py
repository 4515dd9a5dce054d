"""Writes the built-in arithmetic preference pairs (``train.jsonl``, ``heldout.jsonl``) for `jaxrl dpo`.

  python scripts/pref_pairs.py OUT_DIR --seed 0 --rejected mixed [--n-train 2000 --n-heldout 128]
  python scripts/pref_pairs.py OUT_DIR --seed 0 --sample-from runs/rm_sft/hf [--k 8 --per-prompt 2]

``--rejected`` is one of ``jaxrl.pref.REJECTED_KINDS``: ``operand`` (the rejected answer solves a question
with one operand moved: what ``data.builtin`` in configs/rm_tiny.yaml writes) or ``mixed`` (half of them
that, half the right question with one step's arithmetic wrong and carried on). ``--sample-from MODEL`` writes
on-policy pairs instead: ``jaxrl eval`` draws ``--k`` samples (T = 1) of each of ``--n-train`` distinct train
questions and ``--heldout-pool`` held-out ones, scored by ``jaxrl.rl:arithmetic_reward``, and
``jaxrl.pref.sampled_pairs`` pairs a correct sample with a wrong one of the same question (up to
``--per-prompt`` per train question; one per held-out question, the first ``--n-heldout``). Held-out
questions are never train questions (the built-in task's hashed split). ``--exclude FILE`` (JSONL records
with a ``prompt``) keeps those questions out of both splits' draws, so that an accuracy set such as
scripts/dpo_learning.sh's never holds a pair's question.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl import pref


def _sample(model: str, problems: list[dict], out: Path, args: argparse.Namespace) -> list[dict]:
  """``jaxrl eval``'s records (``k`` scored samples) of ``problems``, written and sampled under ``out``."""
  from jaxrl.cli import eval as eval_cli  # lazy: loads the model and the engine

  path = data_lib.write_jsonl(problems, out / "prompts.jsonl")
  argv = ["--model", model, "--data", str(path), "--task", "custom", "--reward", "jaxrl.rl:arithmetic_reward",
          "--n", str(args.k), "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", str(args.max_new_tokens),
          "--seed", str(args.seed), "--out", str(out)]
  if eval_cli.main(argv):
    sys.exit(f"pref_pairs.py: jaxrl eval {' '.join(argv)} failed")
  with open(out / "records.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _excluded(path: Path | None) -> set[str]:
  """The ``prompt`` of every record of ``path`` (none without one)."""
  if path is None:
    return set()
  with open(path, encoding="utf-8") as f:
    return {json.loads(line)["prompt"] for line in f if line.strip()}


def sampled(a: argparse.Namespace) -> tuple[Path, Path]:
  """Writes the on-policy pairs of ``--sample-from`` (module docstring)."""
  task = data_lib.ArithmeticConfig.level(a.difficulty)
  excluded = _excluded(a.exclude)
  out = {}
  for split, n, per_prompt in (("train", a.n_train, a.per_prompt), ("heldout", a.heldout_pool, 1)):
    # The first n questions of the seed's draw that are not excluded (without --exclude: the draw of n).
    drawn = data_lib.generate_arithmetic(n + len(excluded), seed=a.seed, split=split, config=task,
                                         format="prompt_completion", unique=True)
    problems = [p for p in drawn if p["prompt"] not in excluded][:n]
    records = _sample(a.sample_from, problems, a.out_dir / f"samples_{split}", a)
    out[split] = pref.sampled_pairs(problems, records, seed=a.seed, per_prompt=per_prompt)
    print(f"{split}: {len(out[split])} pairs from {len(problems)} questions x {a.k} samples")
  if len(out["heldout"]) < a.n_heldout:
    sys.exit(f"pref_pairs.py: only {len(out['heldout'])} held-out pairs of {a.heldout_pool} questions, "
             f"--n-heldout is {a.n_heldout}; raise --heldout-pool")
  return (data_lib.write_jsonl(out["train"], a.out_dir / "train.jsonl"),
          data_lib.write_jsonl(out["heldout"][:a.n_heldout], a.out_dir / "heldout.jsonl"))


def main() -> None:
  """Parses the arguments and writes the two files."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out_dir", type=Path)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rejected", choices=pref.REJECTED_KINDS, default="mixed")
  ap.add_argument("--n-train", type=int, default=2000)
  ap.add_argument("--n-heldout", type=int, default=128)
  ap.add_argument("--difficulty", type=int, default=2)
  s = ap.add_argument_group("on-policy", "pairs of the model's own correct and wrong samples")
  s.add_argument("--sample-from", default=None, metavar="MODEL", help="HF directory of the model to sample")
  s.add_argument("--k", type=int, default=8, help="samples per question")
  s.add_argument("--per-prompt", type=int, default=2, help="most pairs per train question")
  s.add_argument("--heldout-pool", type=int, default=384, help="held-out questions sampled")
  s.add_argument("--max-new-tokens", type=int, default=32)
  s.add_argument("--exclude", type=Path, default=None, metavar="JSONL",
                 help="records whose prompt no pair's question may be (e.g. an accuracy eval set)")
  a = ap.parse_args()
  if a.sample_from:
    paths = sampled(a)
  else:
    builtin = data_lib.BuiltinTask(n_train=a.n_train, n_heldout=a.n_heldout, difficulty=a.difficulty, seed=a.seed)
    paths = pref.write_builtin_pairs(a.out_dir, builtin, rejected=a.rejected)
  for path in paths:
    print(path)


if __name__ == "__main__":
  main()
