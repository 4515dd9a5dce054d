"""``jaxrl eval``: sample ``n`` responses per problem of a local JSONL file, score them (math, code sandbox or
a custom reward) and report avg@k, pass@k and maj@k as papers do (docs/eval.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
from jaxrl import models, sharding
from jaxrl.cli.sample import load_inference_model
from jaxrl.config import ConfigError, from_dict

MISSING_MODEL = "--model is required"


def add_sampling_args(p: argparse.ArgumentParser, *, unit: str = "problem") -> None:
  """The options ``jaxrl eval`` and ``jaxrl rs`` share: model, data, scoring, sampling, mesh and backend
  (``unit`` names a line of the data file in the help)."""
  p.add_argument("--model", default=None, help="Hugging Face model directory (config.json + safetensors); "
                                              "required unless --config names one")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  p.add_argument("--data", default=None, help=f"JSONL file, one {unit} a line (required unless --config)")
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
  p.add_argument("--out", default=None, help="records and summary directory (default: eval_out/<data file stem>; "
                                             "with --config, eval_out/<recipe stem>/<benchmark>); a rerun with the "
                                             "same settings resumes from its records")
  p.add_argument("--n", type=int, default=16, help="samples per problem")
  p.add_argument("--metrics", default=eval_lib.DEFAULT_METRICS,
                 help="comma-separated KIND@k, KIND in avg/pass/maj, k an integer or n (default: %(default)s)")
  p.add_argument("--correct-threshold", type=float, default=0.5, help="a sample is correct when its reward is above")
  p.add_argument("--no-responses", action="store_true", help="leave the response texts out of the records")
  r = p.add_argument_group("recipe", "run a recipe's eval.benchmarks (its model, tokenizer, mesh, engine and "
                           "reward); any flag above overrides the recipe's value")
  r.add_argument("--config", default=None, help="recipe YAML with an eval.benchmarks list")
  r.add_argument("--benchmark", action="append", default=[], help="run only this benchmark; repeatable")
  r.add_argument("--override", action="append", default=[], help="recipe override KEY=VALUE; repeatable")
  return p


_UNSET = object()


def explicit_options(argv: list[str]) -> dict[str, object]:
  """The options given on the command line, not their defaults: ``argv`` parsed again with every default
  replaced by a marker (a repeatable option, default ``[]``, counts when given once or more)."""
  parser = build_parser()
  values = vars(parser.parse_args(argv))
  parser.set_defaults(**{k: _UNSET for k, v in values.items() if not isinstance(v, list)})
  return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not _UNSET and v != []}


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


def settings_of(args: argparse.Namespace, *, n: int, threshold: float) -> eval_lib.EvalSettings:
  """The sampling settings of the options, ``n`` samples per problem, correct above ``threshold``."""
  return eval_lib.EvalSettings(
      n=n, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
      stop_strings=tuple(args.stop), correct_threshold=threshold)


def scorer_of(args: argparse.Namespace):
  """The reward runner of the options (with a recipe's reward kwargs and runner section when it has them)."""
  return eval_lib.make_scorer(args.task, reward=args.reward, require_think=args.require_think,
                              workers=args.reward_workers, reward_kwargs=getattr(args, "reward_kwargs", None),
                              runner=getattr(args, "reward_runner", None))


def problems_of(args: argparse.Namespace, tokenizer):
  """The problems of ``--data`` (first ``--limit``), encoded for the model."""
  if not args.data:
    raise ValueError("--data is required")
  problems = eval_lib.load_problems(args.data, tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                                    prompt_field=args.prompt_field, answer_field=args.answer_field,
                                    template=args.template, required=eval_lib.TASKS[args.task][1],
                                    images=images_of(args))
  if args.limit is not None:
    problems.records, problems.ids, problems.texts = (x[:args.limit] for x in
                                                      (problems.records, problems.ids, problems.texts))
  return problems


def images_of(args: argparse.Namespace) -> data_lib.ImageConfig | None:
  """A recipe's ``data.images`` as :class:`jaxrl.data.ImageConfig` (``None`` without a recipe or the key)."""
  images = getattr(args, "images", None)
  return None if images is None else from_dict(data_lib.ImageConfig, images, prefix="data.images")


def load_model(args: argparse.Namespace):
  """``(tokenizer, model, mesh, rules)`` of the options: the model on ``--mesh`` over this process's devices (one
  device without it); under ``jax.distributed`` each process runs its own copy on its share of the problems."""
  if not args.model:
    raise ValueError(MISSING_MODEL)
  tokenizer = models.load_tokenizer(args.tokenizer or args.model)
  mesh_cfg = parse_mesh(args.mesh)
  mesh, rules = (None, None) if mesh_cfg is None else (mesh_cfg.build(jax.local_devices()),
                                                        mesh_cfg.logical_rules())
  return tokenizer, load_inference_model(args.model, dtype=args.dtype, mesh=mesh, rules=rules), mesh, rules


def sampler_of(args: argparse.Namespace, model, tokenizer, mesh, rules):
  """The engine (or batch sampler) for rows of ``--max-prompt-tokens + --max-new-tokens`` tokens."""
  return eval_lib.make_sampler(model, tokenizer, max_len=args.max_prompt_tokens + args.max_new_tokens,
                               backend=args.backend, num_slots=args.num_slots, block_size=args.block_size,
                               kv_cache_bytes=args.kv_cache_bytes, mesh=mesh, rules=rules)


def setup(args: argparse.Namespace, *, n: int, threshold: float):
  """``(settings, scorer, problems, sampler)`` from the options of :func:`add_sampling_args` with ``n``
  samples per problem and the reward ``threshold`` above which a sample counts (a user's mistake raises)."""
  settings = settings_of(args, n=n, threshold=threshold)
  scorer = scorer_of(args)
  tokenizer, model, mesh, rules = load_model(args)
  problems = problems_of(args, tokenizer)
  return settings, scorer, problems, sampler_of(args, model, tokenizer, mesh, rules)


def run_one(args: argparse.Namespace, loaded, out_dir: Path, info: dict[str, object]) -> int:
  """Evaluates the options' data set with the ``loaded`` ``(tokenizer, model, mesh, rules)`` into ``out_dir``;
  prints the table; returns the exit status."""
  tokenizer, model, mesh, rules = loaded
  try:
    metrics = eval_lib.parse_metrics(args.metrics, args.n)
    settings = settings_of(args, n=args.n, threshold=args.correct_threshold)
    scorer = scorer_of(args)
    problems = problems_of(args, tokenizer)
    sampler = sampler_of(args, model, tokenizer, mesh, rules)
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl eval: error: {e}", file=sys.stderr)
    return 2
  info = {"model": str(Path(args.model).resolve()), "data": str(Path(args.data).resolve()), "task": args.task,
          "reward": args.reward, "template": args.template, "backend": args.backend, "mesh": args.mesh, **info}
  chunk = args.chunk or max(1, -(-2 * args.num_slots // args.n))
  try:
    with scorer:
      records = eval_lib.evaluate(sampler, scorer, problems, settings, out_dir, chunk=chunk,
                                  keep_text=not args.no_responses, run_info=info)
  except ConfigError as e:  # records of other settings in --out
    print(f"jaxrl eval: error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() != 0:  # process 0 writes the summary and prints the table
    return 0
  result = eval_lib.summary(records, metrics, settings, skipped=problems.skipped, run_info=info)
  path = eval_lib.write_summary(out_dir, result)
  print(eval_lib.markdown(result))
  print(f"\nrecords: {out_dir / eval_lib.RECORDS}\nsummary: {path}")
  return 0


def recipe_runs(args: argparse.Namespace, explicit: dict[str, object]) -> list[tuple[argparse.Namespace, Path]]:
  """For ``--config``: one ``(options, out_dir)`` per selected benchmark, the benchmark's and recipe's values
  under the flags given on the command line."""
  recipe = eval_lib.read_recipe(args.config, args.override)
  root = Path(args.out) if args.out else Path("eval_out") / Path(args.config).stem
  runs = []
  for bench in eval_lib.select_benchmarks(recipe, args.benchmark):
    values = {**vars(args), **eval_lib.benchmark_options(bench, recipe), **explicit}
    if "task" in explicit or "reward" in explicit:  # the recipe's reward goes with its own task only
      values.update(reward_kwargs=None, reward_runner=None)
    if not values["model"]:
      raise ValueError(f"{args.config}: the recipe's model is a preset (no model.hf_dir): give --model DIR")
    runs.append((argparse.Namespace(**values, benchmark_name=bench.name), root / bench.name))
  return runs


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxrl eval``; prints the summary table(s) and returns the exit status."""
  args = build_parser().parse_args(argv)
  sharding.initialize()  # multi-host when JAXRL_COORDINATOR/... or JAXRL_AUTO_DISTRIBUTED=1 are set (docs/multihost.md)
  try:
    if args.config:
      runs = recipe_runs(args, explicit_options(argv if argv is not None else sys.argv[1:]))
    else:
      if not args.data:
        raise ValueError("--data is required (or --config RECIPE with eval.benchmarks)")
      runs = [(args, Path(args.out) if args.out else Path("eval_out") / Path(args.data).stem)]
    loaded = load_model(runs[0][0])
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl eval: error: {e}", file=sys.stderr)
    return 2
  status = 0
  for run_args, out_dir in runs:
    if len(runs) > 1:
      print(f"\n## {run_args.benchmark_name}\n")
    info = {"recipe": args.config, "benchmark": run_args.benchmark_name} if args.config else {}
    status = max(status, run_one(run_args, loaded, out_dir, info))
  return status


if __name__ == "__main__":
  sys.exit(main())
