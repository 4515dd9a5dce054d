#!/usr/bin/env bash
# The reward model as the RL reward (docs/benchmarks.md, "Bradley–Terry reward model ... fourth attempt"): one SFT
# start (1200 steps), then per seed (a) the built-in arithmetic pairs with mixed wrong answers (20,000 train),
# (b) a Bradley–Terry reward model with the log-prob feature from the SFT export (loss.pooling: mean,
# loss.logprob_feature: true), (c) GRPO from the SFT export with that reward model as the only reward
# (reward.model) and, as the control, with the verifier (jaxrl.rl:arithmetic_reward), (d) `jaxrl eval` of the SFT
# start and of both RL exports on 256 held-out questions scored by the verifier: greedy, and 4 samples at T = 1.
# Run from the repository root. Overrides: STEPS (GRPO steps, 200), LR (GRPO learning rate, 1e-4), POLICY (the
# GRPO start, the SFT export), RM_STEPS (300), RM_LR (1e-3), RM_TRUNK (the trunk's learning-rate multiplier,
# 0.01), RM_TAG (a suffix of the reward models' names), SEEDS ("0 1 2"), TAG (a suffix of the RL runs' names).
set -euo pipefail
PY=${PYTHON:-python}
STEPS=${STEPS:-200}
LR=${LR:-1e-4}
TAG=${TAG:-}
POLICY=${POLICY:-runs/rm_sft1200/hf}
RM_LR=${RM_LR:-1e-3}
RM_TRUNK=${RM_TRUNK:-0.01}
RM_TAG=${RM_TAG:-_t01}
RM_STEPS=${RM_STEPS:-300}
SEEDS=${SEEDS:-0 1 2}
SFT=runs/rm_sft1200/hf
[ -f $SFT/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_tiny.yaml steps=1200 \
  data.builtin.n_train=20000 eval.every=400 eval.exact_match=64 checkpoint.every=0 out_dir=runs/rm_sft1200
[ -f runs/rm_rl_heldout.jsonl ] || $PY -c "
from jaxrl import data
data.write_jsonl(data.generate_arithmetic(256, seed=7, split='heldout', config=data.ArithmeticConfig.level(2),
                                          format='prompt_completion', unique=True), 'runs/rm_rl_heldout.jsonl')"
score() {  # score MODEL OUT: greedy and 4 samples at T = 1 on the held-out questions, scored by the verifier
  for t in 0 1; do
    n=$([ $t = 0 ] && echo 1 || echo 4)
    [ -f $2_t$t/summary.json ] || $PY -m jaxrl.cli eval --model $1 --data runs/rm_rl_heldout.jsonl --task custom \
      --reward jaxrl.rl:arithmetic_reward --temperature $t --top-p 1.0 --n $n --max-new-tokens 32 --seed 0 --out $2_t$t \
      > $2_t$t.log 2>&1
  done
}
score $POLICY runs/rm_rl_eval_start${TAG}
for s in $SEEDS; do
  [ -f runs/pairs_mixed20k_s$s/train.jsonl ] || $PY scripts/pref_pairs.py runs/pairs_mixed20k_s$s --seed $s \
    --rejected mixed --n-train 20000
  RM=runs/rm_lp${RM_TAG}_s$s
  [ -f $RM/hf/reward_head.safetensors ] || $PY -m jaxrl.cli dpo --config configs/rm_tiny.yaml \
    "model={\"hf_dir\": \"$SFT\"}" "data.train=[\"runs/pairs_mixed20k_s$s/train.jsonl\"]" \
    "data.heldout=[\"runs/pairs_mixed20k_s$s/heldout.jsonl\"]" data.shuffle_seed=$s loss.pooling=mean \
    loss.logprob_feature=true optim.lr=$RM_LR "optim.lr_multipliers={\"^trunk/\": $RM_TRUNK}" steps=$RM_STEPS \
    eval.every=50 checkpoint.every=0 out_dir=$RM
  for arm in rm verifier; do
    if [ $arm = rm ]; then reward="reward={\"model\": {\"path\": \"$RM/hf\", \"rows\": 8, \"seq_len\": 256}}"
    else reward='reward={"fn": "jaxrl.rl:arithmetic_reward", "correct_threshold": 0.5}'; fi
    out=runs/rm_rl_${arm}${TAG}$([ $arm = rm ] && echo "$RM_TAG" || true)_s$s
    [ -f $out/hf/model.safetensors ] || $PY -m jaxrl.cli rl --config configs/grpo_tiny.yaml model.preset=null \
      model.hf_dir=$POLICY "$reward" seed=$s steps=$STEPS optim.lr=$LR eval.every=0 checkpoint.every=0 export_hf=true out_dir=$out
    score $out/hf runs/rm_rl_eval_${out#runs/rm_rl_}
  done
done
$PY - <<'PY'
import glob, json, os
def acc(p):  # the verifier's accuracy: greedy (avg@1) or the mean over the 4 samples (avg@4)
  if not os.path.exists(p + "/summary.json"):
    return "-"
  m = json.load(open(p + "/summary.json"))["metrics"]
  return f"{m.get('avg@1', m.get('avg@4')):.3f}"
print(f"{'run':34s} {'greedy':>7s} {'T=1':>7s}")
for name in sorted({n[len("runs/rm_rl_eval_"):-3] for n in glob.glob("runs/rm_rl_eval_*_t0")}):
  print(f"{name:34s} {acc(f'runs/rm_rl_eval_{name}_t0'):>7s} {acc(f'runs/rm_rl_eval_{name}_t1'):>7s}")
PY
