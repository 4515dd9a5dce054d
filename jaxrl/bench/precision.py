"""Sampler-vs-trainer log-prob gap in bf16 compute with float32 master weights.

The sampler decodes from a bf16 copy of the weights (``models.cast_params``, made on device) with
its KV cache and decode kernel; the trainer recomputes the same tokens' log-probs in one packed
forward pass from the float32 master weights cast per matmul. Both multiply the bf16 final hidden
state by the bf16 unembedding (``Transformer.unembed_matrix``), accumulating in float32. The table
reports ``|log π_sampler − log π_trainer|`` over every generated token for: the trainer as built,
the trainer with a float32 unembedding (what it did before the unembedding was cast the same way),
and the float32-compute pair as the floor.

The model is randomly initialised (no weights are downloaded); its output projection is scaled so
that the per-token entropy is that of a confident model (reported), since a freshly initialised
model's near-uniform distribution would hide the gap.

Usage::

  jaxrl bench precision [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import losses, models, sampling


def _model(cfg: models.ModelConfig, head_scale: float):
  model = models.init_model(cfg, seed=0)
  model.lm_head.set_value(model.lm_head.get_value() * head_scale)
  return model


def _trainer_logprobs(model, tokens, *, f32_unembed: bool):
  """Log-probs of ``tokens[:, 1:]`` from one forward pass over each full row, ``[R, L - 1]``."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    r, l = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (r, l))
    hidden = m(tokens, positions=pos, segment_ids=jnp.ones_like(tokens), return_hidden=True)
    w = m.lm_head[...].astype(jnp.float32) if f32_unembed else m.unembed_matrix()
    return losses.token_logprobs(hidden[:, :-1], w, tokens[:, 1:], chunk_size=256)

  return np.asarray(run(state, jnp.asarray(tokens)))


def measure(*, dtype: str, rows: int, prompt_len: int, new_tokens: int, head_scale: float, layers: int):
  cfg = models.ModelConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                           num_layers=layers, num_heads=4, num_kv_heads=2, attention_bias=True,
                           dtype=dtype, param_dtype="float32")
  model = _model(cfg, head_scale)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (rows, prompt_len)).tolist()
  sampler = sampling.Sampler(model, None, max_len=prompt_len + new_tokens)
  out = sampler.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0, seed=0, return_entropy=True)
  tokens = np.concatenate([np.asarray(prompts), out.tokens], axis=1)
  sampled = out.logprobs  # [R, new]
  report = {"dtype": dtype, "param_dtype": "float32", "tokens": int(sampled.size),
            "mean_entropy": float(np.mean(out.entropy))}
  for name, f32_unembed in (("trainer", False), ("trainer_f32_unembed", True)):
    if dtype == "float32" and f32_unembed:
      continue
    lp = _trainer_logprobs(model, tokens, f32_unembed=f32_unembed)[:, prompt_len - 1:]
    diff = np.abs(lp - sampled)
    report[name] = {"mean_abs": float(diff.mean()), "p99_abs": float(np.quantile(diff, 0.99)),
                    "max_abs": float(diff.max()), "mean_signed": float((sampled - lp).mean())}
  return report


def markdown_table(results: list[dict]) -> str:
  lines = ["| compute dtype | trainer unembedding | tokens | mean entropy (nats) | mean abs gap | p99 abs gap | max abs gap |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    for name, label in (("trainer", "compute dtype (as built)"), ("trainer_f32_unembed", "float32 (before)")):
      if name in r:
        g = r[name]
        lines.append(f"| {r['dtype']} | {label} | {r['tokens']} | {r['mean_entropy']:.2f} | {g['mean_abs']:.2e} | "
                     f"{g['p99_abs']:.2e} | {g['max_abs']:.2e} |")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench precision", description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="fewer rows and tokens")
  p.add_argument("--head-scale", type=float, default=30.0, help="output-projection scale (sets the entropy)")
  p.add_argument("--json", default=None, help="write the results here")
  args = p.parse_args(argv)
  rows, new_tokens, layers = (4, 32, 2) if args.quick else (16, 96, 4)
  start = time.time()
  results = [measure(dtype=d, rows=rows, prompt_len=16, new_tokens=new_tokens, head_scale=args.head_scale,
                     layers=layers) for d in ("bfloat16", "float32")]
  print(markdown_table(results))
  print(f"\n{jax.devices()[0].platform} backend, jax {jax.__version__}, {time.time() - start:.0f}s")
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main(__import__("sys").argv[1:]))
