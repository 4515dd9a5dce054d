#!/usr/bin/env bash
# Reward-model learning table of docs/benchmarks.md ("Bradley–Terry reward model ... second attempt"):
# one SFT start, the built-in arithmetic pairs with mixed wrong answers (scripts/pref_pairs.py), then three
# Bradley–Terry reward-model seeds from the SFT export. Run from the repository root; STEPS overrides 300.
set -euo pipefail
PY=${PYTHON:-python}
STEPS=${STEPS:-300}
$PY -m jaxrl.cli sft --config configs/sft_tiny.yaml eval.every=300 checkpoint.every=0 out_dir=runs/rm_sft
for s in 0 1 2; do
  $PY scripts/pref_pairs.py runs/pairs_mixed_s$s --seed $s --rejected mixed
  $PY -m jaxrl.cli dpo --config configs/rm_tiny.yaml 'model={"hf_dir": "runs/rm_sft/hf"}' \
    "data.train=[\"runs/pairs_mixed_s$s/train.jsonl\"]" "data.heldout=[\"runs/pairs_mixed_s$s/heldout.jsonl\"]" \
    data.shuffle_seed=$s steps=$STEPS eval.every=100 checkpoint.every=0 out_dir=runs/rm_mixed_s$s
done
