"""On-policy distillation vs SFT on the teacher's samples, at equal student tokens (issue 32, docs/benchmarks.md).

A trained quickstart-size teacher (``--teacher``: an HF dir, e.g. ``jaxrl sft --config configs/sft_tiny.yaml
export_hf=true``'s ``hf``, or ``jaxrl quickstart``'s GRPO result ``OUT/rl/hf``) and the narrower student of
``configs/distill_tiny.yaml``, warm-started once by a short SFT on the built-in demonstrations of
``configs/sft_tiny.yaml`` (``--warm-steps``; or ``--warm DIR``). Per seed, from that warm start:

  opd   ``jaxrl rl --config configs/distill_tiny.yaml`` with the teacher: ``--steps`` steps of 8 prompts × 4
        student samples, per-token advantage −(log π_student − log π_teacher)
  sft   ``jaxrl rs`` draws 4 teacher samples for each of the same number of training prompts (every sample kept:
        sequence-level KD), then ``jaxrl sft`` trains one pass over them

Each student (and the warm start) is then measured the same way: greedy exact-match accuracy on the 128 held-out
problems, and the per-token reverse KL to the teacher on the same held-out prompts (mean ``log π_student −
log π_teacher`` over the response tokens of the student's own samples, 4 per prompt at T = 1: the
``distill/reverse_kl`` metric of one zero-learning-rate ``distill_tiny`` step whose prompts are the held-out split).

Student tokens: arm opd counts the response tokens the student sampled and trained on (``response/length_mean`` ×
samples, every step); arm sft counts the response (assistant) tokens of the SFT set, each trained on once.

  python scripts/distill_compare.py --teacher runs/sft_tiny/hf --out runs/distill_compare --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models
from jaxrl.rl import RLConfig

ROOT = Path(__file__).resolve().parents[1]
DISTILL = ROOT / "configs" / "distill_tiny.yaml"
SFT = ROOT / "configs" / "sft_tiny.yaml"
QUIET = ["tensorboard=false"]


def _run(argv: list[str]) -> None:
  rc = cli.main(argv)
  if rc:
    raise SystemExit(f"jaxrl {' '.join(argv)}: exit {rc}")


def _student_model(hf_dir: str | None) -> list[str]:
  if hf_dir is None:
    shapes = config_lib.read_yaml(DISTILL)["model"]["overrides"]
    return [f"model.overrides={json.dumps(shapes)}"]
  return ["model.preset=null", f"model.hf_dir={hf_dir}", "model.overrides={}"]


def warm_start(out: Path, steps: int) -> str:
  """The student's SFT warm start on ``configs/sft_tiny.yaml``'s built-in demonstrations; returns its HF dir."""
  if not (out / "hf" / "config.json").exists():
    _run(["sft", "--config", str(SFT), *_student_model(None), f"steps={steps}",
          "export_hf=true", "eval.every=0", "checkpoint.every=0", f"out_dir={out}", *QUIET])
  return str(out / "hf")


def opd(out: Path, warm: str, teacher: str, seed: int, steps: int) -> tuple[str, float]:
  """On-policy distillation; returns the student's HF dir and its trained (response) tokens (a finished run is
  reused)."""
  if not (out / "hf" / "config.json").exists():
    _run(["rl", "--config", str(DISTILL), *_student_model(warm), "distill.teacher.preset=null",
          f"distill.teacher.hf_dir={teacher}", "distill.teacher.overrides={}", f"steps={steps}", f"seed={seed}",
          f"data.shuffle_seed={seed}", "eval.every=0", "export_hf=true", f"out_dir={out}", *QUIET])
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  cfg = config_lib.load(RLConfig, DISTILL)
  per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
  tokens = sum(r["response/length_mean"] * per_step for r in rows if "response/length_mean" in r)
  return str(out / "hf"), float(tokens)


def sft_on_teacher(out: Path, warm: str, teacher: str, seed: int, prompts: int) -> tuple[str, float]:
  """``prompts`` training prompts (shuffled by ``seed``) × 4 teacher samples, then one SFT pass over them."""
  cfg = config_lib.load(RLConfig, DISTILL)
  records = cfg.data.builtin.records("train")
  order = np.random.default_rng(seed).permutation(len(records))[:prompts]
  out.mkdir(parents=True, exist_ok=True)
  data_lib.write_jsonl([records[i] for i in order], out / "prompts.jsonl")
  _run(["rs", "--model", teacher, "--data", str(out / "prompts.jsonl"), "--task", "custom", "--reward",
        "jaxrl.rl:arithmetic_reward", "--threshold", "-1", "--keep-truncated", "--k", str(cfg.rollout.n),
        "--seed", str(seed), "--max-new-tokens", str(cfg.rollout.max_new_tokens), "--temperature", "1",
        "--out", str(out / "rs")])
  tok = models.load_tokenizer(teacher)
  kept = [json.loads(x) for x in (out / "rs" / "sft.jsonl").read_text().splitlines()]
  response = sum(len(tok(r["messages"][-1]["content"])["input_ids"]) for r in kept)
  total = sum(len(tok(tok.apply_chat_template(r["messages"], tokenize=False))["input_ids"]) for r in kept)
  steps = max(1, round(total / (8 * 256 * 0.95)))  # one pass: 8 packed rows of 256 tokens a step
  _run(["sft", "--config", str(SFT), *_student_model(warm), f"data.train=[{out / 'rs' / 'sft.jsonl'}]",
        f"steps={steps}", "optim.warmup_steps=2", "export_hf=true", "eval.every=0", "checkpoint.every=0",
        f"out_dir={out / 'sft'}", *QUIET])
  return str(out / "sft" / "hf"), float(response)


def heldout_file(out: Path) -> Path:
  """The held-out split of ``distill_tiny``'s built-in task as a prompt file (never trained on by either arm)."""
  records = config_lib.load(RLConfig, DISTILL).data.builtin.records("heldout")
  return data_lib.write_jsonl(records, out / "heldout.jsonl")


def measure(out: Path, student: str, teacher: str, heldout: Path) -> dict[str, float]:
  """Greedy held-out accuracy and the reverse KL to the teacher on the held-out prompts (no learning; a finished
  measurement is reused)."""
  if not (out / "results.json").exists():
    _run(["rl", "--config", str(DISTILL), *_student_model(student), "distill.teacher.preset=null",
        f"distill.teacher.hf_dir={teacher}", "distill.teacher.overrides={}", "steps=1", "eval.every=1",
          "eval.prompts=128", "optim.lr=1e-30", "data.builtin=null", f"data.train=[{heldout}]",
          f"data.heldout=[{heldout}]", "rollout.prompts_per_step=128", f"out_dir={out}", *QUIET])
  res = json.loads((out / "results.json").read_text())
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  kl = next(r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r)
  return {"accuracy": res["eval_before"]["eval/accuracy"], "reverse_kl": kl}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--teacher", required=True, help="the teacher's HF dir (quickstart size, trained on the task)")
  p.add_argument("--warm", default=None, help="the student's warm start (HF dir); default: SFT it here")
  p.add_argument("--out", required=True)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=40, help="distillation steps (8 prompts × 4 samples each)")
  p.add_argument("--warm-steps", type=int, default=150)
  a = p.parse_args()
  out, teacher = Path(a.out), a.teacher
  warm = a.warm or warm_start(out / "warm", a.warm_steps)
  held = heldout_file(out)
  table = {"teacher": measure(out / "measure_teacher", teacher, teacher, held),
           "warm": measure(out / "measure_warm", warm, teacher, held)}
  prompts = a.steps * config_lib.load(RLConfig, DISTILL).rollout.prompts_per_step
  for seed in a.seeds:
    d = out / f"seed{seed}"
    o_dir, o_tok = opd(d / "opd", warm, teacher, seed, a.steps)
    s_dir, s_tok = sft_on_teacher(d / "sft_arm", warm, teacher, seed, prompts)
    table[f"opd/{seed}"] = dict(measure(d / "measure_opd", o_dir, teacher, held), tokens=o_tok)
    table[f"sft/{seed}"] = dict(measure(d / "measure_sft", s_dir, teacher, held), tokens=s_tok)
    (out / "table.json").write_text(json.dumps(table, indent=2))
  print(json.dumps(table, indent=2))


if __name__ == "__main__":
  main()
