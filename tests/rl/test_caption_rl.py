"""configs/caprl_tiny.yaml and configs/rubicap_tiny.yaml end to end on CPU (issue 31, Build 3): one GRPO step of the
tiny Qwen2.5-VL captioner on the built-in caption task, sampled by the rollout engine with the prompts' images.

The policy is the committed captioning warm start ``tests/fixtures/hf/caption_sft_tiny`` (``jaxrl sft --config
configs/sft_caption_tiny.yaml``, 300 steps, its export copied), so captions carry facts and the rewards vary.
Each sample's reward is recomputed by hand from the record's scene-derived fields, independently of the reward
code: CapRL's rule answerer is deterministic and ignores option order, so each question scores 1 in every round
iff the caption's answer is the correct option's text; RubiCap's rubrics are re-derived from the scene (counts,
sides, hallucinations) with the severity weights 3/2/1.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import data, rewards, rl

ROOT = Path(__file__).resolve().parents[2]
WARM = ROOT / "tests" / "fixtures" / "hf" / "caption_sft_tiny"


def _run(tmp_path, name: str):
  over = {"steps": 1, "model.preset": None, "model.hf_dir": str(WARM), "eval.every": 0, "rollout.n": 4,
          "out_dir": str(tmp_path / name), "tensorboard": False, "rollout.prompts_per_step": 4}
  cfg = config_lib.load(rl.RLConfig, ROOT / "configs" / f"{name}.yaml",
                        [f"{k}={json.dumps(v)}" for k, v in over.items()])
  assert cfg.data.caption_task is not None
  trainer = rl.RLTrainer(cfg)
  assert trainer.train_prompts.has_images and all(trainer.train_prompts.with_images)
  submitted, seen, submit, update = {}, [], trainer.rewards.submit, trainer.update

  def spy_submit(prompt, completion, *, index=None, **fields):
    submitted.setdefault(completion, []).append(fields)
    return submit(prompt, completion, index=index, **fields)

  def spy_update(rollout, step):
    packed = trainer.pack(rollout, step)[0]
    image_tokens = sum(int(((pb.interleaved()["tokens"] == 105) & (pb.interleaved()["image_token_mask"] > 0)).sum())
                       for pb in packed)
    seen.append((rollout, image_tokens))
    return update(rollout, step)

  trainer.rewards.submit, trainer.update = spy_submit, spy_update
  try:
    trainer.run()
  finally:
    trainer.close()
  (rollout, image_tokens), = seen
  history = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return rollout, image_tokens, submitted, [h for h in history if "loss" in h][0]


def _caprl_by_hand(caption: str, questions) -> float:
  hits = [rewards.caption_answer(caption, q["question"]) == q["options"]["ABCDEFGHIJ".index(q["answer"])]
          for q in questions]
  return float(np.mean(hits))


def _names_an_object(words: list[str]) -> bool:
  """``<colour> <kind>[s] [side]`` or ``<colour> <value>``."""
  if len(words) < 2 or words[0] not in data.COLORS:
    return False
  if len(words) == 2 and words[1].isdigit():
    return True
  kind = words[1][:-1] if words[1].endswith("s") and words[1][:-1] in data.SHAPES else words[1]
  return kind in data.SHAPES and (len(words) == 2 or len(words) == 3 and words[2] in ("left", "right", "center"))


def _rubicap_by_hand(caption: str, scene) -> float:
  said = data.parse_caption(caption)["shapes"]  # [(colour, kind, side)]
  objs = scene["objects"]
  groups = collections.Counter((o["color"], o["shape"]) for o in objs)
  scores = [(3.0, data.parse_caption(caption)["total"] == len(objs))]
  scores += [(2.0, sum(s[:2] == g for s in said) == k) for g, k in groups.items()]
  scores += [(1.0, (o["color"], o["shape"], o["horizontal"]) in said) for o in objs
             if groups[o["color"], o["shape"]] == 1 and o["horizontal"] != "center"]
  total = re.search(r"\b\d+\s+(shape|bar)s?\b", caption, re.I)  # "N shapes: a, b." -> items "a", "b"
  listed = caption[total.end():].lstrip(" :").split(".", 1)[0] if total else ""
  unread = [x for x in listed.lower().split(",") if x.strip() and not _names_an_object(x.split())]
  scores += [(3.0, all(s[:2] in groups for s in said) and not unread)]
  return sum(w * bool(m) for w, m in scores) / sum(w for w, _ in scores)


@pytest.mark.parametrize("name", ["caprl_tiny", "rubicap_tiny"])
def test_tiny_caption_rl_runs_with_images_and_scores_by_hand(tmp_path, name):
  rollout, image_tokens, submitted, h = _run(tmp_path, name)
  assert np.isfinite(h["loss"]) and np.isfinite(h["grad_norm"])
  assert image_tokens == 4 * len(rollout.lengths)  # every sample's 56 px image reached the update: 4 merged tokens
  r = np.asarray(rollout.task_rewards)
  assert r.min() < r.max(), r  # the warm start's captions differ in what they get right
  checked = 0
  for text, value in zip(rollout.texts, r):
    wants = {_caprl_by_hand(text, f["questions"]) if name == "caprl_tiny" else _rubicap_by_hand(text, f["scene"])
             for f in submitted[text]}
    if len(wants) == 1:  # the same caption of two images may score differently: those are not attributable
      assert value == pytest.approx(wants.pop(), abs=1e-6), text
      checked += 1
  assert checked >= len(r) // 2
  if name == "rubicap_tiny":
    assert h["reward/monitor/self_praise"] == 0.0
    assert h["reward/monitor/words"] == pytest.approx(np.mean([len(t.split()) for t in rollout.texts]))
