"""Writes the built-in arithmetic preference pairs (``train.jsonl``, ``heldout.jsonl``) for `jaxrl dpo`.

  python scripts/pref_pairs.py OUT_DIR --seed 0 --rejected mixed [--n-train 2000 --n-heldout 128]

``--rejected`` is one of ``jaxrl.pref.REJECTED_KINDS``: ``operand`` (the rejected answer solves a question
with one operand moved: what ``data.builtin`` in configs/rm_tiny.yaml writes) or ``mixed`` (half of them
that, half the right question with one step's arithmetic wrong and carried on). Held-out questions are never
train questions (the built-in task's hashed split).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl import pref


def main() -> None:
  """Parses the arguments and writes the two files."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out_dir", type=Path)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rejected", choices=pref.REJECTED_KINDS, default="mixed")
  ap.add_argument("--n-train", type=int, default=2000)
  ap.add_argument("--n-heldout", type=int, default=128)
  ap.add_argument("--difficulty", type=int, default=2)
  a = ap.parse_args()
  builtin = data_lib.BuiltinTask(n_train=a.n_train, n_heldout=a.n_heldout, difficulty=a.difficulty, seed=a.seed)
  for path in pref.write_builtin_pairs(a.out_dir, builtin, rejected=a.rejected):
    print(path)


if __name__ == "__main__":
  main()
