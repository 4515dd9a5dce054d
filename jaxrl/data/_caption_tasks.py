"""Built-in caption task: the image task's scenes as captioning prompts, with everything a caption reward needs.

Each record is the image with the instruction ``Describe the image.``, the reference caption written from the
scene, and, derived from the scene's known content:

- ``questions``: CapRL's multiple-choice questions (``{question, options, answer}``, the answer a letter), each
  settled by the scene: how many shapes; how many of each colour and of each kind; which side the
  unique <colour> <shape> is on (``left``/``right``); for charts the value of each bar, the tallest bar's
  colour, how many bars.
- ``rubrics``: RubiCap's binary, checkable rubrics with severities (``critical`` 3, ``important`` 2, ``minor``
  1): the total (critical), each colour-and-kind group's count (important), each unique object's side
  (minor), and no hallucinated object (critical); for charts the bar count, each bar's value, no other bar.

Captions follow one short grammar, left to right (``3 shapes: red circle left, blue square right, red
triangle center.``, ``4 bars: red 3, blue 5, green 2, yellow 7.``); `parse_caption` reads it back from any
text, so a rule-based answerer or rubric checker can work from a caption alone. Train and held-out records
are split by a hash of the scene, so the two splits never share an image whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from jaxrl.data._image_tasks import (COLORS, SHAPES, ImageTaskConfig, SceneTaskSection, generate_image_task,
                                     png_data_url)
from jaxrl.data._synthetic import write_jsonl

CAPTION_PROMPT = "Describe the image."
"""The captioning instruction of every caption-task prompt."""

_COLOR = "|".join(COLORS)
_OBJECT_RE = re.compile(rf"\b({_COLOR})\s+({'|'.join(SHAPES)})s?\b(?:\s+(left|right|center))?", re.I)
_BAR_RE = re.compile(rf"\b({_COLOR})\s+(\d+)\b", re.I)
_TOTAL_RE = re.compile(r"\b(\d+)\s+(shape|bar)s?\b", re.I)


def _plural(word: str, n: int) -> str:
  return word if n == 1 else word + "s"


def _left_to_right(scene: Mapping[str, Any]) -> list[Mapping[str, Any]]:
  return sorted(scene["objects"], key=lambda o: (o["bbox"][0], o["bbox"][1]))


def scene_caption(scene: Mapping[str, Any]) -> str:
  """The reference caption of a scene: the count, then each object left to right (shapes: colour, kind, side;
  bars: colour and value)."""
  objs = _left_to_right(scene)
  if scene["kind"] == "bars":
    return f"{len(objs)} {_plural('bar', len(objs))}: " + ", ".join(f"{o['color']} {o['value']}" for o in objs) + "."
  parts = ", ".join(f"{o['color']} {o['shape']} {o['horizontal']}" for o in objs)
  return f"{len(objs)} {_plural('shape', len(objs))}: {parts}."


def parse_caption(text: str) -> dict[str, Any]:
  """What a caption in the task's grammar states, read from any text: ``total`` (the first ``N shapes`` /
  ``N bars``, or None), ``shapes`` (each ``<colour> <kind> [side]`` mention as ``(colour, kind, side or None)``),
  ``bars`` (each ``<colour> <value>`` mention as ``(colour, value)``) and ``unread``: how many items of the list
  that follows the total (``N shapes: item, item.``, up to the first full stop) are neither a shape nor a bar
  mention, e.g. ``red cire ciright``. Such an item still claims an object; a judge cannot count it as none."""
  total = _TOTAL_RE.search(text)
  shapes = [(c.lower(), s.lower(), side.lower() if side else None) for c, s, side in _OBJECT_RE.findall(text)]
  bars = [(c.lower(), int(v)) for c, v in _BAR_RE.findall(text)]
  unread = 0
  if total:
    listed = text[total.end():].lstrip(" :").split(".", 1)[0]
    unread = sum(not (_OBJECT_RE.fullmatch(item.strip()) or _BAR_RE.fullmatch(item.strip()))
                 for item in listed.split(",") if item.strip())
  return {"total": int(total.group(1)) if total else None, "shapes": shapes, "bars": bars, "unread": unread}


def _mcq(question: str, options: list[str], answer: str) -> dict[str, Any]:
  return {"question": question, "options": options, "answer": "ABCDEFGHIJKLMNOPQRST"[options.index(answer)]}


def scene_questions(scene: Mapping[str, Any], *, max_count: int, num_colors: int,
                    max_value: int = 9) -> list[dict[str, Any]]:
  """The scene's multiple-choice questions (module docstring), in the ``{question, options, answer}`` form
  `jaxrl.rewards.parse_questions` reads. Count options are ``0..max_count``; colours are the first
  `num_colors` of `COLORS` (no total-count question when ``max_count`` is 1); bar values offer the true value
  and its neighbours within ``1..max_value``."""
  objs = scene["objects"]
  if scene["kind"] == "bars":
    out = [_mcq("How many bars are in the chart?", [str(k) for k in range(2, len(COLORS) + 1)], str(len(objs)))]
    for o in objs:
      lo = max(1, min(o["value"] - 1, max_value - 3))
      out.append(_mcq(f"What is the value of the {o['color']} bar?", [str(v) for v in range(lo, lo + 4)],
                      str(o["value"])))
    values = sorted(o["value"] for o in objs)
    if values[-1] != values[-2]:
      out.append(_mcq("Which colour is the tallest bar?", [o["color"] for o in objs],
                      max(objs, key=lambda o: o["value"])["color"]))
    return out
  counts = [str(k) for k in range(max_count + 1)]
  # the total is asked only when a scene may hold more than one shape: with one option it settles nothing
  out = [_mcq("How many shapes are in the image?", counts[1:], str(len(objs)))] if max_count > 1 else []
  for color in list(COLORS)[:num_colors]:
    out.append(_mcq(f"How many {color} shapes are in the image?", counts, str(sum(o["color"] == color for o in objs))))
  for shape in SHAPES:
    out.append(_mcq(f"How many {shape}s are in the image?", counts, str(sum(o["shape"] == shape for o in objs))))
  groups = Counter((o["color"], o["shape"]) for o in objs)
  for o in objs:
    if groups[o["color"], o["shape"]] == 1 and o["horizontal"] != "center":
      out.append(_mcq(f"Is the {o['color']} {o['shape']} on the left or on the right of the image?",
                      ["left", "right"], o["horizontal"]))
  return out


def scene_rubrics(scene: Mapping[str, Any]) -> list[dict[str, str]]:
  """The scene's rubrics (module docstring) as ``{criterion, severity}``, phrased so that
  `jaxrl.rewards.scene_rubric_check` can check each one on a caption."""
  objs = scene["objects"]
  if scene["kind"] == "bars":
    out = [{"criterion": f"The caption states that there are exactly {len(objs)} bars.", "severity": "critical"}]
    out += [{"criterion": f"The caption gives the {o['color']} bar the value {o['value']}.", "severity": "important"}
            for o in objs]
    names = ", ".join(o["color"] for o in objs)
    return out + [{"criterion": f"The caption mentions no bar other than: {names}.", "severity": "critical"}]
  out = [{"criterion": f"The caption states that there are exactly {len(objs)} shapes.", "severity": "critical"}]
  groups = Counter((o["color"], o["shape"]) for o in _left_to_right(scene))
  out += [{"criterion": f"The caption mentions exactly {k} {color} {_plural(shape, k)}.", "severity": "important"}
          for (color, shape), k in groups.items()]
  out += [{"criterion": f"The caption places the {o['color']} {o['shape']} on the {o['horizontal']}.",
           "severity": "minor"}
          for o in _left_to_right(scene) if groups[o["color"], o["shape"]] == 1 and o["horizontal"] != "center"]
  names = ", ".join(f"{c} {s}" for c, s in groups)
  return out + [{"criterion": f"The caption mentions no shape other than: {names}.", "severity": "critical"}]


def caption_task_record(image, scene: Mapping[str, Any], *, max_count: int, num_colors: int,
                        max_value: int = 9) -> dict[str, Any]:
  """A chat record: the user turn is the image (a PNG data URL) then `CAPTION_PROMPT`; the assistant turn the
  reference caption (`scene_caption`). Also carries ``caption``, ``questions``, ``rubrics`` and ``scene``."""
  caption = scene_caption(scene)
  content = [{"type": "image", "image": png_data_url(image)}, {"type": "text", "text": CAPTION_PROMPT}]
  return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": caption}],
          "caption": caption,
          "questions": scene_questions(scene, max_count=max_count, num_colors=num_colors, max_value=max_value),
          "rubrics": scene_rubrics(scene), "scene": dict(scene)}


def _scene_heldout(scene: Mapping[str, Any], fraction: float) -> bool:
  h = hashlib.sha256(json.dumps(scene, sort_keys=True).encode()).digest()[:8]
  return int.from_bytes(h, "big") / 2.0**64 < fraction


def generate_caption_task(n: int, *, seed: int, split: Literal["train", "heldout"] = "train",
                          config: ImageTaskConfig | None = None) -> list[dict[str, Any]]:
  """``n`` caption records (`caption_task_record`) of one split, deterministic in ``seed``: a scene is held out
  iff the hash of the scene falls in the first ``heldout_fraction`` of the hash space; held-out scenes are
  distinct."""
  cfg = ImageTaskConfig() if config is None else config
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  heldout, out, seen, drawn = split == "heldout", [], set(), 0
  while len(out) < n:
    batch = generate_image_task(max(64, 2 * n), seed=seed * 7919 + drawn, split="train", config=cfg)
    drawn += 1
    for ex in batch:
      key = json.dumps(ex.scene, sort_keys=True)
      if _scene_heldout(ex.scene, cfg.heldout_fraction) != heldout or (heldout and key in seen):
        continue
      seen.add(key)
      out.append(caption_task_record(ex.image, ex.scene, max_count=cfg.max_objects, num_colors=cfg.num_colors,
                                     max_value=cfg.max_value))
      if len(out) == n:
        break
    if drawn > 100:
      raise ValueError(f"could only draw {len(out)} of {n} distinct {split} scenes; raise the difficulty "
                       "or heldout_fraction")
  return out


def write_caption_task_splits(out_dir: str | Path, *, n_train: int, n_heldout: int, seed: int = 0,
                              config: ImageTaskConfig | None = None) -> dict[str, Path]:
  """Writes ``train.jsonl`` and ``heldout.jsonl`` of caption records (images inline as data URLs): SFT data
  for a captioning warm start, and RL prompts with their ``questions`` and ``rubrics``."""
  out_dir = Path(out_dir)
  return {split: write_jsonl(generate_caption_task(n, seed=seed, split=split, config=config),
                             out_dir / f"{split}.jsonl")
          for split, n in (("train", n_train), ("heldout", n_heldout))}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinCaptionTask(SceneTaskSection):
  """The built-in caption task as a config section (``data.caption_task`` of the RL trainer:
  configs/caprl_tiny.yaml, configs/rubicap_tiny.yaml; of ``jaxrl sft``: configs/sft_caption_tiny.yaml). Scenes
  are `BuiltinImageTask`'s, with the same knobs."""

  _key: ClassVar[str] = "data.caption_task"
  _task_key: ClassVar[str] = "data.caption_task"

  def records(self, split: Literal["train", "heldout"]) -> list[dict[str, Any]]:
    """The split's caption records (images inline as PNG data URLs)."""
    n = self.n_train if split == "train" else self.n_heldout
    return generate_caption_task(n, seed=self.seed, split=split, config=self.task)
