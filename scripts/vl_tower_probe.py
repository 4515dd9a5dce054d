"""Is a VL SFT run's vision tower informative? Linear probe of its merged image features.

Usage: python scripts/vl_tower_probe.py OUT_DIR  (a `jaxrl sft` run of a VLM on the built-in image task,
with OUT_DIR/hf and OUT_DIR/data/train.jsonl). For the run's exported tower and a random-init tower of the
same config: the spread of the features across images (std over images / mean |feature|; near 0 means the
tower's output no longer depends on the image), the answer classes' separation (mean distance of the class means
from their mean / mean distance of an image from its class mean; also for the raw pixels) and the held-out
accuracy of ridge classifiers of the answer fit on 400 train images, tested on 200 (against the majority answer).
Images are processed with the run's ``data.images``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import models


def ridge_accuracy(x: np.ndarray, y: np.ndarray, lam: float, n_fit: int) -> float:
  """Held-out accuracy of one-vs-rest ridge regression ``W = (XᵀX + λI)⁻¹XᵀY`` on centred features."""
  classes = sorted(set(y))
  xc = x - x[:n_fit].mean(0)
  onehot = np.stack([y == c for c in classes], 1).astype(np.float64)  # [N, C]
  w = np.linalg.solve(xc[:n_fit].T @ xc[:n_fit] + lam * np.eye(x.shape[1]), xc[:n_fit].T @ onehot[:n_fit])
  return float((np.asarray(classes)[(xc[n_fit:] @ w).argmax(1)] == y[n_fit:]).mean())


def separation(x: np.ndarray, y: np.ndarray) -> float:
  """Mean distance of the class means from their mean over the mean distance of a row from its class mean."""
  classes = sorted(set(y))
  mu = np.stack([x[y == c].mean(0) for c in classes])
  within = np.linalg.norm(x - mu[[classes.index(c) for c in y]], axis=1).mean()
  return float(np.linalg.norm(mu - mu.mean(0), axis=1).mean() / within)


def main(run: Path, n: int = 600, n_fit: int = 400) -> None:
  trained = models.load_pretrained(run / "hf", dtype="float32")
  tok = models.load_tokenizer(run / "hf")
  with open(run / "data" / "train.jsonl", encoding="utf-8") as f:
    recs = [json.loads(line) for line in f][:n]
  images = data_lib.ImageConfig(**json.loads((run / "config.json").read_text())["data"]["images"])
  prompts = [data_lib.encode_vl_prompt(tok, r, images=images, image_root=run / "data") for r in recs]
  y = np.asarray([r["answer"] for r in recs])
  layout = models.stack_layouts([models.vision_layout(np.asarray(p["grid_thw"]), trained.cfg.vision)
                                 for p in prompts])
  pixels = np.stack([p["pixel_values"] for p in prompts])  # [N, P, patch_dim]
  majority = max(float((y[n_fit:] == c).mean()) for c in set(y))
  rgb = pixels.reshape(len(recs), pixels.shape[1], 3, -1).mean((1, 3)).astype(np.float64)  # [N, 3] channel means
  ink = rgb - rgb.max(0)  # minus the whitest image's, per channel (≈ the white background)
  ink /= np.linalg.norm(ink, axis=1, keepdims=True) + 1e-12  # the colour's direction, whatever the shape's area
  print(f"raw pixels: class separation {separation(pixels.reshape(len(recs), -1).astype(np.float64), y):.3f}; "
        f"ridge accuracy of the channel means' direction {ridge_accuracy(ink, y, 1e-4, n_fit):.3f}")
  for name, model in (("trained", trained), ("random init", models.Transformer(trained.cfg, rngs=nnx.Rngs(0)))):
    feats = np.asarray(nnx.jit(lambda m, pv: m.visual(pv, layout))(model, pixels), np.float64)  # [N, U, D]
    x = feats.reshape(len(recs), -1)
    spread = x.std(0).mean() / np.abs(x.mean(0)).mean()
    accs = [round(ridge_accuracy(x, y, lam, n_fit), 3) for lam in (1e-4, 1e-2, 1.0)]
    print(f"{name}: between-image std / mean |feature| {spread:.4f}; class separation {separation(x, y):.3f}; "
          f"ridge accuracy {accs}; majority {majority:.3f}")


if __name__ == "__main__":
  main(Path(sys.argv[1]))
