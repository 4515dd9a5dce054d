#!/usr/bin/env bash
# Reward-model table of docs/benchmarks.md ("Bradley–Terry reward model ... third attempt"): a longer SFT start
# (1200 steps, 20,000 train records: 48 % greedy exact match at difficulty 2), then per seed on-policy pairs
# (scripts/pref_pairs.py --sample-from: 8 samples at T = 1 of 1,500 train and 384 held-out questions, a correct
# vs a wrong sample of one question, scored by jaxrl.rl:arithmetic_reward) and a Bradley–Terry reward model
# from the SFT export. Run from the repository root; STEPS overrides 300, POOLING (last | mean) loss.pooling.
set -euo pipefail
PY=${PYTHON:-python}
STEPS=${STEPS:-300}
POOLING=${POOLING:-last}
[ -f runs/rm_sft1200/hf/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_tiny.yaml steps=1200 \
  data.builtin.n_train=20000 eval.every=400 eval.exact_match=64 checkpoint.every=0 out_dir=runs/rm_sft1200
for s in 0 1 2; do
  [ -f runs/onpol_s$s/heldout.jsonl ] || $PY scripts/pref_pairs.py runs/onpol_s$s --seed $s \
    --sample-from runs/rm_sft1200/hf --n-train 1500 --k 8 --per-prompt 2
  $PY -m jaxrl.cli dpo --config configs/rm_tiny.yaml 'model={"hf_dir": "runs/rm_sft1200/hf"}' \
    "data.train=[\"runs/onpol_s$s/train.jsonl\"]" "data.heldout=[\"runs/onpol_s$s/heldout.jsonl\"]" \
    data.shuffle_seed=$s loss.pooling=$POOLING steps=$STEPS eval.every=50 checkpoint.every=0 \
    out_dir=runs/rm_onpol_${POOLING}_s$s
done
