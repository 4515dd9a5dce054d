"""``jaxrl bench sample``: jaxrl's sampler against Hugging Face ``generate`` (PyTorch) on the same weights.

For each model shape a random jaxrl model is written with :func:`jaxrl.models.save_pretrained` and
read back by ``transformers.AutoModelForCausalLM``; both generate greedily from the same random
prompts (same batch, same lengths, no eos). Measured, after a warm-up that compiles:

* time to first token: wall time of a 1-token generation (prefill + first sample);
* decode tokens/s: ``batch · (N - 1) / (t_N - t_1)`` with ``t_N`` the wall time for ``N`` new tokens;
  each figure is the best of ``--repeats`` runs, jaxrl and HF interleaved so that both see the same
  background load;
* whether the greedy tokens agree;
* KV-cache bytes of the jaxrl run;
* compilations for a stream of mixed requests (2 prompts x 2 samples; random prompt lengths,
  completion lengths, temperatures, top-p, top-k) on the tiny model, against the number of
  distinct (prompt, completion) length buckets.

Prints a table and writes JSON. Needs torch (not a jaxrl dependency).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np

SHAPES = ("tiny", "qwen2p5_0p5b")


def _config(name: str):
  from jaxrl import models
  if name == "tiny":
    return models.ModelConfig.tiny()
  return getattr(models.ModelConfig, name)()


def _bench_shape(name: str, *, batch: int, prompt_len: int, new_tokens: int, repeats: int, seed: int) -> dict:
  import torch
  import transformers

  from jaxrl import models, sampling

  cfg = _config(name)
  model = models.init_model(cfg, seed=seed)
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, min(cfg.vocab_size, 1000), size=(batch, prompt_len)).astype(np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    models.save_pretrained(model, tmp)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
  hf.eval()
  ids = torch.from_numpy(prompts).long()
  sampler = sampling.Sampler(model, None, max_len=prompt_len + new_tokens, eos_token_ids=[])
  del model

  def jax_run(n):
    return sampler.generate(prompts, max_new_tokens=n, temperature=0.0, return_state=True)

  def hf_run(n):
    with torch.no_grad():
      return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, use_cache=True, eos_token_id=None, pad_token_id=0)

  t0 = time.perf_counter()
  jax_run(1)
  out = jax_run(new_tokens)
  compile_s = time.perf_counter() - t0
  hf_tokens = hf_run(new_tokens)[:, prompt_len:].numpy()
  times = {k: [] for k in ("jax_1", "jax_n", "hf_1", "hf_n")}
  for _ in range(repeats):  # interleaved, so both see the same background load
    for key, fn, n in (("jax_1", jax_run, 1), ("hf_1", hf_run, 1), ("jax_n", jax_run, new_tokens),
                       ("hf_n", hf_run, new_tokens)):
      t = time.perf_counter()
      fn(n)
      times[key].append(time.perf_counter() - t)
  best = {k: min(v) for k, v in times.items()}
  cache = out.state.rows.cache
  cache_bytes = int(sum(x.nbytes for x in (cache.k, cache.v, cache.segment_ids, cache.positions)))
  decode_tokens = batch * (new_tokens - 1)
  jax_tps = decode_tokens / max(best["jax_n"] - best["jax_1"], 1e-9)
  hf_tps = decode_tokens / max(best["hf_n"] - best["hf_1"], 1e-9)
  return dict(
      model=name, params=cfg.num_params(), batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
      jaxrl_ttft_s=best["jax_1"], hf_ttft_s=best["hf_1"], jaxrl_total_s=best["jax_n"], hf_total_s=best["hf_n"],
      jaxrl_decode_tok_s=jax_tps, hf_decode_tok_s=hf_tps, decode_speedup=jax_tps / hf_tps,
      ttft_speedup=best["hf_1"] / best["jax_1"], total_speedup=best["hf_n"] / best["jax_n"],
      jaxrl_compile_s=compile_s, greedy_token_agreement=float((out.tokens == hf_tokens).mean()),
      kv_cache_bytes=cache_bytes, kv_cache_shape=list(cache.k.shape), times_s=times)


def _bench_stream(num: int, seed: int) -> dict:
  from jaxrl import models, sampling

  cfg = models.ModelConfig.tiny(vocab_size=520)  # its own programs, not shared with the run above
  sampler = sampling.Sampler(models.init_model(cfg, seed=seed), None, max_len=256, eos_token_ids=[])
  rng = np.random.default_rng(seed)
  buckets = set()
  t = time.perf_counter()
  for _ in range(num):  # a fixed batch (2 prompts x 2 samples) of varied lengths and sampling settings
    lens = rng.integers(1, 65, size=2)
    new = int(rng.integers(1, 33))
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lens]
    sampler.generate(prompts, n=2, max_new_tokens=new, temperature=rng.uniform(0, 1.5, size=2).tolist(),
                     top_p=float(rng.uniform(0.1, 1.0)), top_k=int(rng.integers(0, 50)), seed=int(rng.integers(1000)))
    buckets.add((sampling.length_bucket(int(lens.max())), sampling.length_bucket(new)))
  elapsed = time.perf_counter() - t
  return dict(requests=num, distinct_length_buckets=len(buckets), compilations=dict(sampler.compile_counts),
              seconds=elapsed)


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; returns the exit status."""
  p = argparse.ArgumentParser(prog="jaxrl bench sample", description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {SHAPES}")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=32, help="new tokens for the tiny model")
  p.add_argument("--new-tokens-large", type=int, default=16, help="new tokens for the larger shapes")
  p.add_argument("--repeats", type=int, default=3, help="timed repeats (the best is kept)")
  p.add_argument("--stream", type=int, default=50, help="requests in the compile-count stream (0 = skip)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench_sample.json", help="JSON output path")
  args = p.parse_args(argv)

  import jax
  import torch

  shapes = [s for s in args.shapes.split(",") if s]
  unknown = set(shapes) - set(SHAPES)
  if unknown:
    p.error(f"unknown shapes {sorted(unknown)}; choose from {SHAPES}")
  threads = os.cpu_count() or 1
  torch.set_num_threads(threads)
  results = []
  for name in shapes:
    new = args.new_tokens if name == "tiny" else args.new_tokens_large
    results.append(_bench_shape(name, batch=args.batch, prompt_len=args.prompt_len, new_tokens=new,
                                repeats=args.repeats, seed=args.seed))
  stream = _bench_stream(args.stream, args.seed) if args.stream else None
  report = dict(
      date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
      processor=platform.processor(), cpus=threads, load_avg=list(os.getloadavg()),
      jax_backend=jax.default_backend(), jax=jax.__version__, torch=torch.__version__,
      torch_threads=torch.get_num_threads(), results=results, stream=stream)

  head = (f"{'model':<14}{'params':>11}{'B':>3}{'P':>5}{'N':>4} | {'ttft jaxrl':>11}{'ttft hf':>9} | "
          f"{'tok/s jaxrl':>12}{'tok/s hf':>10}{'x hf':>7} | {'agree':>6}{'KV MiB':>8}")
  print(head)
  print("-" * len(head))
  for r in results:
    print(f"{r['model']:<14}{r['params'] / 1e6:>10.1f}M{r['batch']:>3}{r['prompt_len']:>5}{r['new_tokens']:>4} | "
          f"{r['jaxrl_ttft_s'] * 1e3:>9.1f}ms{r['hf_ttft_s'] * 1e3:>7.1f}ms | {r['jaxrl_decode_tok_s']:>12.1f}"
          f"{r['hf_decode_tok_s']:>10.1f}{r['decode_speedup']:>7.2f} | {r['greedy_token_agreement']:>6.2f}"
          f"{r['kv_cache_bytes'] / 2**20:>8.2f}")
  if stream:
    print(f"stream of {stream['requests']} mixed requests: compilations {stream['compilations']} for "
          f"{stream['distinct_length_buckets']} (prompt, completion) length buckets, {stream['seconds']:.1f}s")
  print(f"load average {statistics.mean(report['load_avg']):.2f} over {threads} CPUs; JSON: {args.out}")
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  return 0
