"""``jaxrl serve --model DIR``: load a local HF checkpoint and serve it over the OpenAI API (a reward model's
directory, with ``reward_head.safetensors``: ``POST /v1/rewards``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxrl import models, pref, sampling
from jaxrl.cli.sample import load_inference_model
from jaxrl.rl import EngineConfig, build_engine
from jaxrl.serve import ServerThread, create_app, create_reward_app


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxrl serve", description="OpenAI-compatible server for a local HF checkpoint")
  p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
  p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
  p.add_argument("--served-model-name", default=None, help="id in /v1/models (default: the directory name)")
  p.add_argument("--max-len", type=int, default=2048, help="most tokens per row (prompt + completion)")
  p.add_argument("--max-batch-rows", type=int, default=64, help="most rows (prompts x n) per generate call")
  p.add_argument("--batch-wait-ms", type=float, default=10.0, help="how long a request waits for others to batch with")
  p.add_argument("--max-top-logprobs", type=int, default=20,
                 help="most top_logprobs per request (OpenAI: 20; the vocabulary size lets judges read every score token)")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype")
  p.add_argument("--param-dtype", default=None, choices=["float32", "bfloat16"],
                 help="weight storage dtype (default: the compute dtype; only training needs float32 masters)")
  e = p.add_argument_group("backend", "what generates: the batch sampler, or the continuous-batching engine "
                           "(paged KV cache; rows join and leave the decode batch as they start and finish)")
  e.add_argument("--backend", default="sampler", choices=["sampler", "engine"],
                 help="sampler: jaxrl.sampling.Sampler (default); engine: jaxrl.sampling.Engine")
  e.add_argument("--num-slots", type=int, default=8, help="engine: rows decoded together")
  e.add_argument("--block-size", type=int, default=16, help="engine: KV cache slots per block")
  cache = e.add_mutually_exclusive_group()
  cache.add_argument("--kv-cache-bytes", type=int, default=None, help="engine: KV cache budget per device (bytes)")
  cache.add_argument("--num-blocks", type=int, default=None,
                     help="engine: KV cache blocks in all (default, without --kv-cache-bytes: enough for every "
                          "slot to hold --max-len tokens)")
  return p


def make_backend(args: argparse.Namespace, model, tokenizer):
  """The generate backend the parsed ``args`` ask for (``--backend`` and its knobs)."""
  if args.backend == "sampler":
    return sampling.Sampler(model, tokenizer, max_len=args.max_len)
  for key in ("num_slots", "block_size", "kv_cache_bytes", "num_blocks"):
    value = getattr(args, key)
    if value is not None and value < 1:
      raise ValueError(f"--{key.replace('_', '-')}: must be a positive int, got {value}")
  num_blocks = args.num_blocks
  if num_blocks is None and args.kv_cache_bytes is None:
    num_blocks = args.num_slots * (-(-args.max_len // args.block_size) + 1)
  settings = EngineConfig(num_slots=args.num_slots, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
                          num_blocks=num_blocks)
  return build_engine(model, tokenizer, settings, max_len=args.max_len,
                      max_top_logprobs=min(args.max_top_logprobs, model.cfg.vocab_size))


def build_app(argv: list[str] | None = None):
  """``(app, args)`` for ``jaxrl serve`` arguments, without starting the server (tests, embedding)."""
  args = build_parser().parse_args(argv)
  tokenizer = models.load_tokenizer(args.tokenizer or args.model)
  if (Path(args.model) / pref.REWARD_HEAD_FILE).is_file():  # a reward model: POST /v1/rewards
    rm = pref.RewardModel.load(args.model, tokenizer=tokenizer, rows=args.max_batch_rows, seq_len=args.max_len)
    return create_reward_app(rm, model_name=args.served_model_name or Path(args.model).resolve().name), args
  model = load_inference_model(args.model, dtype=args.dtype, param_dtype=args.param_dtype)
  backend = make_backend(args, model, tokenizer)
  app = create_app(backend, model_name=args.served_model_name or Path(args.model).resolve().name,
                   max_batch_rows=args.max_batch_rows, batch_wait_s=args.batch_wait_ms / 1000,
                   max_top_logprobs=args.max_top_logprobs)
  return app, args


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxrl serve``; returns the exit status."""
  try:
    app, args = build_app(argv)
  except (FileNotFoundError, ValueError, KeyError) as e:
    print(f"jaxrl serve: error: {e}", file=sys.stderr)
    return 2
  srv = ServerThread(app, host=args.host, port=args.port, log_level="info").start()
  print(f"jaxrl serve: {args.model} ({args.backend}) at {srv.url} (Ctrl-C stops)", flush=True)
  try:
    srv.thread.join()
  except KeyboardInterrupt:
    srv.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
