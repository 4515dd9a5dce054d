#!/usr/bin/env bash
# Vision-R1-style GRPO table of docs/benchmarks.md ("Vision-R1-style GRPO (issue 31 (a)), second attempt"): does GRPO
# with the verifiable image reward raise a tiny Qwen2.5-VL's sampled held-out accuracy above its warm start, and
# above an image-ablated control (pixels zeroed in the warm start and in RL)?
#  1. Warm start per seed S and arm Z (false: images, true: zeroed pixels): 85 steps of
#     configs/sft_vl_color_tiny.yaml (the colour of one large shape, 4 colours).
#  2. GRPO from it: configs/vision_r1_tiny.yaml on the same task, 60 steps of 8 prompts x 8 samples, lr 3e-5
#     (lr 1e-4 collapsed the policy to one colour, docs/benchmarks.md), held-out accuracy every 30 steps as
#     avg@4 at temperature 1 over 64 held-out images (the character-level tiny tokenizer makes a sampled colour
#     word often misspelt, so sampled accuracy is far below greedy and is what RL moves).
# Run from the repository root; PYTHON picks the interpreter, SEEDS the seeds, STEPS and LR the RL run.
set -euo pipefail
PY=${PYTHON:-python}
STEPS=${STEPS:-60}
LR=${LR:-3e-5}
TASK='{n_train: 256, n_heldout: 64, difficulty: 0, image_size: 56, seed: 0, questions: [leftmost_color], max_objects: 1, num_colors: 4, shape_scale: 4.0}'
for S in ${SEEDS:-0 1 2}; do
  for Z in false true; do
    W=runs/vr1_warm85_s${S}_z$Z
    [ -f $W/hf/model.safetensors ] || $PY -m jaxrl.cli sft --config configs/sft_vl_color_tiny.yaml steps=85 \
      eval.every=85 model.seed=$S data.shuffle_seed=$S data.zero_pixels=$Z out_dir=$W
    $PY -m jaxrl.cli rl --config configs/vision_r1_tiny.yaml model.preset=null model.hf_dir=$W/hf seed=$S \
      data.shuffle_seed=$S data.zero_pixels=$Z "data.image_task=$TASK" rollout.max_new_tokens=16 \
      'rollout.context_schedule=[]' rollout.n=8 rollout.prompts_per_step=8 \
      'micro_batch={token_budget: 2560, row_len: 160}' eval.prompts=64 eval.every=$((STEPS / 2)) \
      eval.temperature=1.0 eval.samples=4 steps=$STEPS optim.lr=$LR log_samples=8 out_dir=runs/vr1_grpo_s${S}_z$Z
  done
done
