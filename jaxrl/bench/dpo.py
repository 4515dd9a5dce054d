"""``jaxrl bench dpo``: one DPO step of jaxrl's ``DPOTrainer`` against TRL's ``DPOTrainer``, side by side.

The workload: one random Qwen2 HF directory (the tiny shape of ``jaxrl bench rl``: vocab 4096, d 128, 4
layers, float32) and its word-level tokenizer, written once and loaded by both frameworks, and ``pairs``
conversational preference pairs (one user turn of ``prompt_tokens`` words, chosen and rejected assistant
turns of exactly ``completion_tokens`` words each). The chat template is the messages' text verbatim, so
both frameworks tokenise a pair into the same ids (TRL adds no EOS to a conversational pair; jaxrl's
``encode_chat`` adds none either).

Every setting that changes the work is the same in both and printed with the numbers (:data:`SETTINGS`):
the sigmoid loss with β, the reference from a frozen copy of the initial weights recomputed every step
(jaxrl ``reference: model``; TRL ``ref_model=None`` without PEFT or ``precompute_ref_log_probs``), float32,
no gradient checkpointing, one micro-batch of all ``pairs`` pairs (no accumulation), AdamW (no weight decay,
constant learning rate, global-norm clip 1). Every sequence has the same length, so neither side pads:
jaxrl packs one sequence per row (``2·pairs`` rows of ``prompt + completion`` tokens), TRL concatenates
chosen and rejected into one ``[2·pairs, prompt + completion]`` batch (its ``padding_free`` is disabled in
1.16). Each step trains on the same ``pairs`` pairs (TRL: one epoch per step), so the two frameworks' losses
must agree step by step; they are printed side by side (step 1: ``log 2``, the policy is the reference).

Each framework runs in its own process and speaks the JSON-lines protocol of ``jaxrl bench rl``; steps are
interleaved, the first step (compilation) is reported apart, then medians. Tokens/s counts every token of a
step's ``2·pairs`` sequences (policy forward and backward, reference forward). Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl import models, pref
from jaxrl.bench import rl as bench_rl
from jaxrl.bench._harness import BENCHMARKS, harness

PAIRS, PROMPT_TOKENS, COMPLETION_TOKENS, BETA, LR, STEPS = 8, 64, 64, 0.1, 1e-4, 6
TRL_WORKER = BENCHMARKS / "dpo_trl.py"

SETTINGS = {
    "loss": "sigmoid (DPO)",
    "beta": BETA,
    "reference": ("frozen copy of the initial weights, recomputed every step (jaxrl reference: model; "
                  "TRL ref_model=None)"),
    "dtype": "float32 (weights, compute, reference)",
    "gradient checkpointing": "off in both",
    "micro-batch": "all pairs in one micro-batch (no accumulation)",
    "layout": "every sequence the same length: jaxrl one sequence per row, TRL one padded [2P, T] batch; no padding",
    "optimizer": "AdamW, weight decay 0, constant lr, clip 1.0",
}
"""What :func:`format_table` prints beside the numbers (``pairs``, lengths and lr are added per run)."""


def write_workload(root: Path, *, pairs: int = PAIRS, prompt_tokens: int = PROMPT_TOKENS,
                   completion_tokens: int = COMPLETION_TOKENS, model: dict[str, int] | None = None,
                   seed: int = 0) -> dict[str, str]:
  """Writes the random HF model (``jaxrl bench rl``'s tiny shape, ``model`` overriding it), the word-level
  tokenizer and ``pairs.jsonl`` under ``root``; returns their paths."""
  cfg = models.ModelConfig.qwen2p5_0p5b(**{**bench_rl.TINY, **(model or {})}, dtype="float32",
                                        param_dtype="float32")
  root.mkdir(parents=True, exist_ok=True)
  models.save_pretrained(models.init_model(cfg, seed=seed), root / "model")
  bench_rl.write_tokenizer(root / "tokenizer", cfg.vocab_size)
  rng = np.random.default_rng(seed)
  words = lambda n, lead="": lead + " ".join(f"w{i}" for i in rng.integers(2, cfg.vocab_size, size=n))
  path = root / "pairs.jsonl"
  with path.open("w") as f:
    for _ in range(pairs):  # the answers start with a space: the template joins the turns' text verbatim
      f.write(json.dumps({"prompt": [{"role": "user", "content": words(prompt_tokens)}],
                          "chosen": [{"role": "assistant", "content": words(completion_tokens, " ")}],
                          "rejected": [{"role": "assistant", "content": words(completion_tokens, " ")}]}) + "\n")
  return {"hf_dir": str(root / "model"), "tokenizer": str(root / "tokenizer"), "pairs_file": str(path)}


class JaxrlWorker:
  """One step of :class:`jaxrl.pref.DPOTrainer` per ``step`` command (the protocol of ``jaxrl bench rl``)."""

  def setup(self, *, hf_dir: str, tokenizer: str, pairs_file: str, pairs: int, seq_len: int, steps: int,
            out_dir: str, lr: float, beta: float, **_: Any) -> dict[str, Any]:
    data = {
        "model": {"hf_dir": hf_dir}, "tokenizer": tokenizer,
        "data": {"train": [pairs_file], "builtin": None},
        "pairs": pairs, "packing": {"seq_len": seq_len, "global_rows": 2 * pairs, "method": "best_fit"},
        "loss": {"name": "sigmoid", "beta": beta}, "reference": "model", "micro_batches": 1,
        "optim": {"lr": lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "clip_norm": 1.0},
        "steps": steps, "eval": {"every": 0}, "checkpoint": {"every": 0}, "export_hf": False,
        "tensorboard": False, "out_dir": out_dir,
    }
    self.trainer = pref.DPOTrainer(config_lib.from_dict(pref.DPOConfig, data))
    self.stream = pref.PairStream(len(self.trainer.train_pairs), seed=0)
    self.pairs = pairs
    return {"ok": True, "versions": bench_rl._versions("jax", "jaxlib", "flax", "optax")}

  def step(self) -> dict[str, Any]:
    t0 = time.perf_counter()
    arrays = self.trainer.batch(self.stream.take(self.pairs))
    metrics = jax.block_until_ready(self.trainer.update(arrays))
    dt = time.perf_counter() - t0
    return {"step_s": dt, "tokens": int((arrays["segment_ids"] > 0).sum()),
            "padding": float((arrays["segment_ids"] == 0).mean()),
            "loss": float(metrics["loss_sum"]) / max(float(metrics["pairs"]), 1.0)}


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
  """First step apart, then the medians of the rest: step seconds, tokens/s, CPU seconds; every loss."""
  first, rest = steps[0], steps[1:] or steps[:1]
  out = {"first_step_s": first["step_s"], "step_s": statistics.median(s["step_s"] for s in rest),
         "tok_s": statistics.median(s["tokens"] / s["step_s"] for s in rest), "tokens": rest[0]["tokens"],
         "losses": [s["loss"] for s in steps], "steps": len(steps)}
  if all("cpu_s" in s for s in rest):
    out["step_cpu_s"] = statistics.median(s["cpu_s"] for s in rest)
  if any("peak_rss_gib" in s for s in steps):
    out["peak_rss_gib"] = max(s.get("peak_rss_gib", 0.0) for s in steps)
  return out


def run(work: Path, *, steps: int = STEPS, pairs: int = PAIRS, prompt_tokens: int = PROMPT_TOKENS,
        completion_tokens: int = COMPLETION_TOKENS, peers: tuple[str, ...] = ("trl",),
        model: dict[str, int] | None = None, log=print) -> dict[str, Any]:
  """Writes the workload under ``work`` and runs ``steps`` interleaved steps of jaxrl and TRL (when its
  virtualenv exists). Returns the settings, the raw steps and their summary per framework."""
  spec = write_workload(work, pairs=pairs, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        model=model)
  spec.update(pairs=pairs, seq_len=prompt_tokens + completion_tokens, steps=steps, lr=LR, beta=BETA)
  argvs = {"jaxrl": [sys.executable, "-m", "jaxrl.bench.dpo", "--worker"]}
  for name in peers:
    py = bench_rl.peer_python(name)
    if not py.exists():
      log(f"{name}: no virtualenv at {py.parent.parent} (create it with `jaxrl bench rl --setup {name}`); skipped")
      continue
    argvs[name] = [str(py), str(harness(TRL_WORKER))]
  results: dict[str, Any] = {"settings": dict(SETTINGS, pairs=pairs, prompt_tokens=prompt_tokens,
                                              completion_tokens=completion_tokens, lr=LR), "frameworks": {}}
  workers: dict[str, bench_rl.Peer] = {}
  try:
    for name, argv in argvs.items():
      workers[name] = bench_rl.Peer(name, argv)
      ans = workers[name].ask("setup", **spec, out_dir=str(work / f"out_{name}"))
      results["frameworks"][name] = {"versions": ans.get("versions", {}), "setup_s": ans["wall_s"], "steps_raw": []}
    for i in range(steps):
      for name, w in workers.items():
        s = w.ask("step")
        results["frameworks"][name]["steps_raw"].append(s)
        log(f"step {i + 1} {name}: {s['step_s']:.3f} s, {s['tokens']} tokens, loss {s['loss']:.6f}")
  finally:
    for w in workers.values():
      w.close()
  for r in results["frameworks"].values():
    r.update(summarise(r["steps_raw"]))
  return results


def format_table(results: dict[str, Any]) -> str:
  """Markdown: the settings, then per framework the first and median step, tokens/s, jaxrl's speed-up
  (peer step time / jaxrl step time) and the losses of the first and last step."""
  fw = results["frameworks"]
  lines = [f"- {k}: {v}" for k, v in results["settings"].items()] + [""]
  lines += ["| framework | first step s | median step s | tokens/step | tokens/s | jaxrl speed-up | step CPU s "
            "| peak RSS GiB | loss step 1 | loss last step |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  base = fw["jaxrl"]["step_s"]
  for name, r in fw.items():
    cpu = f"{r['step_cpu_s']:.2f}" if "step_cpu_s" in r else "–"
    rss = f"{r['peak_rss_gib']:.1f}" if "peak_rss_gib" in r else "–"
    lines.append(f"| {name} | {r['first_step_s']:.2f} | {r['step_s']:.3f} | {r['tokens']} | {r['tok_s']:,.0f} | "
                 f"{r['step_s'] / base:.2f}× | {cpu} | {rss} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} |")
  for name, r in fw.items():
    if name != "jaxrl":
      n = min(len(r["losses"]), len(fw["jaxrl"]["losses"]))
      gap = max(abs(a - b) for a, b in zip(r["losses"][:n], fw["jaxrl"]["losses"][:n]))
      lines.append(f"\nlosses of {name} and jaxrl over {n} steps on the same pairs: max |difference| {gap:.2e}")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench dpo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=STEPS, help="steps per framework (the first is reported apart)")
  p.add_argument("--pairs", type=int, default=PAIRS, help="preference pairs per step")
  p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
  p.add_argument("--completion-tokens", type=int, default=COMPLETION_TOKENS)
  p.add_argument("--peers", nargs="*", default=["trl"], choices=["trl"])
  p.add_argument("--work-dir", default="runs/bench_dpo", help="model, pairs and trainer outputs")
  p.add_argument("--json", default="runs/bench_dpo.json")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ns = p.parse_args(argv)
  if ns.worker:
    return bench_rl.serve(JaxrlWorker())
  if ns.steps < 2:
    p.error("--steps must be >= 2 (the first step is compilation)")
  results = run(Path(ns.work_dir), steps=ns.steps, pairs=ns.pairs, prompt_tokens=ns.prompt_tokens,
                completion_tokens=ns.completion_tokens, peers=tuple(ns.peers))
  results.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 machine=f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
                 command="jaxrl bench dpo " + " ".join(argv))
  print(format_table(results))
  out = Path(ns.json)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=2))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
