"""``jaxrl convert SRC DST`` (HF directory -> re-sharded HF directory) or ``jaxrl convert --preset NAME DST``."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from jaxrl import models

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")
"""A VLM checkpoint's processor files (image processor, processor, video processor, the processor's chat
template), copied unchanged from the source: jaxrl does not rewrite them, and without them the converted
directory loads in transformers' ``AutoProcessor`` no more (``data.ImageConfig.from_hf`` reads the first)."""


def copy_processor_files(sources: list[str | None], dst: str | Path) -> list[str]:
  """Copies each of :data:`PROCESSOR_FILES` that the first of ``sources`` holding it has (and ``dst`` lacks) into
  ``dst``; returns the names copied."""
  copied = []
  for name in PROCESSOR_FILES:
    where = next((Path(s) / name for s in sources if s is not None and (Path(s) / name).is_file()), None)
    if where is not None and not (Path(dst) / name).exists():
      shutil.copyfile(where, Path(dst) / name)
      copied.append(name)
  return copied


def main(argv: list[str]) -> int:
  """Runs :func:`jaxrl.models.convert`, copies a VLM's processor files, and prints what it wrote; returns the exit
  status."""
  p = argparse.ArgumentParser(prog="jaxrl convert", description="HF checkpoint directory <-> jaxrl (load, "
                              "re-shard, save), or a preset to a random HF dir")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="parameter dtype to write")
  p.add_argument("--tokenizer", default=None, help="tokenizer dir to copy alongside (default: the source's, if any)")
  p.add_argument("--preset", default=None, help="instead of SRC, write a randomly initialised model of this preset")
  p.add_argument("src", nargs="?", default=None, help="input HF directory")
  p.add_argument("dst", help="output HF directory")
  ns = p.parse_args(argv)
  print(models.convert(ns.src, ns.dst, dtype=ns.dtype, tokenizer=ns.tokenizer, preset=ns.preset))
  copied = copy_processor_files([ns.src, ns.tokenizer], ns.dst)
  if copied:
    print(f"copied {', '.join(copied)} from the source")
  return 0
