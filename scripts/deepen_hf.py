"""Writes a deeper copy of a Hugging Face (Llama/Qwen-style) checkpoint whose output is unchanged: ``--extra N``
layers appended, each a copy of the last layer with its two output projections (``self_attn.o_proj``,
``mlp.down_proj``) zeroed, so every new block adds 0 to the residual stream (depth up-scaling, SOLAR 2023,
with identity-initialised blocks: the model computes what the source computes until training moves them).

  python scripts/deepen_hf.py runs/rm_sft1200/hf runs/rm_sft1200_deep/hf --extra 2

Used to give a Bradley–Terry reward model layers *after* the SFT model's next-token prediction: a new layer at
token ``t + 1`` can read position ``t``'s finished prediction and compare it with the token that came
(docs/benchmarks.md, "third attempt").
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
"""The projections whose zeros make an appended block the identity."""


def deepen(src: Path, dst: Path, extra: int) -> int:
  """Copies ``src`` to ``dst`` with ``extra`` identity blocks appended (module docstring); returns the depth."""
  from safetensors.numpy import load_file, save_file  # lazy: only this script needs them

  if extra < 1:
    raise ValueError(f"--extra must be >= 1, got {extra}")
  config = json.loads((src / "config.json").read_text(encoding="utf-8"))
  n = config["num_hidden_layers"]
  files = sorted(src.glob("*.safetensors"))
  if len(files) != 1:
    raise ValueError(f"{src}: expected one *.safetensors file, found {len(files)}")
  weights = load_file(str(files[0]))
  last = f"model.layers.{n - 1}."
  block = {k[len(last):]: v for k, v in weights.items() if k.startswith(last)}
  if not block or any(z not in block for z in ZEROED):
    raise ValueError(f"{files[0]}: no {last}{{{', '.join(ZEROED)}}}; not a Llama/Qwen-style checkpoint")
  for i in range(n, n + extra):
    for name, value in block.items():
      weights[f"model.layers.{i}.{name}"] = np.zeros_like(value) if name in ZEROED else value.copy()
  dst.mkdir(parents=True, exist_ok=True)
  for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
      shutil.copy2(f, dst / f.name)
  config["num_hidden_layers"] = n + extra
  (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  save_file(weights, str(dst / files[0].name), metadata={"format": "pt"})
  return n + extra


def main() -> None:
  """Parses the arguments and writes the deeper checkpoint."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("src", type=Path)
  ap.add_argument("dst", type=Path)
  ap.add_argument("--extra", type=int, default=2, help="layers to append")
  a = ap.parse_args()
  print(f"{a.dst}: {deepen(a.src, a.dst, a.extra)} layers")


if __name__ == "__main__":
  main()
