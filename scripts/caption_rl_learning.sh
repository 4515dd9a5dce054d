#!/usr/bin/env bash
# Tiny CapRL / RubiCap learning tables of docs/benchmarks.md ("Tiny CapRL and RubiCap, 3 seeds", issue 31 Build 4
# (b) and (c)): does caption RL raise a tiny Qwen2.5-VL captioner's held-out caption utility (CapRL) or rubric
# satisfaction (RubiCap) above its SFT warm start, and does an image-ablated control (pixels zeroed in the warm start
# and in RL) stay at the text-only level?
#  1. Warm start per seed S and arm Z (false: images, true: zeroed pixels): configs/sft_caption_tiny.yaml, 300 steps.
#  2. RL from it: configs/${REWARD}_tiny.yaml (REWARD = caprl or rubicap): 80 steps of 8 prompts x 8 samples at lr
#     1e-4; held-out reward every 40 steps as the mean over 4 samples at temperature 1 of 64 held-out images; the
#     policy exported at the end.
#  3. Greedy held-out reward of the warm start and of the RL result: the step-0 evaluation (before any update) of
#     a 1-step run of the same config at T = 0; RubiCap's result also under CapRL's reward (caption utility).
# Run from the repository root; PYTHON picks the interpreter, SEEDS the seeds, ARMS the arms, REWARDS the recipes.
# ANSWERER=<hf dir of a text answerer> (configs/sft_caprl_answerer_tiny.yaml) makes CapRL's answerer that model,
# served by `jaxrl serve` (reward.kwargs.answerer.launch) with its replies cached per run, instead of the exact caption
# reader; TAG names the runs (runs/${REWARD}${TAG}_s..); GREEDY=0 skips the greedy before/after runs.
set -euo pipefail
PY=${PYTHON:-python}
TAG=${TAG:-}
rl() {  # rl REWARD OUT_DIR HF_DIR ZERO [overrides...]
  local reward=$1 out=$2 hf=$3 z=$4; shift 4
  local answerer=()
  if [ -n "${ANSWERER:-}" ] && [ $reward = caprl ]; then
    answerer=("reward.kwargs.answerer={launch: {model: $ANSWERER, platform: cpu}, max_concurrency: 64, max_retries: 1,
      cache_path: $out/answerer_cache.sqlite}" reward.runner.workers=16)
  fi
  $PY -m jaxrl.cli rl --config configs/${reward}_tiny.yaml model.preset=null model.hf_dir=$hf data.zero_pixels=$z \
    tensorboard=false out_dir=$out "${answerer[@]}" "$@"
}
for S in ${SEEDS:-0 1 2}; do
  for Z in ${ARMS:-false true}; do
    W=runs/cap_warm_s${S}_z$Z
    [ -f $W/hf/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_caption_tiny.yaml model.seed=$S \
      data.shuffle_seed=$S data.zero_pixels=$Z tensorboard=false out_dir=$W
    for REWARD in ${REWARDS:-caprl rubicap}; do
      R=runs/${REWARD}${TAG}_s${S}_z$Z
      rl $REWARD $R $W/hf $Z seed=$S data.shuffle_seed=$S export_hf=true log_samples=8
      if [ "${GREEDY:-1}" = 1 ]; then
        rl $REWARD $R/greedy_before $W/hf $Z steps=1 eval.every=1 eval.temperature=0 eval.samples=1
        rl $REWARD $R/greedy_after $R/hf $Z steps=1 eval.every=1 eval.temperature=0 eval.samples=1
      fi
      # RubiCap's result also scored by CapRL's caption utility (greedy): content that the rubric weights cannot trade
      [ $REWARD = caprl ] || rl caprl $R/caprl_greedy_after $R/hf $Z steps=1 eval.every=1 eval.temperature=0 eval.samples=1
      # A model answerer's result also scored by the exact caption reader: content, not captions the model misreads
      if [ $REWARD = caprl ] && [ -n "${ANSWERER:-}" ]; then
        ANSWERER= rl caprl $R/rule_greedy_after $R/hf $Z steps=1 eval.every=1 eval.temperature=0 eval.samples=1
      fi
    done
  done
done
