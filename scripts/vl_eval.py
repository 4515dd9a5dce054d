"""Held-out exact match of an exported VLM SFT directory on its run's built-in image task, with the images and
with every image's pixels zeroed (the eval-time image ablation), and the majority-answer baseline.

  python scripts/vl_eval.py [--max-new-tokens=N] RUN_DIR [RUN_DIR ...]
  # RUN_DIR: a `jaxrl sft` out_dir (hf/ and data/heldout.jsonl); N: default the run's eval.max_new_tokens
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from jaxrl import data, models, sft


def main(run_dirs: list[str], max_new_tokens: int | None = None) -> None:
  """Prints one JSON line per run: exact match with images, with pixels zeroed, and the majority baseline."""
  for run in map(Path, run_dirs):
    cfg = json.loads((run / "config.json").read_text())
    model = models.load_pretrained(run / "hf", dtype="float32")
    tok = models.load_tokenizer(data.tiny_vl_tokenizer_dir())
    heldout = [str(run / "data" / "heldout.jsonl")]
    n, new = cfg["eval"]["exact_match"], max_new_tokens or cfg["eval"]["max_new_tokens"]
    images = data.ImageConfig(**cfg["data"]["images"])
    acc = {z: sft.image_heldout_accuracy(model, tok, heldout, n=n, max_new_tokens=new, images=images, zero_pixels=z)
           for z in (False, True)}
    answers = [json.loads(line)["answer"] for line in open(heldout[0], encoding="utf-8")][:n]
    majority = collections.Counter(answers).most_common(1)[0][1] / len(answers)
    print(json.dumps({"run": run.name, "images": acc[False], "pixels_zeroed_eval": acc[True],
                      "majority": majority}), flush=True)


if __name__ == "__main__":
  flags = [a for a in sys.argv[1:] if a.startswith("--max-new-tokens=")]
  main([a for a in sys.argv[1:] if a not in flags], int(flags[-1].split("=")[1]) if flags else None)
