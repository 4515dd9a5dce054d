#!/usr/bin/env bash
# DPO table of docs/benchmarks.md ("DPO on on-policy arithmetic pairs: held-out accuracy (issue 32)"): does DPO
# on the SFT model's own correct-vs-wrong answers raise its greedy held-out accuracy above the SFT start?
#  1. SFT start, as scripts/pref_learning_onpolicy.sh (1200 steps, 20,000 train records) but scored with
#     eval.max_new_tokens=40 (24 cuts three-term answers); reused when runs/rm_sft1200/hf exists.
#  2. A fixed accuracy set: the first N_EVAL distinct held-out-split questions of seed 1000 (difficulty 2).
#     The SFT start never trained on a held-out-split question, and --exclude keeps every pair's question
#     (train and held-out pairs, every seed) out of it.
#  3. Per seed: on-policy pairs (scripts/pref_pairs.py --sample-from: 8 samples at T = 1 of 1,500 train and 384
#     held-out questions, a correct vs a wrong sample, jaxrl.rl:arithmetic_reward), DPO from the SFT export
#     (configs/dpo_tiny.yaml, reference: model; LOSS, LR, BETA, STEPS, NLL below), and greedy exact match of
#     the export on the accuracy set (jaxrl eval, T = 0, 40 new tokens); the SFT start is scored the same way.
# Validation (how LR, BETA, STEPS, NLL were chosen on seed 0 without looking at the accuracy set): greedy exact
# match on the seed's 384 held-out pair questions (disjoint from the accuracy set and from the train pairs).
# The defaults are the chosen setting (RPO: DPO + 5 x the chosen answer's per-token NLL); plain DPO's row:
# NLL=0 STEPS=100. CONTROL=1 also runs, per seed, SFT on the train pairs' chosen answers alone (no preference
# term: rejection-sampling fine-tuning, ~16 answers a step like DPO's 16 pairs, lr 3e-5, 250 steps) and scores it
# the same way. Run from the repository root; PYTHON picks the interpreter, SEEDS the seeds.
set -euo pipefail
PY=${PYTHON:-python}
SEEDS=${SEEDS:-"0 1 2"}
N_EVAL=${N_EVAL:-400}
LR=${LR:-3.0e-5}
BETA=${BETA:-0.1}
STEPS=${STEPS:-200}
LOSS=${LOSS:-sigmoid}
NLL=${NLL:-5.0}  # loss.nll_coef: RPO's α (0: plain DPO)
TAG=${TAG:-${LOSS}_lr${LR}_b${BETA}_n${STEPS}$([ "$NLL" = 0 ] || echo _nll$NLL)}
SFT=runs/rm_sft1200
EVALSET=runs/dpo_acc/evalset.jsonl

[ -f $SFT/hf/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_tiny.yaml steps=1200 \
  data.builtin.n_train=20000 eval.every=400 eval.exact_match=64 eval.max_new_tokens=40 checkpoint.every=0 \
  out_dir=$SFT

mkdir -p runs/dpo_acc
$PY - "$EVALSET" "$N_EVAL" <<'EOF'
import sys
from jaxrl import data
problems = data.generate_arithmetic(int(sys.argv[2]), seed=1000, split="heldout",
                                    config=data.ArithmeticConfig.level(2), format="prompt_completion", unique=True)
data.write_jsonl(problems, sys.argv[1])
EOF

accuracy() {  # accuracy MODEL OUT [DATA]: greedy exact match of MODEL on DATA (the accuracy set), summary under OUT
  [ -f "$2/summary.json" ] || $PY -m jaxrl.cli eval --model "$1" --data "${3:-$EVALSET}" --task custom \
    --reward jaxrl.rl:arithmetic_reward --n 1 --temperature 0 --max-new-tokens 40 --seed 0 --out "$2" >/dev/null
  $PY -c "import json, sys; print(json.load(open(sys.argv[1]))['metrics'])" "$2/summary.json"
}

echo "SFT start: $(accuracy $SFT/hf runs/dpo_acc/sft)"
for s in $SEEDS; do
  [ -f runs/dpo_pairs_s$s/heldout.jsonl ] || $PY scripts/pref_pairs.py runs/dpo_pairs_s$s --seed $s \
    --sample-from $SFT/hf --n-train 1500 --k 8 --per-prompt 2 --max-new-tokens 40 --exclude $EVALSET
  out=runs/dpo_acc/${TAG}_s$s
  [ -f $out/hf/model.safetensors ] || $PY -m jaxrl.cli dpo --config configs/dpo_tiny.yaml \
    "model={\"hf_dir\": \"$SFT/hf\"}" "data.train=[\"runs/dpo_pairs_s$s/train.jsonl\"]" \
    "data.heldout=[\"runs/dpo_pairs_s$s/heldout.jsonl\"]" data.shuffle_seed=$s loss.name=$LOSS loss.nll_coef=$NLL \
    optim.lr=$LR loss.beta=$BETA steps=$STEPS eval.every=50 checkpoint.every=0 export_hf=true out_dir=$out \
    2>&1 | tee $out.log
  val=runs/dpo_pairs_s$s/samples_heldout/prompts.jsonl  # validation: this seed's 384 held-out pair questions
  echo "seed $s validation: SFT start $(accuracy $SFT/hf runs/dpo_acc/sft_val_s$s $val)" \
    "DPO $TAG $(accuracy $out/hf $out/val $val)"
  grep -E "^dpo $STEPS/" $out.log || true
  echo "seed $s DPO $TAG: $(accuracy $out/hf $out/acc)"
  [ "${CONTROL:-0}" = 1 ] || continue
  ctl=runs/dpo_acc/sftchosen_lr3.0e-5_n250_s$s
  $PY -c "import json, sys; [print(json.dumps({'prompt': r['prompt'], 'completion': r['chosen']}))
          for r in map(json.loads, open(sys.argv[1]))]" runs/dpo_pairs_s$s/train.jsonl > runs/dpo_pairs_s$s/chosen.jsonl
  [ -f $ctl/hf/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_tiny.yaml \
    "model={\"hf_dir\": \"$SFT/hf\"}" "data.train=[\"runs/dpo_pairs_s$s/chosen.jsonl\"]" \
    "data.heldout=[\"runs/dpo_pairs_s$s/chosen.jsonl\"]" packing.global_rows=2 optim.lr=3.0e-5 optim.warmup_steps=5 \
    steps=250 eval.every=0 eval.exact_match=0 checkpoint.every=0 out_dir=$ctl > $ctl.log 2>&1
  echo "seed $s validation: SFT on chosen $(accuracy $ctl/hf $ctl/val $val)"
  echo "seed $s SFT on chosen: $(accuracy $ctl/hf $ctl/acc)"
done
