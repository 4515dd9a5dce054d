"""Data of the calculator demo (``configs/agentic_calculator_tiny.yaml``, docs/agentic.md).

Multiplication (``digits``-digit × ``digits``-digit, 2 by default): a tiny model cannot compute the
product, but it can learn to call the ``calculator`` tool and copy its result. The SFT warm start
mixes tool-call demonstrations with direct answers (``tool_fraction`` of the demonstrations call
the tool), so the SFT model calls the tool only part of the time; RL has to raise that rate.

``python -m jaxrl.envs._demo OUT_DIR [--digits 2 --tool-fraction 0.5 ...]`` writes ``sft.jsonl`` (chat
demonstrations), ``train.jsonl`` and ``heldout.jsonl`` (``{"prompt", "answer"}`` records, disjoint from each other).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _tool_call(expression: str) -> str:
  body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
  return f"<tool_call>{body}</tool_call>"


def calculator_records(n: int, *, digits: int = 3, seed: int = 0) -> list[dict[str, str]]:
  """``n`` distinct ``{"prompt": "a*b", "answer": str(a*b)}`` with ``digits``-digit factors."""
  rng = np.random.default_rng(seed)
  lo, hi = 10 ** (digits - 1), 10**digits
  seen, out = set(), []
  while len(out) < n:
    a, b = (int(x) for x in rng.integers(lo, hi, size=2))
    if (a, b) not in seen:
      seen.add((a, b))
      out.append({"prompt": f"{a}*{b}", "answer": str(a * b)})
  return out


def demonstration(record: dict[str, str], *, use_tool: bool) -> dict:
  """A chat demonstration: call the calculator and copy its result, or answer directly."""
  messages = [{"role": "user", "content": record["prompt"]}]
  if use_tool:
    messages += [{"role": "assistant", "content": _tool_call(record["prompt"])},
                 {"role": "tool", "content": record["answer"]}]
  messages.append({"role": "assistant", "content": f"Answer: {record['answer']}"})
  return {"messages": messages}


def write_calculator_task(out_dir: str | Path, *, n_sft: int = 4000, n_train: int = 2000, n_heldout: int = 128,
                          digits: int = 2, tool_fraction: float = 0.5, seed: int = 0) -> dict[str, str]:
  """Writes the demo's three JSONL files under ``out_dir``; returns their paths."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  recs = calculator_records(n_sft + n_train + n_heldout, digits=digits, seed=seed)
  rng = np.random.default_rng(seed + 1)
  parts = {"sft": [demonstration(r, use_tool=bool(rng.random() < tool_fraction)) for r in recs[:n_sft]],
           "train": recs[n_sft:n_sft + n_train], "heldout": recs[n_sft + n_train:]}
  paths = {}
  for name, rows in parts.items():
    paths[name] = str(out / f"{name}.jsonl")
    Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
  import argparse
  p = argparse.ArgumentParser(prog="python -m jaxrl.envs._demo", description=__doc__.splitlines()[0])
  p.add_argument("out_dir", nargs="?", default="runs/agentic_calculator/data")
  p.add_argument("--n-sft", type=int, default=4000)
  p.add_argument("--n-train", type=int, default=2000)
  p.add_argument("--n-heldout", type=int, default=128)
  p.add_argument("--digits", type=int, default=2)
  p.add_argument("--tool-fraction", type=float, default=0.5)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  return write_calculator_task(a.out_dir, n_sft=a.n_sft, n_train=a.n_train, n_heldout=a.n_heldout, digits=a.digits,
                               tool_fraction=a.tool_fraction, seed=a.seed)


if __name__ == "__main__":
  print(main(sys.argv[1:]))
