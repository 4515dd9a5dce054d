"""The implicit PRM of a `jaxrl dpo` run reproduces that run's held-out evaluation (docs/pref.md).

    python scripts/implicit_prm_check.py --policy runs/dpo_tiny/hf --reference REF_HF --beta 0.1

On the built-in held-out pairs (``--n``, ``--seed``, ``--difficulty`` as the DPO config's ``data.builtin``) it prints
the pairwise accuracy and mean margin of the sequence implicit rewards ``Σ_t q_t`` (DPO's ``eval_accuracy`` and
``eval_margin``), the step rewards of one chosen answer, and how often best-of-2 by the minimum step reward keeps
the chosen answer.
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxrl import data as data_lib
from jaxrl import pref


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--policy", required=True)
  ap.add_argument("--reference", required=True)
  ap.add_argument("--beta", type=float, required=True)
  ap.add_argument("--n", type=int, default=64)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--difficulty", type=int, default=2)
  ap.add_argument("--seq-len", type=int, default=256)
  ap.add_argument("--delimiter", default=". ")
  args = ap.parse_args()
  pairs = pref.arithmetic_pairs(args.n, split="heldout", seed=args.seed,
                                task=data_lib.ArithmeticConfig.level(args.difficulty))
  prm = pref.ImplicitPRM.load(args.policy, args.reference, beta=args.beta, rows=8, seq_len=args.seq_len)
  prompts = [p["prompt"] for p in pairs]
  rc = np.array([q.sum() for q in prm.token_rewards(prompts, [p["chosen"] for p in pairs])])
  rr = np.array([q.sum() for q in prm.token_rewards(prompts, [p["rejected"] for p in pairs])])
  print(f"pairs {len(pairs)}  accuracy {np.mean(rc > rr):.4f}  margin {np.mean(rc - rr):.5f}")
  steps = prm.step_rewards(prompts[:1], [pairs[0]["chosen"]], delimiter=args.delimiter)[0]
  print(f"chosen {pairs[0]['chosen']!r}: step rewards {[round(float(x), 4) for x in steps]}")
  kept = prm.best_of_n(prompts, [[p["rejected"], p["chosen"]] for p in pairs], delimiter=args.delimiter)
  print(f"best-of-2 by the minimum step reward keeps the chosen answer: {np.mean(kept == 1):.4f}")


if __name__ == "__main__":
  main()
