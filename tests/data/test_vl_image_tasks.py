"""The built-in image task: every answer recomputed from the drawn pixels alone, determinism, disjoint splits."""

import json

import numpy as np
import pytest
from scipy import ndimage

from jaxrl.data import (COLORS, BuiltinImageTask, ImageTaskConfig, generate_image_task, image_answer_match, image_task_record,
                        load_image, write_image_task_splits)


def _components(img):
  """(colour name, [x0, y0, x1, y1], pixel mask) of each 8-connected region of one palette colour."""
  out = []
  for name, rgb in COLORS.items():
    labels, n = ndimage.label((img == np.asarray(rgb, np.uint8)).all(-1), structure=np.ones((3, 3)))
    for i in range(1, n + 1):
      ys, xs = np.nonzero(labels == i)
      out.append((name, [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())], labels == i))
  return out


def _kind(mask, bbox):
  """square: every row full; triangle: narrow top row, full bottom row; circle: narrow top and bottom."""
  x0, y0, x1, y1 = bbox
  rows = mask[y0:y1 + 1, x0:x1 + 1].sum(1)
  width = x1 - x0 + 1
  if rows.min() == width:
    return "square"
  return "triangle" if rows[-1] == width else "circle"


def _side(lo, hi, size, names):
  return names[0] if hi < size / 2 else names[1] if lo >= size / 2 else "center"


def _answer_from_pixels(ex):
  """The answer recomputed from ``ex.image`` and the question's target only (never from ``ex.scene``)."""
  img, size, q, t = ex.image, ex.image.shape[0], ex.question_type, ex.target
  comps = _components(img)
  if q == "count":
    return str(len(comps))
  if q == "color_count":
    return str(sum(c == t["color"] for c, _, _ in comps))
  if q == "shape_count":
    return str(sum(_kind(m, b) == t["shape"] for _, b, m in comps))
  if q == "side":
    (bbox,) = [b for c, b, m in comps if c == t["color"] and _kind(m, b) == t["shape"]]
    lo, hi = (bbox[0], bbox[2]) if t["axis"] == "horizontal" else (bbox[1], bbox[3])
    return _side(lo, hi, size, ("left", "right") if t["axis"] == "horizontal" else ("top", "bottom"))
  if q == "leftmost_color":
    return min(comps, key=lambda c: c[1][0])[0]
  if q == "bar_count":
    return str(len(comps))
  black = (img == 0).all(-1)
  ticks = np.nonzero(black[:, 4])[0]  # one tick per unit on the y axis
  unit = int(np.diff(ticks).min())
  baseline = int(np.nonzero(black[:, size // 2])[0].max())
  heights = {c: (baseline - b[1]) // unit for c, b, _ in comps}
  assert all((baseline - b[1]) % unit == 0 for _, b, _ in comps)
  if q == "bar_value":
    return str(heights[t["color"]])
  assert q == "bar_tallest"
  return max(heights, key=heights.get)


LEVELS = [ImageTaskConfig.level(d) for d in range(4)] + [ImageTaskConfig(image_size=56, max_value=9),
                                                          ImageTaskConfig.level(1, image_size=56, shape_scale=2.0)]


@pytest.mark.parametrize("cfg", LEVELS, ids=["level0", "level1", "level2", "level3", "size56", "scale2"])
def test_answers_are_right_from_pixels(cfg):
  examples = generate_image_task(150, seed=3, config=cfg)
  for ex in examples:
    assert ex.image.shape == (cfg.image_size, cfg.image_size, 3) and ex.image.dtype == np.uint8
    assert _answer_from_pixels(ex) == ex.answer, (ex.question, ex.scene)
    # the ground-truth scene agrees with the pixels: same objects, colours and boxes
    comps = sorted((c, b) for c, b, _ in _components(ex.image))
    assert comps == sorted((o["color"], o["bbox"]) for o in ex.scene["objects"])
  assert {ex.question_type for ex in examples} == set(cfg.questions)


def test_shape_scene_counts_and_kinds_match_pixels():
  for ex in generate_image_task(100, seed=0, config=ImageTaskConfig(kinds=("shapes",), max_objects=6)):
    by_box = {tuple(b): _kind(m, b) for _, b, m in _components(ex.image)}
    for o in ex.scene["objects"]:
      assert by_box[tuple(o["bbox"])] == o["shape"]
    assert ex.scene["counts"]["total"] == len(ex.scene["objects"])


def test_deterministic_per_seed():
  a = generate_image_task(20, seed=5)
  b = generate_image_task(20, seed=5)
  c = generate_image_task(20, seed=6)
  assert all(np.array_equal(x.image, y.image) and x.question == y.question and x.answer == y.answer
             for x, y in zip(a, b))
  assert any(not np.array_equal(x.image, y.image) for x, y in zip(a, c))


def test_splits_are_disjoint_whatever_the_seeds():
  cfg = ImageTaskConfig.level(0)  # the smallest example space, where collisions are likeliest
  key = lambda ex: (ex.image.tobytes(), ex.question)  # noqa: E731
  train = {key(ex) for seed in (0, 1) for ex in generate_image_task(300, seed=seed, config=cfg)}
  heldout = [key(ex) for seed in (0, 2) for ex in generate_image_task(100, seed=seed, config=cfg, split="heldout")]
  assert not train & set(heldout)
  assert len(set(heldout[:100])) == 100  # no repeats within a held-out set


def test_record_round_trips_image_and_answer(tmp_path):
  ex = generate_image_task(1, seed=0)[0]
  rec = image_task_record(ex)
  image_part, text_part = rec["messages"][0]["content"]
  np.testing.assert_array_equal(np.asarray(load_image(image_part["image"], where="t")), ex.image)
  assert text_part == {"type": "text", "text": ex.question}
  assert image_answer_match(rec["messages"][1]["content"], ex.answer)
  paths = write_image_task_splits(tmp_path, n_train=3, n_heldout=2, seed=0)
  lines = paths["heldout"].read_text().splitlines()
  assert len(paths["train"].read_text().splitlines()) == 3 and len(lines) == 2
  assert json.loads(lines[0])["scene"]["kind"] in ("shapes", "bars")


def test_image_answer_match():
  assert image_answer_match("It has three. Answer: 3", 3)
  assert image_answer_match("answer: x. Answer: Red", "red")
  assert not image_answer_match("Answer: 4", 3)
  assert not image_answer_match("3", 3)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="max_objects"):
    ImageTaskConfig(min_objects=3, max_objects=2)
  with pytest.raises(ValueError, match="none for kind 'bars'"):
    ImageTaskConfig(questions=("count",))
  with pytest.raises(ValueError, match="difficulty"):
    ImageTaskConfig.level(9)


def test_builtin_image_task_records():
  task = BuiltinImageTask(n_train=6, n_heldout=4, difficulty=0, image_size=56, seed=1)
  train, heldout = task.records("train"), task.records("heldout")
  assert len(train) == 6 and len(heldout) == 4
  assert {r["question_type"] for r in train + heldout} == {"count"}
  image = load_image(train[0]["messages"][0]["content"][0]["image"], where="t")
  assert image.size == (56, 56)
  assert train == BuiltinImageTask(n_train=6, n_heldout=4, difficulty=0, image_size=56, seed=1).records("train")
  key = lambda r: json.dumps([r["scene"], r["messages"][0]["content"][1]["text"]])  # noqa: E731
  assert not {key(r) for r in train} & {key(r) for r in heldout}
  with pytest.raises(ValueError, match="data.builtin.difficulty"):
    BuiltinImageTask(difficulty=4)


def test_builtin_image_task_overrides_recomputed_from_pixels():
  """questions / max_objects / num_colors override the level: one shape, four colours, the colour question;
  each answer is the colour of the single connected region drawn."""
  task = BuiltinImageTask(n_train=40, n_heldout=0, difficulty=0, image_size=56, seed=2,
                          questions=("leftmost_color",), max_objects=1, num_colors=4)
  assert task.task.num_colors == 4 and task.task.min_objects == task.task.max_objects == 1
  records = task.records("train")
  assert {r["question_type"] for r in records} == {"leftmost_color"}
  assert {r["answer"] for r in records} == set(list(COLORS)[:4])
  for r in records:
    image = np.asarray(load_image(r["messages"][0]["content"][0]["image"], where="t").convert("RGB"))
    regions = _components(image)
    assert len(regions) == 1 and regions[0][0] == r["answer"]
  with pytest.raises(ValueError, match="num_colors"):
    BuiltinImageTask(num_colors=9).task


def test_builtin_image_task_overrides_the_level():
  task = BuiltinImageTask(n_train=8, n_heldout=4, difficulty=0, image_size=56, seed=2,
                          questions=["leftmost_color"], max_objects=1, num_colors=4)
  want = ImageTaskConfig.level(0, image_size=56, questions=("leftmost_color",), min_objects=1, max_objects=1,
                               num_colors=4)
  assert task.task == want
  for r in task.records("train") + task.records("heldout"):
    objects = r["scene"]["objects"]
    assert r["question_type"] == "leftmost_color" and len(objects) == 1
    assert r["answer"] == objects[0]["color"] and r["answer"] in list(COLORS)[:4]
  assert BuiltinImageTask(difficulty=1, max_objects=2).task.min_objects == 1
  assert BuiltinImageTask(difficulty=1, min_objects=2, max_objects=3).task.min_objects == 2
  with pytest.raises(ValueError, match="data.image_task: num_colors"):
    BuiltinImageTask(num_colors=9).task
  with pytest.raises(ValueError, match="data.image_task: questions"):
    BuiltinImageTask(difficulty=0, questions=["bar_value"]).task


def test_shape_scale_sizes_the_shapes_and_keeps_the_default_draws():
  """Scale 1 is the original range ``[max(6, S // 9), max(7, S // 5)]`` (so every earlier draw is unchanged);
  scale 4 at 56 px draws sides of 24-44 pixels, each colour answer still the single region's colour."""
  for size in range(28, 200):
    assert ImageTaskConfig(image_size=size, max_value=2).shape_sides() == (max(6, size // 9), max(7, size // 5))
  cfg = ImageTaskConfig.level(0, image_size=56, questions=("leftmost_color",), max_objects=1, num_colors=4,
                              shape_scale=4.0)
  assert cfg.shape_sides() == (24, 44)
  sides = []
  for ex in generate_image_task(60, seed=1, config=cfg):
    (name, bbox, _), = _components(ex.image)
    assert name == ex.answer
    sides.append(bbox[2] - bbox[0] + 1)
  assert 24 <= min(sides) and max(sides) <= 44 and max(sides) - min(sides) > 10
  assert BuiltinImageTask(difficulty=0, image_size=56, shape_scale=4.0).task.shape_scale == 4.0
  with pytest.raises(ValueError, match="data.image_task: shape_scale must be in"):
    BuiltinImageTask(difficulty=0, shape_scale=6.0).task
