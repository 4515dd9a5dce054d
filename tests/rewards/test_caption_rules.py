"""The built-in caption task (jaxrl.data) and its rule-based CapRL answerer / RubiCap checker (jaxrl.rewards),
against a hand-written scene and hand-computed rewards."""

from __future__ import annotations

import json

import pytest

from jaxrl import data, rewards

SCENE = {"kind": "shapes", "size": 56, "objects": [
    {"shape": "circle", "color": "red", "bbox": [30, 4, 40, 14], "horizontal": "right", "vertical": "top"},
    {"shape": "square", "color": "blue", "bbox": [2, 30, 12, 40], "horizontal": "left", "vertical": "bottom"},
    {"shape": "circle", "color": "red", "bbox": [20, 30, 34, 44], "horizontal": "center", "vertical": "bottom"}]}


def test_caption_questions_and_rubrics_from_the_scene():
  assert data.scene_caption(SCENE) == "3 shapes: blue square left, red circle center, red circle right."
  qs = {q["question"]: q["options"]["ABCD".index(q["answer"])]
        for q in data.scene_questions(SCENE, max_count=3, num_colors=2)}
  assert qs == {"How many shapes are in the image?": "3", "How many red shapes are in the image?": "2",
                "How many blue shapes are in the image?": "1", "How many squares are in the image?": "1",
                "How many circles are in the image?": "2", "How many triangles are in the image?": "0",
                "Is the blue square on the left or on the right of the image?": "left"}
  rubrics = data.scene_rubrics(SCENE)
  assert [(r["criterion"], r["severity"]) for r in rubrics] == [
      ("The caption states that there are exactly 3 shapes.", "critical"),
      ("The caption mentions exactly 1 blue square.", "important"),
      ("The caption mentions exactly 2 red circles.", "important"),
      ("The caption places the blue square on the left.", "minor"),
      ("The caption mentions no shape other than: blue square, red circle.", "critical")]


def test_caprl_with_the_rule_answerer_by_hand():
  qs = data.scene_questions(SCENE, max_count=3, num_colors=2)
  cfg = {"rounds": 4}
  full = rewards.caprl_reward("p", data.scene_caption(SCENE), questions=qs, answerer=rewards.scene_answerer, config=cfg)
  assert full.value == 1.0
  # no count stated, one red circle missing, the square on the wrong side: total (2 mentions) no, red (1) no,
  # blue (1) yes, squares (1) yes, circles (1) no, triangles (0) yes, the square's side no -> 3 / 7
  partial = rewards.caprl_reward("p", "blue square right, red circle left", questions=qs,
                                 answerer=rewards.scene_answerer, config=cfg)
  assert partial.value == pytest.approx(3 / 7)
  empty = rewards.caprl_reward("p", "a picture", questions=qs, answerer=rewards.scene_answerer, config=cfg)
  assert empty.value == 0.0 and empty.info["unanswerable"] == 7 * 4  # nothing settled: the extra option each time
  with pytest.raises(ValueError, match="not a question of the built-in caption task"):
    rewards.caption_answer("x", "What is the meaning of it?")


def test_rubicap_with_the_rule_checker_by_hand():
  rubrics = data.scene_rubrics(SCENE)
  kw = {"rubrics": rubrics, "checker": "jaxrl.rewards:scene_rubric_check"}
  assert rewards.rubicap_reward("p", data.scene_caption(SCENE), **kw).value == 1.0
  # states 3 (3), 1 blue square (2), 1 red circle (not 2), blue square left (1), a green triangle hallucinated (not 3)
  r = rewards.rubicap_reward("p", "3 shapes: blue square left, red circle right, green triangle left.", **kw)
  assert r.info["met"] == [1.0, 1.0, 0.0, 1.0, 0.0] and r.value == pytest.approx(6 / 11)
  praise = rewards.rubicap_reward("p", "3 shapes. This description is absolutely correct and complete.", **kw)
  assert praise.info["monitor"] == {"self_praise": 1.0, "words": 9.0} and praise.value == pytest.approx(6 / 11)
  # a listed item that names no shape (RL's garbling: "red cire") still claims an object: not "no other shape"
  garbled = rewards.rubicap_reward("p", "3 shapes: blue squ left, red cire, red circle right.", **kw)
  assert data.parse_caption("3 shapes: blue squ left, red cire, red circle right.")["unread"] == 2
  assert garbled.info["met"] == [1.0, 0.0, 0.0, 0.0, 0.0] and garbled.value == pytest.approx(3 / 11)
  assert data.parse_caption("2 shapes: red circle left, blue square right. Nice.")["unread"] == 0
  with pytest.raises(ValueError, match="not a rubric of the built-in caption task"):
    rewards.scene_rubric_check("The caption is nice.", "x")


def test_caption_task_splits_share_no_scene():
  cfg = data.ImageTaskConfig.level(0, image_size=56)
  train = data.generate_caption_task(64, seed=0, config=cfg)
  held = data.generate_caption_task(16, seed=0, split="heldout", config=cfg)
  key = lambda r: json.dumps(r["scene"], sort_keys=True)  # noqa: E731
  assert not {key(r) for r in train} & {key(r) for r in held} and len({key(r) for r in held}) == 16
  for r in held:
    assert r["messages"][0]["content"][1]["text"] == data.CAPTION_PROMPT
    assert r["messages"][1]["content"] == r["caption"] == data.scene_caption(r["scene"])
    assert rewards.caprl_reward("p", r["caption"], questions=r["questions"], answerer=rewards.scene_answerer).value == 1


def test_caption_task_section_overrides_the_level():
  """``data.caption_task``'s scene knobs reach the scenes: one or two large shapes, sides in the scaled range."""
  section = data.BuiltinCaptionTask(n_train=32, n_heldout=8, difficulty=0, image_size=56, max_objects=2,
                                    shape_scale=2.5)
  lo, hi = section.task.shape_sides()
  assert (section.task.min_objects, section.task.max_objects, lo, hi) == (1, 2, 15, 27)
  objects = [o for r in section.records("train") for o in r["scene"]["objects"]]
  counts = {len(r["scene"]["objects"]) for r in section.records("train")}
  assert counts == {1, 2}
  assert all(lo <= o["bbox"][2] - o["bbox"][0] + 1 <= hi for o in objects if o["shape"] == "square")
  single = data.BuiltinCaptionTask(n_train=8, difficulty=0, image_size=56, max_objects=1, shape_scale=3.0)
  for r in single.records("train"):  # one shape: no total-count question (its one option would settle it)
    assert all(len(q["options"]) >= 2 for q in r["questions"]) and "How many shapes" not in json.dumps(r["questions"])
    assert rewards.caprl_reward("p", r["caption"], questions=r["questions"], answerer=rewards.scene_answerer).value == 1
  assert data.BuiltinCaptionTask(difficulty=0).task == data.ImageTaskConfig.level(0)
  with pytest.raises(ValueError, match="data.caption_task: shape_scale"):
    data.BuiltinCaptionTask(shape_scale=9.0)
