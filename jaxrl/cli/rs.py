"""``jaxrl rs``: rejection sampling for SFT (DeepSeek-R1's stage 3): ``k`` completions per prompt from a local
checkpoint, the ones a reward accepts, deduplicated, written as an SFT data set, optionally trained on at once
with ``jaxrl sft`` (docs/eval.md, "Rejection sampling for SFT")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
from jaxrl import models
from jaxrl.cli import sft as sft_cli
from jaxrl.cli.eval import parse_mesh
from jaxrl.cli.sample import load_inference_model
from jaxrl.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
  """The options of ``jaxrl rs``."""
  p = argparse.ArgumentParser(prog="jaxrl rs", description="rejection sampling for SFT: k samples per prompt, "
                              "keep the ones the reward accepts, deduplicate, write an SFT data set (docs/eval.md)")
  p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  p.add_argument("--data", required=True, help="JSONL file, one prompt a line")
  p.add_argument("--out", required=True, help="output directory (records, sft.jsonl, stats); a rerun with the "
                                              "same sampling settings resumes from its records")
  p.add_argument("--task", default="math", choices=sorted(eval_lib.TASKS), help="how a sample is scored")
  p.add_argument("--reward", default=None, help="custom task: the reward's import path, module:function")
  p.add_argument("--require-think", action="store_true", help="math: a response without <think>...</think> is wrong")
  p.add_argument("--prompt-field", default=None, help="column with the prompt text (default: prompt or messages)")
  p.add_argument("--answer-field", default=None, help="column with the reference answer (default: answer)")
  p.add_argument("--template", default="{prompt}", help="format of a text prompt, with {prompt}")
  p.add_argument("--k", type=int, default=8, help="samples per prompt")
  p.add_argument("--keep-per-prompt", type=int, default=None, help="keep at most N samples per prompt")
  p.add_argument("--keep-truncated", action="store_true", help="keep accepted samples that hit --max-new-tokens")
  p.add_argument("--max-new-tokens", type=int, default=1024)
  p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped and counted")
  p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=0.95)
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
  p.add_argument("--threshold", type=float, default=0.5, help="a sample is accepted when its reward is above")
  p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
  p.add_argument("--chunk", type=int, default=0, help="prompts per generate call (0: enough to fill the slots)")
  p.add_argument("--reward-workers", type=int, default=4)
  p.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. data=-1 or data=2,tensor=2 (default: one "
                                              "device)")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype")
  e = p.add_argument_group("backend", "the continuous-batching engine (default) or the batch sampler")
  e.add_argument("--backend", default="engine", choices=["engine", "sampler"])
  e.add_argument("--num-slots", type=int, default=32, help="engine: rows decoded together")
  e.add_argument("--block-size", type=int, default=16, help="engine: KV cache slots per block")
  e.add_argument("--kv-cache-bytes", type=int, default=None, help="engine: KV cache budget per device")
  t = p.add_argument_group("sft", "train on the written data set at once")
  t.add_argument("--then-sft", default=None, metavar="CONFIG",
                 help="run jaxrl sft with this YAML config and data.train set to the written sft.jsonl")
  t.add_argument("--sft-override", action="append", default=[], metavar="KEY=VALUE",
                 help="a further jaxrl sft override (e.g. steps=100); repeatable")
  return p


def _setup(args):
  """Settings, scorer, problems and sampler from the arguments (a user's mistake raises)."""
  settings = eval_lib.EvalSettings(
      n=args.k, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
      stop_strings=tuple(args.stop), correct_threshold=args.threshold)
  if args.keep_per_prompt is not None and args.keep_per_prompt < 1:
    raise ValueError(f"--keep-per-prompt must be >= 1, got {args.keep_per_prompt}")
  scorer = eval_lib.make_scorer(args.task, reward=args.reward, require_think=args.require_think,
                                workers=args.reward_workers)
  tokenizer = models.load_tokenizer(args.tokenizer or args.model)
  problems = eval_lib.load_problems(args.data, tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                                    prompt_field=args.prompt_field, answer_field=args.answer_field,
                                    template=args.template, required=eval_lib.TASKS[args.task][1])
  if args.limit is not None:
    problems.records, problems.ids, problems.texts = (x[:args.limit] for x in
                                                      (problems.records, problems.ids, problems.texts))
  mesh_cfg = parse_mesh(args.mesh)
  mesh, rules = (None, None) if mesh_cfg is None else (mesh_cfg.build(), mesh_cfg.logical_rules())
  model = load_inference_model(args.model, dtype=args.dtype, mesh=mesh, rules=rules)
  sampler = eval_lib.make_sampler(model, tokenizer, max_len=args.max_prompt_tokens + args.max_new_tokens,
                                  backend=args.backend, num_slots=args.num_slots, block_size=args.block_size,
                                  kv_cache_bytes=args.kv_cache_bytes, mesh=mesh, rules=rules)
  return settings, scorer, problems, sampler


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxrl rs``; prints the statistics table (and runs ``jaxrl sft``); returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    settings, scorer, problems, sampler = _setup(args)
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl rs: error: {e}", file=sys.stderr)
    return 2
  info = {"model": str(Path(args.model).resolve()), "data": str(Path(args.data).resolve()), "task": args.task,
          "reward": args.reward, "template": args.template, "backend": args.backend, "mesh": args.mesh}
  chunk = args.chunk or max(1, -(-2 * args.num_slots // args.k))
  try:
    with scorer:
      stats = eval_lib.rejection_sample(sampler, scorer, problems, settings, args.out, chunk=chunk,
                                        keep_per_prompt=args.keep_per_prompt, keep_truncated=args.keep_truncated,
                                        run_info=info)
  except ConfigError as e:  # records of other sampling settings in --out
    print(f"jaxrl rs: error: {e}", file=sys.stderr)
    return 2
  print(eval_lib.stats_markdown(stats))
  print(f"\ndata set: {stats['dataset']}\nstats: {Path(args.out) / eval_lib.STATS}")
  if args.then_sft is None:
    return 0
  if not stats["kept"]:
    print("jaxrl rs: error: no sample was kept; not running jaxrl sft", file=sys.stderr)
    return 2
  del sampler  # free the engine's KV cache before the trainer allocates
  return sft_cli.main(["--config", args.then_sft, f"data.train={json.dumps([stats['dataset']])}",
                       *args.sft_override])


if __name__ == "__main__":
  sys.exit(main())
