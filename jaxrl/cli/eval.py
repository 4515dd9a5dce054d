"""``jaxrl eval``: sample ``n`` responses per problem of a local JSONL file, score them (math, code sandbox or
a custom reward) and report avg@k, pass@k and maj@k as papers do (docs/eval.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
from jaxrl import models, sharding
from jaxrl.cli.sample import load_inference_model
from jaxrl.config import ConfigError


def add_sampling_args(p: argparse.ArgumentParser, *, unit: str = "problem") -> None:
  """The options ``jaxrl eval`` and ``jaxrl rs`` share: model, data, scoring, sampling, mesh and backend
  (``unit`` names a line of the data file in the help)."""
  p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  p.add_argument("--data", required=True, help=f"JSONL file, one {unit} a line")
  p.add_argument("--task", default="math", choices=sorted(eval_lib.TASKS), help="how a response is scored")
  p.add_argument("--reward", default=None, help="custom task: the reward's import path, module:function")
  p.add_argument("--require-think", action="store_true", help="math: a response without <think>...</think> is wrong")
  p.add_argument("--prompt-field", default=None, help="column with the prompt text (e.g. problem); default: "
                                                      "prompt or messages, as in RL data")
  p.add_argument("--answer-field", default=None, help="column with the reference answer (default: answer)")
  p.add_argument("--template", default="{prompt}", help="format of a text prompt, with {prompt}")
  p.add_argument("--max-new-tokens", type=int, default=1024)
  p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped and counted")
  p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=0.95)
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
  p.add_argument("--limit", type=int, default=None, help=f"use only the first N {unit}s")
  p.add_argument("--chunk", type=int, default=0, help=f"{unit}s per generate call (0: enough to fill the slots)")
  p.add_argument("--reward-workers", type=int, default=4)
  p.add_argument("--mesh", default=None, help="mesh axis sizes like the trainers' mesh.shape, e.g. data=-1 or "
                                              "data=2,tensor=2 (default: one device)")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype")
  e = p.add_argument_group("backend", "the continuous-batching engine (default) or the batch sampler")
  e.add_argument("--backend", default="engine", choices=["engine", "sampler"])
  e.add_argument("--num-slots", type=int, default=32, help="engine: rows decoded together")
  e.add_argument("--block-size", type=int, default=16, help="engine: KV cache slots per block")
  e.add_argument("--kv-cache-bytes", type=int, default=None,
                 help="engine: KV cache budget per device (default: enough blocks for every slot's full row)")


def build_parser() -> argparse.ArgumentParser:
  """The options of ``jaxrl eval``."""
  p = argparse.ArgumentParser(prog="jaxrl eval", description="score a local HF checkpoint on a JSONL benchmark: "
                              "avg@k, unbiased pass@k, maj@k (docs/eval.md)")
  add_sampling_args(p)
  p.add_argument("--out", default=None, help="records and summary directory (default: eval_out/<data file stem>); "
                                             "a rerun with the same settings resumes from its records")
  p.add_argument("--n", type=int, default=16, help="samples per problem")
  p.add_argument("--metrics", default=eval_lib.DEFAULT_METRICS,
                 help="comma-separated KIND@k, KIND in avg/pass/maj, k an integer or n (default: %(default)s)")
  p.add_argument("--correct-threshold", type=float, default=0.5, help="a sample is correct when its reward is above")
  p.add_argument("--no-responses", action="store_true", help="leave the response texts out of the records")
  return p


def parse_mesh(spec: str | None) -> sharding.MeshConfig | None:
  """``"data=2,tensor=2"`` as the trainers' ``mesh:`` section (``None``: one device, no mesh)."""
  if spec is None:
    return None
  shape = {}
  for item in spec.split(","):
    axis, eq, size = item.partition("=")
    if not eq or not size.strip().lstrip("-").isdigit():
      raise ValueError(f"--mesh: expected AXIS=SIZE[,AXIS=SIZE...], got {spec!r}")
    shape[axis.strip()] = int(size)
  return sharding.MeshConfig(shape=shape)


def setup(args: argparse.Namespace, *, n: int, threshold: float):
  """``(settings, scorer, problems, sampler)`` from the options of :func:`add_sampling_args` with ``n``
  samples per problem and the reward ``threshold`` above which a sample counts (a user's mistake raises)."""
  settings = eval_lib.EvalSettings(
      n=n, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
      stop_strings=tuple(args.stop), correct_threshold=threshold)
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
  """Entry point of ``jaxrl eval``; prints the summary table and returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    metrics = eval_lib.parse_metrics(args.metrics, args.n)
    settings, scorer, problems, sampler = setup(args, n=args.n, threshold=args.correct_threshold)
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl eval: error: {e}", file=sys.stderr)
    return 2
  out_dir = Path(args.out) if args.out else Path("eval_out") / Path(args.data).stem
  info = {"model": str(Path(args.model).resolve()), "data": str(Path(args.data).resolve()), "task": args.task,
          "reward": args.reward, "template": args.template, "backend": args.backend,
          "mesh": args.mesh}
  chunk = args.chunk or max(1, -(-2 * args.num_slots // args.n))
  try:
    with scorer:
      records = eval_lib.evaluate(sampler, scorer, problems, settings, out_dir, chunk=chunk,
                                  keep_text=not args.no_responses, run_info=info)
  except ConfigError as e:  # records of other settings in --out
    print(f"jaxrl eval: error: {e}", file=sys.stderr)
    return 2
  result = eval_lib.summary(records, metrics, settings, skipped=problems.skipped, run_info=info)
  path = eval_lib.write_summary(out_dir, result)
  print(eval_lib.markdown(result))
  print(f"\nrecords: {out_dir / eval_lib.RECORDS}\nsummary: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
