#!/usr/bin/env bash
# The reward model as the RL reward (docs/benchmarks.md, "Bradley–Terry reward model ... fourth and fifth
# attempts"): one SFT start, then per seed (a) arithmetic preference pairs (correct vs wrong worked answers),
# (b) a Bradley–Terry reward model with the log-prob feature (loss.pooling: mean, loss.logprob_feature: true),
# (c) GRPO from the SFT export with that reward model as the only reward (reward.model) and, as the control, with
# the verifier (jaxrl.rl:arithmetic_reward), (d) `jaxrl eval` of the SFT start and of both RL exports on held-out
# questions scored by the verifier: greedy, and 4 samples at T = 1.
# Run from the repository root. Overrides:
#   START     clean: sft_tiny for 1200 steps on 20,000 demonstrations, every one ending `Answer: v` (default);
#             endings: the same, but 70 % of the demonstrations end `The answer is v.` (the quickstart's mix),
#             which the verifier does not accept
#   PAIRS     mixed: the built-in pairs with mixed wrong answers, 20,000 (default); onpolicy: the start's own
#             T = 1 samples, a correct one against a wrong one of the same question (scripts/pref_pairs.py)
#   RM_START  small: the reward models start from the SFT start (default); big: from a 4-layer, 128-wide model
#             trained like the clean start (runs/rm_big_sft, 15 min on 2 cores)
#   HELDOUT_N held-out questions (256, the default, or up to the split's 966); STEPS (GRPO steps, 200); LR (GRPO
#             learning rate, 1e-4); RM_STEPS (300); RM_LR (1e-3); RM_TRUNK (the trunk's learning-rate multiplier,
#             0.01); RM_TAG (a suffix of the reward models' names); SEEDS ("0 1 2"); TAG (a suffix of the RL runs)
set -euo pipefail
PY=${PYTHON:-python}
STEPS=${STEPS:-200}
LR=${LR:-1e-4}
TAG=${TAG:-}
START=${START:-clean}
PAIRS=${PAIRS:-mixed}
RM_START=${RM_START:-small}
HELDOUT_N=${HELDOUT_N:-256}
RM_LR=${RM_LR:-1e-3}
RM_TRUNK=${RM_TRUNK:-0.01}
RM_TAG=${RM_TAG:-_t01}
RM_STEPS=${RM_STEPS:-300}
SEEDS=${SEEDS:-0 1 2}
TINY=configs/sft_tiny.yaml
if [ $START = endings ]; then
  SFT=runs/rm_sft1200_endings/hf
  [ -f $SFT/model.safetensors ] || { $PY -c "
from jaxrl import data, quickstart
data.write_jsonl(quickstart.sft_records(20000, seed=0), 'runs/rm_sft1200_endings_data/train.jsonl')"
    $PY -m jaxrl.cli sft --config $TINY 'data={"train": ["runs/rm_sft1200_endings_data/train.jsonl"], "builtin": null}' \
      steps=1200 eval.every=0 eval.exact_match=0 checkpoint.every=0 export_hf=true out_dir=runs/rm_sft1200_endings; }
else
  SFT=runs/rm_sft1200/hf
  [ -f $SFT/model.safetensors ] || $PY -m jaxrl.cli sft --config $TINY steps=1200 data.builtin.n_train=20000 \
    eval.every=400 eval.exact_match=64 checkpoint.every=0 out_dir=runs/rm_sft1200
fi
POLICY=${POLICY:-$SFT}
RM_SFT=$SFT
if [ $RM_START = big ]; then  # the clean recipe on a 4x larger model: ~4x fewer held-out errors than the small one
  RM_SFT=runs/rm_big_sft/hf
  [ -f $RM_SFT/model.safetensors ] || $PY -m jaxrl.cli sft --config $TINY 'model.overrides={"vocab_size": 128,
    "hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
    "dtype": "float32", "param_dtype": "float32"}' steps=1500 optim.lr=2e-3 data.builtin.n_train=20000 \
    eval.every=500 eval.exact_match=64 checkpoint.every=0 export_hf=true out_dir=runs/rm_big_sft
fi
HELDOUT=runs/rm_rl_heldout.jsonl  # 256 questions (seed 7); any other HELDOUT_N draws seed 11
[ $HELDOUT_N = 256 ] || HELDOUT=runs/rm_rl_heldout_n$HELDOUT_N.jsonl
[ -f $HELDOUT ] || $PY -c "
from jaxrl import data
data.write_jsonl(data.generate_arithmetic($HELDOUT_N, seed=7 if $HELDOUT_N == 256 else 11, split='heldout',
                 config=data.ArithmeticConfig.level(2), format='prompt_completion', unique=True), '$HELDOUT')"
EVAL_TAG=$([ $HELDOUT_N = 256 ] || echo "_n$HELDOUT_N")
START_TAG=$([ $START = endings ] && echo _endings || true)
RM_NAME=rm_lp${START_TAG}$([ $PAIRS = onpolicy ] && echo _onpol || true)$([ $RM_START = big ] && echo _big || true)${RM_TAG}
score() {  # score MODEL OUT: greedy and 4 samples at T = 1 on the held-out questions, scored by the verifier
  for t in 0 1; do
    n=$([ $t = 0 ] && echo 1 || echo 4)
    [ -f $2_t$t/summary.json ] || $PY -m jaxrl.cli eval --model $1 --data $HELDOUT --task custom \
      --reward jaxrl.rl:arithmetic_reward --temperature $t --top-p 1.0 --n $n --max-new-tokens 32 --seed 0 --out $2_t$t \
      > $2_t$t.log 2>&1
  done
}
score $POLICY runs/rm_rl_eval_start${START_TAG}${TAG}${EVAL_TAG}
for s in $SEEDS; do
  if [ $PAIRS = onpolicy ]; then
    P=runs/pairs_onpol${START_TAG}_s$s
    [ -f $P/train.jsonl ] || $PY scripts/pref_pairs.py $P --seed $s --sample-from $SFT --n-train 1500 --k 8 \
      --per-prompt 2 --max-new-tokens 40
  else
    P=runs/pairs_mixed20k_s$s
    [ -f $P/train.jsonl ] || $PY scripts/pref_pairs.py $P --seed $s --rejected mixed --n-train 20000
  fi
  RM=runs/${RM_NAME}_s$s
  [ -f $RM/hf/reward_head.safetensors ] || $PY -m jaxrl.cli dpo --config configs/rm_tiny.yaml \
    "model={\"hf_dir\": \"$RM_SFT\"}" "data.train=[\"$P/train.jsonl\"]" "data.heldout=[\"$P/heldout.jsonl\"]" \
    data.shuffle_seed=$s loss.pooling=mean loss.logprob_feature=true optim.lr=$RM_LR \
    "optim.lr_multipliers={\"^trunk/\": $RM_TRUNK}" steps=$RM_STEPS eval.every=50 checkpoint.every=0 out_dir=$RM
  for arm in rm verifier; do
    if [ $arm = rm ]; then reward="reward={\"model\": {\"path\": \"$RM/hf\", \"rows\": 8, \"seq_len\": 256}}"
      out=runs/rm_rl_rm${TAG}${RM#runs/rm_lp}
    else reward='reward={"fn": "jaxrl.rl:arithmetic_reward", "correct_threshold": 0.5}'
      out=runs/rm_rl_verifier${START_TAG}${TAG}_s$s
    fi
    [ -f $out/hf/model.safetensors ] || $PY -m jaxrl.cli rl --config configs/grpo_tiny.yaml model.preset=null \
      model.hf_dir=$POLICY "$reward" seed=$s steps=$STEPS optim.lr=$LR eval.every=0 checkpoint.every=0 export_hf=true out_dir=$out
    score $out/hf runs/rm_rl_eval_${out#runs/rm_rl_}$EVAL_TAG
  done
done
$PY - <<'PY'
import glob, json, os
def acc(p):  # the verifier's accuracy: greedy (avg@1) or the mean over the 4 samples (avg@4)
  if not os.path.exists(p + "/summary.json"):
    return "-"
  m = json.load(open(p + "/summary.json"))["metrics"]
  return f"{m.get('avg@1', m.get('avg@4')):.3f}"
print(f"{'run':40s} {'greedy':>7s} {'T=1':>7s}")
for name in sorted({n[len("runs/rm_rl_eval_"):-3] for n in glob.glob("runs/rm_rl_eval_*_t0")}):
  print(f"{name:40s} {acc(f'runs/rm_rl_eval_{name}_t0'):>7s} {acc(f'runs/rm_rl_eval_{name}_t1'):>7s}")
PY
