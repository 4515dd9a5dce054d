"""Built-in synthetic image task: coloured shapes and bar charts with verifiable answers, drawn offline.

Each example is an RGB image drawn with PIL (no antialiasing, so every object is one flat colour on a
white background), a question with an exact answer (an integer or one word), and the ground-truth scene:

- ``shapes``: 1..N squares, circles and triangles in a few colours, never touching (a 2-pixel gap), each
  with its bounding box and its side of the image (``left``/``right``, ``top``/``bottom``, or ``center``
  when it straddles the middle). Questions: how many shapes; how many of a colour; how many of a kind;
  is the <colour> <shape> on the left or the right (top or bottom); what colour is the leftmost shape.
- ``bars``: 3..6 bars of distinct colours with integer values, heights ``value * unit`` pixels above a
  baseline, a y axis with one tick per unit. Questions: the value of the <colour> bar; which colour is
  the tallest bar; how many bars.

The scene (``ImageExample.scene``) lists objects, colours, counts and positions, so later tasks can
derive captions, multiple-choice questions and rubrics from it. Train and held-out examples are split by
a hash of (scene, question), so the two splits never share an example whatever the seeds; each split is
deterministic in its seed.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from PIL import Image, ImageDraw

from jaxrl.data._synthetic import write_jsonl

COLORS: Mapping[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "blue": (30, 70, 220), "green": (30, 160, 50),
    "yellow": (230, 200, 20), "purple": (140, 50, 180), "orange": (245, 130, 10)}
"""Palette (name -> RGB); a task uses the first ``num_colors``. Black draws axes; white is the background."""
SHAPES = ("square", "circle", "triangle")
QUESTION_TYPES = ("count", "color_count", "shape_count", "side", "leftmost_color",
                  "bar_value", "bar_tallest", "bar_count")
_SHAPE_QUESTIONS = QUESTION_TYPES[:5]
_BAR_QUESTIONS = QUESTION_TYPES[5:]
_GAP = 2  # pixels kept free around every shape
_ANSWER_RE = re.compile(r"Answer:\s*([A-Za-z]+|-?\d+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageTaskConfig:
  """Difficulty knobs of the image task; :meth:`level` gives presets."""

  kinds: tuple[str, ...] = ("shapes", "bars")
  "Scene kinds to draw from (``shapes``, ``bars``), uniformly."
  questions: tuple[str, ...] = QUESTION_TYPES
  "Question types allowed (a subset of ``QUESTION_TYPES``; each kind needs at least one of its own)."
  image_size: int = 84
  "Side of the square image (pixels)."
  min_objects: int = 1
  "Fewest shapes in a ``shapes`` scene."
  max_objects: int = 4
  "Most shapes in a ``shapes`` scene."
  num_colors: int = 4
  "Shape colours: the first ``num_colors`` of ``COLORS``."
  shape_scale: float = 1.0
  ("Shape sides are drawn from ``[image_size // 9, image_size // 5]`` pixels times this (at least 6 and 7 "
   "pixels, at most ``image_size - 2``): 1 draws small shapes on a mostly white image, 4 shapes that cover a "
   "fifth to three fifths of it.")
  min_bars: int = 3
  "Fewest bars in a chart."
  max_bars: int = 5
  "Most bars in a chart (at most ``len(COLORS)``)."
  max_value: int = 9
  "Bar values are drawn from 1..max_value."
  heldout_fraction: float = 0.2
  "Fraction of the example space reserved for the held-out split (by hash)."

  def __post_init__(self):
    if not self.kinds or any(k not in ("shapes", "bars") for k in self.kinds):
      raise ValueError(f"kinds must be a non-empty subset of ['shapes', 'bars'], got {self.kinds!r}")
    if not self.questions or any(q not in QUESTION_TYPES for q in self.questions):
      raise ValueError(f"questions must be a non-empty subset of {list(QUESTION_TYPES)}, got {self.questions!r}")
    for kind, own in (("shapes", _SHAPE_QUESTIONS), ("bars", _BAR_QUESTIONS)):
      if kind in self.kinds and not set(own) & set(self.questions):
        raise ValueError(f"questions {self.questions!r} has none for kind {kind!r} (one of {list(own)})")
    if self.image_size < 28:
      raise ValueError(f"image_size must be >= 28, got {self.image_size!r}")
    if not 1 <= self.min_objects <= self.max_objects <= 12:
      raise ValueError(f"need 1 <= min_objects <= max_objects <= 12, got {self.min_objects!r}, {self.max_objects!r}")
    if not 0.0 < self.shape_scale <= 5.0:  # at 5 the smallest side is still under 5/9 of the image
      raise ValueError(f"shape_scale must be in (0, 5], got {self.shape_scale!r}")
    if not 1 <= self.num_colors <= len(COLORS):
      raise ValueError(f"num_colors must be in [1, {len(COLORS)}], got {self.num_colors!r}")
    if not 2 <= self.min_bars <= self.max_bars <= len(COLORS):
      raise ValueError(f"need 2 <= min_bars <= max_bars <= {len(COLORS)}, got {self.min_bars!r}, {self.max_bars!r}")
    if not 2 <= self.max_value <= (self.image_size - 12) // 2:
      raise ValueError(f"max_value must be in [2, {(self.image_size - 12) // 2}] (2 pixels per unit), "
                       f"got {self.max_value!r}")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")

  def shape_sides(self) -> tuple[int, int]:
    """The fewest and most pixels of a shape's side (``shape_scale``)."""
    size = self.image_size
    lo = max(6, int(size // 9 * self.shape_scale))
    return lo, max(lo + 1, min(max(7, int(size // 5 * self.shape_scale)), size - 2))

  @classmethod
  def level(cls, difficulty: int, **overrides) -> ImageTaskConfig:
    """Presets: 0 count 1-3 shapes in 2 colours; 1 counts by colour/kind, up to 4 shapes in 3 colours;
    2 every question, up to 5 shapes, charts of 3-4 bars; 3 up to 8 shapes in 6 colours, 3-6 bars."""
    presets = {
        0: dict(kinds=("shapes",), questions=("count",), min_objects=1, max_objects=3, num_colors=2),
        1: dict(kinds=("shapes",), questions=("count", "color_count", "shape_count"), max_objects=4,
                num_colors=3),
        2: dict(max_objects=5, num_colors=4, min_bars=3, max_bars=4),
        3: dict(max_objects=8, num_colors=6, min_bars=3, max_bars=6, image_size=112),
    }
    if difficulty not in presets:
      raise ValueError(f"difficulty must be one of {sorted(presets)}, got {difficulty!r}")
    return cls(**{**presets[difficulty], **overrides})


@dataclasses.dataclass(frozen=True)
class ImageExample:
  """One example: ``image`` [S, S, 3] uint8, the question and its answer, and the ground truth."""

  image: np.ndarray
  question: str
  answer: str
  question_type: str
  target: dict[str, Any]
  "What the question asks about (e.g. ``{'color': 'red'}``); empty for whole-image questions."
  scene: dict[str, Any]
  "``kind``, ``size`` and ``objects`` (shapes: shape, color, bbox [x0, y0, x1, y1] inclusive, "
  "horizontal, vertical; bars: color, value, bbox), ``counts`` (shapes) or ``unit`` (bars: pixels per value)."


def _side(lo: int, hi: int, size: int, names: tuple[str, str]) -> str:
  if hi < size / 2:
    return names[0]
  if lo >= size / 2:
    return names[1]
  return "center"


def _shape_scene(rng: np.random.Generator, cfg: ImageTaskConfig) -> dict[str, Any]:
  size = cfg.image_size
  n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
  colors = list(COLORS)[:cfg.num_colors]
  objects: list[dict[str, Any]] = []
  for _ in range(200 * n):
    if len(objects) == n:
      break
    lo, hi = cfg.shape_sides()
    side = int(rng.integers(lo, hi + 1))
    x0, y0 = (int(v) for v in rng.integers(1, size - side, size=2))
    x1, y1 = x0 + side - 1, y0 + side - 1
    if any(x0 <= o["bbox"][2] + _GAP and o["bbox"][0] <= x1 + _GAP and y0 <= o["bbox"][3] + _GAP
           and o["bbox"][1] <= y1 + _GAP for o in objects):
      continue
    objects.append({"shape": SHAPES[int(rng.integers(len(SHAPES)))],
                    "color": colors[int(rng.integers(len(colors)))], "bbox": [x0, y0, x1, y1],
                    "horizontal": _side(x0, x1, size, ("left", "right")),
                    "vertical": _side(y0, y1, size, ("top", "bottom"))})
  counts = {"total": len(objects),
            "by_color": {c: sum(o["color"] == c for o in objects) for c in colors},
            "by_shape": {s: sum(o["shape"] == s for o in objects) for s in SHAPES}}
  return {"kind": "shapes", "size": size, "objects": objects, "counts": counts}


def _bar_scene(rng: np.random.Generator, cfg: ImageTaskConfig) -> dict[str, Any]:
  size = cfg.image_size
  k = int(rng.integers(cfg.min_bars, cfg.max_bars + 1))
  colors = [list(COLORS)[int(i)] for i in rng.permutation(len(COLORS))[:k]]
  values = [int(v) for v in rng.integers(1, cfg.max_value + 1, size=k)]
  unit = (size - 12) // cfg.max_value
  base = size - 5  # the baseline row; bars end just above it
  slot = (size - 10) // k
  objects = []
  for i, (color, value) in enumerate(zip(colors, values)):
    x0 = 8 + i * slot + 1
    x1 = x0 + max(2, slot - 3) - 1
    objects.append({"color": color, "value": value, "bbox": [x0, base - value * unit, x1, base - 1]})
  return {"kind": "bars", "size": size, "objects": objects, "unit": unit, "baseline": base}


def draw_scene(scene: Mapping[str, Any]) -> np.ndarray:
  """The scene's image, [S, S, 3] uint8 (flat colours, no antialiasing, white background)."""
  size = scene["size"]
  im = Image.new("RGB", (size, size), (255, 255, 255))
  d = ImageDraw.Draw(im)
  for o in scene["objects"]:
    x0, y0, x1, y1 = o["bbox"]
    fill = COLORS[o["color"]]
    shape = o.get("shape", "square")
    if shape == "square":
      d.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "circle":
      d.ellipse([x0, y0, x1, y1], fill=fill)
    else:
      d.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
  if scene["kind"] == "bars":
    base, unit = scene["baseline"], scene["unit"]
    d.line([(3, base), (size - 3, base)], fill=(0, 0, 0))
    d.line([(5, 3), (5, base)], fill=(0, 0, 0))
    for v in range(1, (base - 3) // unit + 1):
      d.point((4, base - v * unit), fill=(0, 0, 0))
  return np.asarray(im, np.uint8)


def _shape_question(rng, scene, allowed) -> tuple[str, str, str, dict[str, Any]] | None:
  objs, counts = scene["objects"], scene["counts"]
  qtype = allowed[int(rng.integers(len(allowed)))]
  if qtype == "count":
    return qtype, "How many shapes are in the image?", str(counts["total"]), {}
  if qtype == "color_count":
    color = list(counts["by_color"])[int(rng.integers(len(counts["by_color"])))]
    return qtype, f"How many {color} shapes are in the image?", str(counts["by_color"][color]), {"color": color}
  if qtype == "shape_count":
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return qtype, f"How many {shape}s are in the image?", str(counts["by_shape"][shape]), {"shape": shape}
  if qtype == "side":
    axis = ("horizontal", "vertical")[int(rng.integers(2))]
    unique = [o for o in objs if o[axis] != "center"
              and sum(p["color"] == o["color"] and p["shape"] == o["shape"] for p in objs) == 1]
    if not unique:
      return None
    o = unique[int(rng.integers(len(unique)))]
    words = "left or on the right" if axis == "horizontal" else "top or at the bottom"
    pre = "on the" if axis == "horizontal" else "at the"
    return (qtype, f"Is the {o['color']} {o['shape']} {pre} {words} of the image?", o[axis],
            {"color": o["color"], "shape": o["shape"], "axis": axis})
  lefts = sorted(o["bbox"][0] for o in objs)
  if len(lefts) > 1 and lefts[1] - lefts[0] < 3:
    return None
  o = min(objs, key=lambda p: p["bbox"][0])
  return qtype, "What colour is the leftmost shape?", o["color"], {}


def _bar_question(rng, scene, allowed) -> tuple[str, str, str, dict[str, Any]] | None:
  objs = scene["objects"]
  qtype = allowed[int(rng.integers(len(allowed)))]
  if qtype == "bar_count":
    return qtype, "How many bars are in the chart?", str(len(objs)), {}
  if qtype == "bar_value":
    o = objs[int(rng.integers(len(objs)))]
    return qtype, f"What is the value of the {o['color']} bar?", str(o["value"]), {"color": o["color"]}
  values = sorted(o["value"] for o in objs)
  if values[-1] == values[-2]:
    return None
  o = max(objs, key=lambda p: p["value"])
  return qtype, "Which colour is the tallest bar?", o["color"], {}


def _example(rng: np.random.Generator, cfg: ImageTaskConfig) -> ImageExample:
  while True:
    kind = cfg.kinds[int(rng.integers(len(cfg.kinds)))]
    scene = _shape_scene(rng, cfg) if kind == "shapes" else _bar_scene(rng, cfg)
    own = _SHAPE_QUESTIONS if kind == "shapes" else _BAR_QUESTIONS
    allowed = [q for q in cfg.questions if q in own]
    asked = (_shape_question if kind == "shapes" else _bar_question)(rng, scene, allowed)
    if asked is not None:
      qtype, question, answer, target = asked
      return ImageExample(draw_scene(scene), question, answer, qtype, target, scene)


def _key(example: ImageExample) -> str:
  return json.dumps([example.scene, example.question], sort_keys=True)


def _is_heldout(key: str, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
  return h / 2.0**64 < fraction


def generate_image_task(n: int, *, seed: int, split: Literal["train", "heldout"] = "train",
                        config: ImageTaskConfig | None = None) -> list[ImageExample]:
  """``n`` examples of one split, deterministic in ``seed``; the held-out split has no repeats.

  An example belongs to the held-out split iff the hash of its (scene, question) falls in the first
  ``heldout_fraction`` of the hash space, so no train example of any seed is a held-out example.
  """
  cfg = ImageTaskConfig() if config is None else config
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  rng = np.random.default_rng([seed, 0 if split == "train" else 1])
  heldout = split == "heldout"
  out: list[ImageExample] = []
  seen: set[str] = set()
  for _ in range(1000 * max(n, 1)):
    if len(out) == n:
      return out
    ex = _example(rng, cfg)
    key = _key(ex)
    if _is_heldout(key, cfg.heldout_fraction) != heldout or (heldout and key in seen):
      continue
    seen.add(key)
    out.append(ex)
  raise ValueError(f"could only draw {len(out)} of {n} distinct {split} examples; raise the difficulty "
                   "or heldout_fraction")


def png_data_url(image: np.ndarray) -> str:
  """``data:image/png;base64,...`` of an [H, W, 3] uint8 image (lossless)."""
  buf = io.BytesIO()
  Image.fromarray(np.asarray(image, np.uint8)).save(buf, "PNG")
  return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_task_record(example: ImageExample) -> dict[str, Any]:
  """A chat record: the user turn is the image (a PNG data URL) then the question; the assistant turn is
  ``Answer: <answer>``. Also carries ``answer``, ``question_type``, ``target`` and ``scene``."""
  content = [{"type": "image", "image": png_data_url(example.image)}, {"type": "text", "text": example.question}]
  return {"messages": [{"role": "user", "content": content},
                       {"role": "assistant", "content": f"Answer: {example.answer}"}],
          "answer": example.answer, "question_type": example.question_type, "target": example.target,
          "scene": example.scene}


def image_answer_match(completion: str, answer: str | int) -> bool:
  """Whether the word or integer after the last ``Answer:`` in ``completion`` equals ``answer``
  (case-insensitive)."""
  found = _ANSWER_RE.findall(completion)
  return bool(found) and found[-1].lower() == str(answer).strip().lower()


def write_image_task_splits(out_dir: str | Path, *, n_train: int, n_heldout: int, seed: int = 0,
                            config: ImageTaskConfig | None = None) -> dict[str, Path]:
  """Writes ``train.jsonl`` and ``heldout.jsonl`` of :func:`image_task_record` s (images inline as data URLs)."""
  out_dir = Path(out_dir)
  return {split: write_jsonl((image_task_record(e) for e in generate_image_task(n, seed=seed, split=split,
                                                                                 config=config)),
                             out_dir / f"{split}.jsonl")
          for split, n in (("train", n_train), ("heldout", n_heldout))}


_SCENE_KNOBS = ("image_size", "min_objects", "max_objects", "num_colors", "shape_scale")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SceneTaskSection:
  """What the built-in image and caption task sections share: how many records, the difficulty level and the
  scene knobs that override it (each None keeps the level's). ``_key`` and ``_task_key`` name the section in
  errors (of the counts, of the scene knobs)."""

  _key: ClassVar[str] = "data.builtin"
  _task_key: ClassVar[str] = "data.image_task"
  n_train: int = 4000
  "Records drawn from the train split."
  n_heldout: int = 64
  "Distinct held-out records (their scenes never in the train split)."
  difficulty: int = 0
  "ImageTaskConfig.level: 0 = 1-3 shapes in 2 colours ... 3 = up to 8 shapes and 6-bar charts."
  image_size: int | None = None
  "Image side in pixels (56-112 keeps CPU runs fast); None: the level's (84, or 112 at level 3)."
  min_objects: int | None = None
  "Fewest shapes per scene; None: the level's (lowered to ``max_objects`` when that is smaller)."
  max_objects: int | None = None
  "Most shapes per scene; None: the level's."
  num_colors: int | None = None
  "Shape colours (the first ``num_colors`` of ``COLORS``); None: the level's."
  shape_scale: float | None = None
  ("Shape size (ImageTaskConfig.shape_scale: 1 small shapes, 4 shapes covering much of the image); None: the "
   "level's. At 56 px and scale 1 a shape is smaller than one 14 px patch, and a tiny captioner does not learn to "
   "see it (docs/benchmarks.md, tiny CapRL).")
  seed: int = 0

  def __post_init__(self):
    if self.n_train < 1:
      raise ValueError(f"{self._key}.n_train must be >= 1, got {self.n_train!r}")
    if self.n_heldout < 0:
      raise ValueError(f"{self._key}.n_heldout must be >= 0, got {self.n_heldout!r}")
    if self.difficulty not in range(4):
      raise ValueError(f"{self._key}.difficulty must be in 0..3, got {self.difficulty!r}")
    if self.image_size is not None and self.image_size < 28:
      raise ValueError(f"{self._key}.image_size must be >= 28, got {self.image_size!r}")
    self.task  # noqa: B018 -- the overrides checked against ImageTaskConfig at construction

  @property
  def task(self) -> ImageTaskConfig:
    """The :class:`ImageTaskConfig` of ``difficulty`` with the fields set here (the scene knobs, and
    ``questions`` where the section has them) overriding the level's."""
    over: dict[str, Any] = {k: getattr(self, k) for k in _SCENE_KNOBS if getattr(self, k) is not None}
    if getattr(self, "questions", None) is not None:
      over["questions"] = tuple(self.questions)
    if self.max_objects is not None and self.min_objects is None:
      over["min_objects"] = min(self.max_objects, ImageTaskConfig.level(self.difficulty).min_objects)
    try:
      return ImageTaskConfig.level(self.difficulty, **over)
    except ValueError as e:
      raise ValueError(f"{self._task_key}: {e}") from None

  def records(self, split: Literal["train", "heldout"]) -> list[dict[str, Any]]:
    """The split's chat records (each task section draws its own)."""
    raise NotImplementedError

  def write_splits(self, out_dir: str | Path) -> dict[str, Path]:
    """``train.jsonl`` and ``heldout.jsonl`` of :meth:`records` under ``out_dir`` (images inline)."""
    return {split: write_jsonl(self.records(split), Path(out_dir) / f"{split}.jsonl") for split in ("train", "heldout")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinImageTask(SceneTaskSection):
  """The built-in image task as a config section (``data.builtin`` of a vision-language trainer).

  :meth:`records` draws a split as chat records (:func:`image_task_record`): ``n_train`` train records
  (repeats allowed) or ``n_heldout`` distinct held-out ones (never in the train split).
  """

  difficulty: int = 1
  "ImageTaskConfig.level: 0 = count 1-3 shapes ... 3 = up to 8 shapes and 6-bar charts."
  questions: tuple[str, ...] | None = None
  "Question types (a subset of ``QUESTION_TYPES``); None: the level's."

  def records(self, split: Literal["train", "heldout"]) -> list[dict[str, Any]]:
    """The split's chat records (images inline as PNG data URLs)."""
    n = self.n_train if split == "train" else self.n_heldout
    return [image_task_record(e) for e in generate_image_task(n, seed=self.seed, split=split, config=self.task)]
