"""On-policy distillation vs SFT on the teacher's samples, at equal student tokens (issue 32, docs/benchmarks.md).

A trained quickstart-size teacher (``--teacher``: an HF dir, e.g. ``jaxrl sft --config configs/sft_tiny.yaml
export_hf=true``'s ``hf``, or ``jaxrl quickstart``'s GRPO result ``OUT/rl/hf``) and the narrower student of
``configs/distill_tiny.yaml``, warm-started once by a short SFT on the built-in demonstrations of
``configs/sft_tiny.yaml`` (``--warm-steps``; or ``--warm DIR``), then optionally SFT'd on the teacher's samples
(``--mid-sft``: the setting where on-policy distillation continues an SFT'd student). Per seed, from that start:

  opd   ``jaxrl rl --config configs/distill_tiny.yaml`` with the teacher: ``--steps`` steps of 32 student samples
        (``--samples-per-prompt`` N per prompt, 32/N prompts a step; default 4 × 8), per-token advantage
        −(log π_student − log π_teacher) (``--lr``; ``--opd-set distill.mode=gkd``: the generalised JSD of the full
        next-token distributions on the student's samples; with ``--lmbda`` < 1, GKD's mixture: that share of
        steps on the student's samples, the rest on the sft arm's teacher samples)
  sft   ``jaxrl rs`` draws N teacher samples for each of the same training prompts (``--sft-prompts`` to change their
        number; every sample kept, duplicates included: sequence-level KD), then ``jaxrl sft`` trains one pass over
        them (``--sft-lr``, ``--sft-set``)

Each student (and the teacher and the warm start) is then measured the same way: greedy exact-match accuracy on
``--heldout`` distinct held-out-split problems (``jaxrl eval``, per problem, so two students can be compared with a
sign test on the problems one gets right and the other wrong), and the per-token reverse KL to the teacher on the
first ``--kl-prompts`` of them (mean ``log π_student − log π_teacher`` over the response tokens of the student's
own samples, 4 per prompt at T = 1: the ``distill/reverse_kl`` metric of one zero-learning-rate ``distill_tiny``
step whose prompts are those problems). Neither arm trains on a held-out-split question (the split is a hash of
the question).

Every generation (opd rollouts, the teacher's samples for sft, both measurements) uses ``--max-new-tokens`` (40 by
default: a three-term worked answer needs more than 24 tokens, and a cut answer is scored wrong).

Student tokens: arm opd counts the response tokens the student sampled and trained on (``response/length_mean`` ×
samples, every step); arm sft counts the response (assistant) tokens of the SFT set, each trained on once.

  python scripts/distill_compare.py --teacher runs/sft_tiny/hf --out runs/distill_compare --seeds 0 1 2
  python scripts/distill_compare.py --teacher runs/teacher/hf --warm runs/warm600/hf --out runs/dc/final \
    --steps 500 --lr 3e-4 --opd-set distill.mode=gkd --opd-set distill.beta=1.0 --sft-lr 1e-3   # the second run
  python scripts/distill_compare.py --teacher runs/teacher/hf --warm runs/warm600/hf --out runs/dc/tuned \
    --steps 480 --sft-prompts 16000 --samples-per-prompt 1 --lr 1e-2 --opd-set distill.mode=gkd \
    --opd-set distill.beta=0.0 --opd-set optim.schedule=cosine --opd-set optim.warmup_steps=20 --sft-lr 6e-3
    # the third run; its settings were chosen with --heldout-skip 400 (a validation set) and --seeds 0
  python scripts/distill_compare.py --teacher runs/teacher/hf --warm runs/warm600/hf --mid-sft 100 --mid-sft 101,102 \
    --out runs/dc/mid --steps 238 --sft-prompts 8000 --samples-per-prompt 1 --lr 3e-4 --opd-set distill.mode=gkd \
    --opd-set distill.beta=1.0 --opd-set optim.schedule=cosine --opd-set optim.warmup_steps=20 --sft-lr 2e-3
    # the fifth run: both arms continue from a student already SFT'd on 48,000 of the teacher's samples

Results are written to ``OUT/table.json`` (per-problem outcomes included) and printed; a rerun reuses every
finished stage, so an interrupted comparison resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
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


def opd(out: Path, warm: str, teacher: str, seed: int, steps: int, max_new: int, lr: float | None,
        extra: list[str]) -> tuple[str, float]:
  """On-policy distillation; returns the student's HF dir and its trained (response) tokens (a finished run is
  reused)."""
  if not (out / "hf" / "config.json").exists():
    _run(["rl", "--config", str(DISTILL), *_student_model(warm), "distill.teacher.preset=null",
          f"distill.teacher.hf_dir={teacher}", "distill.teacher.overrides={}", f"steps={steps}", f"seed={seed}",
          f"data.shuffle_seed={seed}", f"rollout.max_new_tokens={max_new}", *([f"optim.lr={lr}"] if lr else []),
          "eval.every=0", "export_hf=true", f"out_dir={out}", *QUIET, *extra])
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  cfg = config_lib.load(RLConfig, out / "config.json")  # the run's own (rollout overrides included)
  per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
  tokens = sum(r["response/length_mean"] * per_step for r in rows if "response/length_mean" in r)
  return str(out / "hf"), float(tokens)


def teacher_samples(out: Path, teacher: str, seed: int, prompts: int, k: int, max_new: int) -> Path:
  """``prompts`` training prompts (shuffled by ``seed``) × ``k`` teacher samples at T = 1, every sample kept
  (duplicates included: ``rs`` deduplicates its sft.jsonl, and a competent teacher at T = 1 repeats itself for most
  prompts, which would leave the sft arm with far fewer tokens than opd's samples); returns the SFT file."""
  cfg = config_lib.load(RLConfig, DISTILL)
  records = cfg.data.builtin.records("train")
  rng = np.random.default_rng(seed)  # as many passes over the train split as opd's ``prompts`` take
  order = np.concatenate([rng.permutation(len(records)) for _ in range(-(-prompts // len(records)))])[:prompts]
  out.mkdir(parents=True, exist_ok=True)
  data_lib.write_jsonl([records[i] for i in order], out / "prompts.jsonl")
  if not (out / "rs" / "sft.jsonl").exists():
    _run(["rs", "--model", teacher, "--data", str(out / "prompts.jsonl"), "--task", "custom", "--reward",
          "jaxrl.rl:arithmetic_reward", "--threshold", "-1", "--keep-truncated", "--k", str(k),
          "--seed", str(seed), "--max-new-tokens", str(max_new), "--temperature", "1", "--out", str(out / "rs")])
  problems = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
  samples = sorted((json.loads(x) for x in (out / "rs" / "records.jsonl").read_text().splitlines()),
                   key=lambda r: r["line"])
  kept = [eval_lib.sft_record(problems[r["line"] - 1], r, i) for r in samples for i in range(len(r["responses"]))]
  return data_lib.write_jsonl(kept, out / "all_samples.jsonl")


def sft_pass(out: Path, warm: str, teacher: str, files: list[Path], lr: float | None, extra: list[str],
             ) -> tuple[str, float]:
  """One SFT pass from ``warm`` over ``files`` (concatenated; 8 packed rows of 256 tokens a step, cosine lr);
  returns the student's HF dir and its trained (response) tokens."""
  kept = [json.loads(x) for f in files for x in f.read_text().splitlines()]
  data = files[0] if len(files) == 1 else data_lib.write_jsonl(kept, out / "all_samples.jsonl")
  tok = models.load_tokenizer(teacher)
  response = sum(len(tok(r["messages"][-1]["content"])["input_ids"]) for r in kept)
  total = sum(len(tok(tok.apply_chat_template(r["messages"], tokenize=False))["input_ids"]) for r in kept)
  steps = max(1, round(total / (8 * 256 * 0.95)))
  if not (out / "sft" / "hf" / "config.json").exists():
    _run(["sft", "--config", str(SFT), *_student_model(warm), f"data.train=[{data}]",
          f"steps={steps}", "optim.warmup_steps=2", *([f"optim.lr={lr}"] if lr else []), "export_hf=true",
          "eval.every=0", "checkpoint.every=0", f"out_dir={out / 'sft'}", *QUIET, *extra])
  return str(out / "sft" / "hf"), float(response)


def sft_on_teacher(out: Path, warm: str, teacher: str, seed: int, prompts: int, k: int, max_new: int,
                   lr: float | None, extra: list[str]) -> tuple[str, float]:
  """The sft arm: ``k`` teacher samples for each of ``prompts`` training prompts, then one SFT pass over them."""
  return sft_pass(out, warm, teacher, [teacher_samples(out, teacher, seed, prompts, k, max_new)], lr, extra)


def mid_sft(out: Path, warm: str, teacher: str, stages: list[str], prompts: int, max_new: int, lr: float) -> str:
  """Stages of SFT on the teacher's samples before the comparison (the on-policy distillation setting of Thinking
  Machines: a student already SFT'd on the teacher's data). Each stage (``"100"``, ``"101,102"``) trains one pass
  from the previous stage's model over one teacher sample for each of ``prompts`` training prompts per seed
  listed; returns the last stage's HF dir."""
  for i, stage in enumerate(stages):
    d = out / f"mid{i}"
    seeds = [int(x) for x in stage.split(",")]
    files = [teacher_samples(d if len(seeds) == 1 else d / f"s{s}", teacher, s, prompts, 1, max_new) for s in seeds]
    warm, _ = sft_pass(d, warm, teacher, files, lr, [])
  return warm


def heldout_file(out: Path, n: int, skip: int = 0) -> Path:
  """``n`` distinct held-out-split problems of ``distill_tiny``'s built-in task as a prompt file (never trained on
  by either arm), after the first ``skip`` of them (``skip`` > 0: a validation set disjoint from the ``skip = 0``
  accuracy set, for choosing settings)."""
  builtin = config_lib.load(RLConfig, DISTILL).data.builtin
  records = dataclasses.replace(builtin, n_heldout=skip + n).records("heldout")[skip:]
  return data_lib.write_jsonl(records, out / "heldout.jsonl")


def measure(out: Path, student: str, teacher: str, heldout: Path, max_new: int, kl_prompts: int) -> dict:
  """Greedy held-out accuracy (per problem) and the reverse KL to the teacher on the first ``kl_prompts`` held-out
  prompts (no learning; a finished measurement is reused)."""
  if not (out / "eval" / "summary.json").exists():
    _run(["eval", "--model", student, "--data", str(heldout), "--task", "custom", "--reward",
          "jaxrl.rl:arithmetic_reward", "--n", "1", "--temperature", "0", "--metrics", "avg@1",
          "--max-new-tokens", str(max_new), "--no-responses", "--out", str(out / "eval")])
  records = [json.loads(x) for x in (out / "eval" / "records.jsonl").read_text().splitlines()]
  records.sort(key=lambda r: r["line"])
  correct = [bool(r["correct"][0]) for r in records]
  cut = sum(r["finish_reasons"][0] == "length" for r in records)
  kl_file = out / "kl_prompts.jsonl"
  if not (out / "kl" / "metrics.jsonl").exists():
    lines = heldout.read_text().splitlines()[:kl_prompts]
    kl_file.write_text("".join(x + "\n" for x in lines))
    _run(["rl", "--config", str(DISTILL), *_student_model(student), "distill.teacher.preset=null",
          f"distill.teacher.hf_dir={teacher}", "distill.teacher.overrides={}", "steps=1", "eval.every=0",
          "optim.lr=1e-30", "data.builtin=null", f"data.train=[{kl_file}]", f"data.heldout=[{kl_file}]",
          f"rollout.prompts_per_step={len(lines)}", f"rollout.max_new_tokens={max_new}", f"out_dir={out / 'kl'}",
          *QUIET])
  rows = [json.loads(x) for x in (out / "kl" / "metrics.jsonl").read_text().splitlines()]
  kl = next(r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r)
  return {"accuracy": sum(correct) / len(correct), "correct_of": [sum(correct), len(correct)], "cut": cut,
          "reverse_kl": kl, "per_problem": correct}


def sign_test(a: list[bool], b: list[bool]) -> dict:
  """Exact two-sided sign test on paired per-problem outcomes: ``a`` right and ``b`` wrong vs the reverse."""
  up = sum(x and not y for x, y in zip(a, b))
  down = sum(y and not x for x, y in zip(a, b))
  n, k = up + down, min(up, down)
  p = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
  return {"a_only": up, "b_only": down, "p": p}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--teacher", required=True, help="the teacher's HF dir (quickstart size, trained on the task)")
  p.add_argument("--warm", default=None, help="the student's warm start (HF dir); default: SFT it here")
  p.add_argument("--out", required=True)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=40, help="distillation steps (32 student samples each)")
  p.add_argument("--samples-per-prompt", type=int, default=4,
                 help="samples per training prompt in both arms: opd's rollout.n (with 32/N prompts a step) and the "
                      "teacher's samples per prompt of the sft arm")
  p.add_argument("--sft-prompts", type=int, default=None,
                 help="training prompts of the sft arm (--samples-per-prompt teacher samples each; default: opd's "
                      "steps × 32/N, the same prompts; set it to match opd's student tokens when opd's samples run "
                      "longer)")
  p.add_argument("--warm-steps", type=int, default=150)
  p.add_argument("--mid-sft", action="append", default=[], metavar="SEEDS",
                 help="a stage of SFT on the teacher's samples after the warm start, before both arms (e.g. "
                      "--mid-sft 100 --mid-sft 101,102: one pass over the samples of seed 100's prompts, then one over "
                      "seeds 101 and 102's together); repeatable")
  p.add_argument("--mid-sft-prompts", type=int, default=16000, help="training prompts per seed of a --mid-sft stage")
  p.add_argument("--mid-sft-lr", type=float, default=6e-3, help="the --mid-sft stages' peak learning rate")
  p.add_argument("--max-new-tokens", type=int, default=40, help="every generation: rollouts, teacher samples, evals")
  p.add_argument("--lr", type=float, default=None, help="opd learning rate (default: distill_tiny's)")
  p.add_argument("--opd-set", action="append", default=[], metavar="KEY=VALUE",
                 help="a further override of the opd run (e.g. distill.mode=gkd); repeatable")
  p.add_argument("--lmbda", type=float, default=1.0,
                 help="opd's distill.lmbda (GKD's λ, mode gkd): the share of steps on the student's samples; the "
                      "rest train on the sft arm's teacher samples (counted as student tokens too)")
  p.add_argument("--sft-lr", type=float, default=None, help="sft arm peak learning rate (default: sft_tiny's)")
  p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                 help="a further override of the sft arm's training run (e.g. optim.clip_norm=null); repeatable")
  p.add_argument("--heldout", type=int, default=400, help="held-out problems for greedy accuracy")
  p.add_argument("--heldout-skip", type=int, default=0,
                 help="skip the first K distinct held-out problems (K >= --heldout: a disjoint validation set)")
  p.add_argument("--kl-prompts", type=int, default=128, help="held-out prompts (the first ones) for the reverse KL")
  a = p.parse_args()
  out, teacher, max_new = Path(a.out), a.teacher, a.max_new_tokens
  bad = [x for x in a.mid_sft if not all(s.isdigit() for s in x.split(","))]
  if bad:
    raise SystemExit(f"--mid-sft takes seeds separated by commas (e.g. 101,102), got {bad[0]!r}")
  warm = a.warm or warm_start(out / "warm", a.warm_steps)
  warm = mid_sft(out, warm, teacher, a.mid_sft, a.mid_sft_prompts, max_new, a.mid_sft_lr)
  held = heldout_file(out, a.heldout, a.heldout_skip)
  meas = dict(heldout=held, max_new=max_new, kl_prompts=a.kl_prompts)
  table = {"teacher": measure(out / "measure_teacher", teacher, teacher, **meas),
           "warm": measure(out / "measure_warm", warm, teacher, **meas)}
  rollout = config_lib.load(RLConfig, DISTILL).rollout
  per_step, k = rollout.prompts_per_step * rollout.n, a.samples_per_prompt  # 32 student samples a step
  if k < 1 or per_step % k:
    raise SystemExit(f"--samples-per-prompt must divide {per_step} (the samples of one opd step), got {k}")
  opd_set = [f"rollout.n={k}", f"rollout.prompts_per_step={per_step // k}", *a.opd_set]
  prompts = a.sft_prompts or a.steps * (per_step // k)
  if not 0 <= a.lmbda <= 1:
    raise SystemExit(f"--lmbda must be in [0, 1], got {a.lmbda}")
  for seed in a.seeds:
    d = out / f"seed{seed}"
    s_dir, s_tok = sft_on_teacher(d / "sft_arm", warm, teacher, seed, prompts, k, max_new, a.sft_lr, a.sft_set)
    mix = [] if a.lmbda == 1 else [f"distill.lmbda={a.lmbda}", f"distill.data=[{d / 'sft_arm' / 'all_samples.jsonl'}]"]
    o_dir, o_tok = opd(d / "opd", warm, teacher, seed, a.steps, max_new, a.lr, opd_set + mix)
    table[f"opd/{seed}"] = dict(measure(d / "measure_opd", o_dir, teacher, **meas), tokens=o_tok)
    table[f"sft/{seed}"] = dict(measure(d / "measure_sft", s_dir, teacher, **meas), tokens=s_tok)
    for a_name, b_name in (("opd", "sft"), ("opd", "warm"), ("sft", "warm")):
      a_row, b_row = table[f"{a_name}/{seed}"], table[b_name if b_name == "warm" else f"{b_name}/{seed}"]
      table[f"{a_name}_vs_{b_name}/{seed}"] = sign_test(a_row["per_problem"], b_row["per_problem"])
    (out / "table.json").write_text(json.dumps(table, indent=2))
  print(json.dumps({k: {f: v for f, v in row.items() if f != "per_problem"} for k, row in table.items()}, indent=2))


if __name__ == "__main__":
  main()
