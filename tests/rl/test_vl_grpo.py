"""configs/vision_r1_tiny.yaml end to end on CPU (issue 31): GRPO on a tiny Qwen2.5-VL over the built-in image
task, sampled by the rollout engine with the prompts' images, through both PTST stages of the sync trainer.

The contract checked at each step's first update: the packed batch the trainer receives carries the per-row
images (``pixel_values``, the vision layout) and the rollout's M-RoPE ``rope_positions``, and the π_old
recompute program over it gives the sampler's own per-token log-probs (the reference: the engine's
log-probs of what it sampled), so the first micro-step's PPO ratio is 1.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, rl, sampling

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vision_r1_tiny.yaml"
STAGES = [{"start_step": 2, "max_new_tokens": 16, "n": 2}]  # the config's second stage, reached at step 2


def _config(tmp_path) -> rl.RLConfig:
  over = {"steps": 2, "rollout.context_schedule": STAGES, "eval.every": 2, "eval.prompts": 2,
          "out_dir": str(tmp_path / "run"), "tensorboard": False}
  return config_lib.load(rl.RLConfig, CONFIG, [f"{k}={json.dumps(v)}" for k, v in over.items()])


def test_image_answer_reward():
  """The reward is the image task's answer check: the last ``Answer:`` decides, case-insensitively."""
  assert rl.image_answer_reward("q", "Answer: 2 ... Answer: Red", answer="red").value == 1.0
  assert rl.image_answer_reward("q", "Answer: 3", answer="2").value == 0.0
  assert rl.image_answer_reward("q", "2", answer="2").info["reason"] == "wrong_answer"


def test_vision_r1_tiny_runs_both_ptst_stages_with_images(tmp_path):
  cfg = _config(tmp_path)
  assert cfg.data.image_task is not None and cfg.reward.fn == "jaxrl.rl:image_answer_reward"
  trainer = rl.RLTrainer(cfg)
  assert trainer.tokenizer.convert_tokens_to_ids("<|image_pad|>") == trainer.cfg.model.config().image_token_id == 105
  assert trainer.train_prompts.has_images and all(trainer.train_prompts.with_images)
  seen, update = [], trainer.update

  def spy(rollout, step):
    assert isinstance(trainer.sampler, sampling.Engine) and trainer.sampler.compile_counts["embed"] >= 1  # the tower
    packed = trainer.pack(rollout, step)[0]  # one PackedBatch per mini-batch
    batches = [pb.interleaved() for pb in packed]
    olds = [np.asarray(trainer._forward(trainer.state.params, trainer._device(b), pb.shape[0]))  # the π_old program
            for b, pb in zip(batches, packed)]
    seen.append((step, trainer._stage, rollout, batches, olds))
    return update(rollout, step)

  trainer.update = spy
  try:
    out = trainer.run()
  finally:
    trainer.close()
  assert out["steps"] == 2
  history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  evals = [h for h in history if "eval/reward_mean" in h]
  assert evals and all(h["eval/length_mean"] > 0 for h in evals)  # the held-out prompts are sampled with images
  history = [h for h in history if "loss" in h]
  assert [h["step"] for h in history] == [1, 2]
  n_image = models.ModelConfig.tiny_vl().vision.spatial_merge_size ** 2
  for (step, stage, rollout, batches, olds), h, (n, budget) in zip(seen, history, ((4, 8), (2, 16))):
    assert np.isfinite(h["loss"]) and np.isfinite(h["grad_norm"])
    groups = collections.Counter(np.asarray(rollout.group_ids).tolist())
    assert (stage, sorted(groups.values())) == (step - 1, [n] * cfg.rollout.prompts_per_step)
    assert int(np.max(rollout.lengths)) <= budget
    assert len(batches) == cfg.algorithm.mini_batches
    image_total = sum(int(((b["tokens"] == 105) & (b["image_token_mask"] > 0)).sum()) for b in batches)
    assert image_total == 4 * len(rollout.lengths)  # every sample's 56 px image: 4 merged tokens
    for batch, old in zip(batches, olds):
      _check_batch(cfg, batch, old, n_image)
    assert abs(h["ratio_first_min"] - 1) < 1e-5 and abs(h["ratio_first_max"] - 1) < 1e-5
    assert h["logprob_diff/max_abs"] < 1e-4


def _check_batch(cfg, batch, old, n_image):
  """One packed mini-batch: per-row images, the rollout's M-RoPE positions, π_old = the sampler's log-probs."""
  rows, t = batch["tokens"].shape
  assert batch["rope_positions"].shape == (rows, t, 3)
  assert batch["pixel_values"].shape[:2] == (rows, cfg.data.num_patches)
  assert all(batch[k].shape[0] == rows for k in models.VISION_LAYOUT_KEYS)
  image_tokens = (batch["tokens"] == 105) & (batch["image_token_mask"] > 0)
  real_patches = np.abs(batch["pixel_values"]).sum(-1) > 0  # [R, P]
  np.testing.assert_array_equal(image_tokens.sum(1) * n_image, real_patches.sum(1))
  # the image tokens' (row, column) rotary positions differ: M-RoPE, not 1-D positions, reached the batch
  assert np.any(batch["rope_positions"][..., 1] != batch["rope_positions"][..., 2])
  # the contract: π_old (recomputed with the images and M-RoPE) equals the sampler's log-probs
  keep = batch["loss_mask"] > 0
  np.testing.assert_allclose(old[keep], batch["sampler_logprobs"][keep], rtol=0, atol=1e-4)


class _Stop(Exception):
  pass


def test_zero_pixels_blanks_the_images_the_sampler_gets_and_is_refused_for_a_text_model(tmp_path):
  """``data.zero_pixels``: the rollout's sampler and the held-out prompts get all-zero pixel values with the
  same tokens and image layout; without it the pixels are the images'. A text-only model refuses it."""
  got = {}
  for zero in (False, True):
    cfg = config_lib.load(rl.RLConfig, CONFIG, [f"data.zero_pixels={json.dumps(zero)}",
                                                 f"out_dir={json.dumps(str(tmp_path / 'run'))}"])
    tok = models.load_tokenizer(data_lib.tokenizer_dir(None, None, vision=True))
    train, heldout = rl.load_prompt_sets(cfg.data, tok)
    seen = []

    class Sampler:
      def generate(self, prompts, **kw):
        seen.append((prompts, kw["images"]))
        raise _Stop

    source = rl.EngineRollout(cfg.rollout, seed=0, backend=lambda step: Sampler(), submit=None, rewards=None)
    try:
      source.generate(Sampler(), [0, 1], [0, 1], prompts=train, max_new=4, n=2)
    except _Stop:
      pass
    (ids, images), = seen
    got[zero] = (ids, images, [heldout.images(i) for i in range(2)])
  for (ids0, imgs0, held0), (ids1, imgs1, held1) in [(got[False], got[True])]:
    assert ids0 == ids1  # the tokens are unchanged
    for a, b in zip(imgs0 + held0, imgs1 + held1):
      assert np.array_equal(a["grid_thw"], b["grid_thw"]) and a["pixel_values"].shape == b["pixel_values"].shape
      assert np.abs(a["pixel_values"]).max() > 0 and not b["pixel_values"].any()
  text = config_lib.load(rl.RLConfig, CONFIG.parent / "grpo_tiny.yaml", ["data.zero_pixels=true",
                                                                          f"out_dir={json.dumps(str(tmp_path))}"])
  with pytest.raises(ValueError, match="data.zero_pixels.*text-only"):
    rl.RLTrainer(text)
