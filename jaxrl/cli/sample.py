"""``jaxrl sample``: load a local HF checkpoint, sample completions, print them (and their log-probs)."""

from __future__ import annotations

import argparse
import sys

from jaxrl import models, sampling


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxrl sample", description="sample completions from a local HF checkpoint")
  p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several prompts")
  p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
  p.add_argument("--n", type=int, default=1, help="samples per prompt")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--max-len", type=int, default=2048, help="most tokens per row (prompt + completion)")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype")
  p.add_argument("--param-dtype", default=None, choices=["float32", "bfloat16"],
                 help="weight storage dtype (default: the compute dtype; only training needs float32 masters)")
  p.add_argument("--logprobs", action="store_true", help="print each token with its log-prob")
  p.add_argument("--top-logprobs", type=int, default=0, help="with --logprobs, also the k most likely tokens")
  return p


def load_inference_model(model_dir, *, dtype: str | None = None, param_dtype: str | None = None, mesh=None,
                         rules=None):
  """A checkpoint loaded for inference only (``jaxrl sample``, ``jaxrl serve``, ``jaxrl eval``): weights stored
  in the compute dtype unless ``param_dtype`` says otherwise, so no float32 master copy (which only training
  needs) sits beside the sampler's compute-dtype weights; placed on ``mesh`` under ``rules`` when given."""
  if param_dtype is None:
    param_dtype = models.config_from_dir(model_dir, dtype=dtype).dtype
  return models.load_pretrained(model_dir, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules)


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxrl sample``; returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    tokenizer = models.load_tokenizer(args.tokenizer or args.model)
    model = load_inference_model(args.model, dtype=args.dtype, param_dtype=args.param_dtype)
    prompts = args.prompt
    if args.chat:
      prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    sampler = sampling.Sampler(model, tokenizer, max_len=args.max_len)
    out = sampler.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                           stop_strings=args.stop, return_top_logprobs=args.top_logprobs if args.logprobs else 0)
  except (FileNotFoundError, ValueError, KeyError) as e:
    print(f"jaxrl sample: error: {e}", file=sys.stderr)
    return 2
  def piece(tid: int) -> str:
    tok = tokenizer.convert_ids_to_tokens(int(tid))
    return repr(tok) if tok is not None else f"<id {int(tid)}>"

  for i, text in enumerate(out.texts):
    p, j = divmod(i, args.n)
    print(f"=== prompt {p} sample {j} ({out.lengths[i]} tokens, {out.finish_reason[i]}) ===")
    print(text)
    if args.logprobs:
      for t in range(out.lengths[i]):
        tid = int(out.tokens[i, t])
        line = f"  {t:4d} {tid:7d} {piece(tid):>16} {out.logprobs[i, t]:9.4f}"
        if out.top_logprobs is not None:
          alts = ", ".join(f"{piece(a)}:{v:.3f}"
                           for a, v in zip(out.top_logprobs.ids[i, t], out.top_logprobs.logprobs[i, t]))
          line += f"   [{alts}]"
        print(line)
      print(f"  sum logprob {out.logprobs[i, :out.lengths[i]].sum():.4f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
