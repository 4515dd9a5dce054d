"""The vision-language RL data commands (docs/vlm_rl.md): ``jaxrl caprl-curate`` (CapRL's QA filter),
``jaxrl rubicap-rubrics`` (RubiCap's rubric synthesis) and ``jaxrl vision-r1-coldstart`` (Vision-R1's modality
bridging). Each model is an OpenAI-compatible endpoint (`jaxrl serve`, vLLM, a hosted API) given by
``--<role>-base-url``/``--<role>-model``, or ``--<role>-launch DIR`` to start `jaxrl serve` of a local model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib


def add_endpoint(p: argparse.ArgumentParser, role: str, what: str, *, required: bool = True) -> None:
  """Options ``--<role>-base-url``, ``-model``, ``-provider``, ``-launch``, ``-cache``, ``-max-concurrency``,
  ``-judge`` (further `JudgeConfig` fields as JSON) for one model endpoint."""
  g = p.add_argument_group(role, what + ("" if required else " (optional)"))
  g.add_argument(f"--{role}-base-url", default=None, help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
  g.add_argument(f"--{role}-model", default=None, help="model name sent with each request")
  g.add_argument(f"--{role}-provider", default="jaxrl", help="jaxrl, vllm, openai, qwen or longcat")
  g.add_argument(f"--{role}-launch", default=None, metavar="DIR", help="start `jaxrl serve` of this local model")
  g.add_argument(f"--{role}-cache", default=None, metavar="FILE", help="SQLite cache of responses (reruns resume)")
  g.add_argument(f"--{role}-max-concurrency", type=int, default=8)
  g.add_argument(f"--{role}-judge", default=None, metavar="JSON", help="further JudgeConfig fields as a JSON object")


def endpoint(args: argparse.Namespace, role: str, *, required: bool = True) -> dict[str, Any] | None:
  """The judge config of ``role`` from its options; None when an optional one is not given."""
  a = lambda k: getattr(args, f"{role}_{k}".replace("-", "_"))  # noqa: E731
  if a("base_url") is None and a("launch") is None:
    if required:
      raise ValueError(f"--{role}-base-url or --{role}-launch is required")
    return None
  cfg: dict[str, Any] = {"provider": a("provider"), "max_concurrency": a("max_concurrency")}
  for key, field in (("base_url", "base_url"), ("model", "model"), ("cache", "cache_path")):
    if a(key) is not None:
      cfg[field] = a(key)
  if a("launch") is not None:
    cfg["launch"] = {"model": a("launch")}
  if a("judge"):
    extra = json.loads(a("judge"))
    if not isinstance(extra, dict):
      raise ValueError(f"--{role}-judge: expected a JSON object, got {a('judge')!r}")
    cfg.update(extra)
  return cfg


def _common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--data", required=True, help="input JSONL (image paths relative to its folder)")
  p.add_argument("--out", required=True, help="output JSONL; statistics go to OUT.stats.json and OUT.stats.md")
  p.add_argument("--workers", type=int, default=8, help="records in flight at once")
  p.add_argument("--seed", type=int, default=0)


def _run(prog: str, fn) -> int:
  try:
    stats = fn()
  except (FileNotFoundError, ValueError, KeyError, data_lib.DataError) as e:
    print(f"jaxrl {prog}: error: {e}", file=sys.stderr)
    return 2
  paths = stats["paths"]
  print(open(paths["table"]).read().rstrip())
  print(f"\ndata: {paths['data']}\nstats: {paths['stats']}")
  return 0


def curate_main(argv: list[str] | None = None) -> int:
  """``jaxrl caprl-curate``: keep the questions a vision model answers with the image (> --visual-min) and a
  text model cannot without it (< --text-max)."""
  p = argparse.ArgumentParser(prog="jaxrl caprl-curate", description="CapRL QA curation (docs/vlm_rl.md)")
  _common(p)
  p.add_argument("--rounds", type=int, default=4, help="shuffled rounds per question and model")
  p.add_argument("--visual-min", type=float, default=0.75)
  p.add_argument("--text-max", type=float, default=0.25)
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--max-tokens", type=int, default=8)
  add_endpoint(p, "vision", "the vision answerer (sees the image: must accept image_url parts)")
  add_endpoint(p, "text", "the text answerer (never sees the image)")
  args = p.parse_args(argv)

  def go():
    cfg = eval_lib.CurateConfig(visual_min=args.visual_min, text_max=args.text_max, rounds=args.rounds,
                                temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                                workers=args.workers)
    return eval_lib.curate_file(args.data, args.out, vision=endpoint(args, "vision"), text=endpoint(args, "text"),
                                config=cfg)
  return _run("caprl-curate", go)


def rubrics_main(argv: list[str] | None = None) -> int:
  """``jaxrl rubicap-rubrics``: committee captions and the student's caption in, per-image rubrics out."""
  p = argparse.ArgumentParser(prog="jaxrl rubicap-rubrics", description="RubiCap rubric synthesis (docs/vlm_rl.md)")
  _common(p)
  p.add_argument("--min-support", type=int, default=2, help="teachers that must state a rubric's fact")
  p.add_argument("--with-image", action="store_true", help="send the image to the writer as well")
  p.add_argument("--on-error", choices=("raise", "skip"), default="raise", help="a writer answer that is not rubric JSON")
  p.add_argument("--max-tokens", type=int, default=2048)
  add_endpoint(p, "writer", "the rubric writer LLM")
  add_endpoint(p, "judge", "a judge that drops rubrics the student's caption already meets", required=False)
  args = p.parse_args(argv)

  def go():
    cfg = eval_lib.SynthConfig(min_support=args.min_support, with_image=args.with_image, on_error=args.on_error,
                               max_tokens=args.max_tokens, workers=args.workers)
    return eval_lib.synthesize_file(args.data, args.out, writer=endpoint(args, "writer"),
                                    judge=endpoint(args, "judge", required=False), config=cfg)
  return _run("rubicap-rubrics", go)


def coldstart_main(argv: list[str] | None = None) -> int:
  """``jaxrl vision-r1-coldstart``: (image, question, answer) in, bridged reasoning that passes the hard reward out
  as SFT chat records with the image."""
  p = argparse.ArgumentParser(prog="jaxrl vision-r1-coldstart", description="Vision-R1 modality bridging (docs/vlm_rl.md)")
  _common(p)
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--mllm-max-tokens", type=int, default=2048)
  p.add_argument("--reasoner-max-tokens", type=int, default=8192)
  add_endpoint(p, "mllm", "the multimodal model that describes the image and drafts reasoning (image_url parts)")
  add_endpoint(p, "reasoner", "the text reasoning model that rewrites the reasoning (e.g. DeepSeek-R1)")
  args = p.parse_args(argv)

  def go():
    cfg = eval_lib.ColdStartConfig(temperature=args.temperature, mllm_max_tokens=args.mllm_max_tokens,
                                   reasoner_max_tokens=args.reasoner_max_tokens, seed=args.seed, workers=args.workers)
    return eval_lib.cold_start_file(args.data, args.out, mllm=endpoint(args, "mllm"),
                                    reasoner=endpoint(args, "reasoner"), config=cfg)
  return _run("vision-r1-coldstart", go)
