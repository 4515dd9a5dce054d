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

With ``--long-tail N`` (default 64): N prompts whose completion lengths are log-normal (the longest
at least 8x the median; no eos, so every row ends exactly at its length), generated once by each of
the rollout engine (:class:`jaxrl.sampling.Engine`, per-row lengths, continuous batching), the
whole-batch sampler (every row runs to the longest length; only each row's own tokens count) and,
HF transformers (``generate_batch``'s continuous batching where it exists, each row with its own
length; else ``generate``, a whole batch like the sampler), run in the TRL peer virtualenv of
``jaxrl bench rl`` (``jaxrl bench rl --setup trl``) as a subprocess (``benchmarks/sample_hf.py``)
and reported skipped when that virtualenv does not exist. Reported: real (counted) tokens per
second of each, after a warm-up pass that compiles.

Prints a table and writes JSON. The HF columns need torch (not a jaxrl dependency).
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

from jaxrl import models, sampling
from jaxrl.bench import rl as bench_rl
from jaxrl.bench._harness import BENCHMARKS, harness

SHAPES = ("tiny", "qwen2p5_0p5b")


def _config(name: str):
  if name == "tiny":
    return models.ModelConfig.tiny()
  return getattr(models.ModelConfig, name)()


def _bench_shape(name: str, *, batch: int, prompt_len: int, new_tokens: int, repeats: int, seed: int) -> dict:
  import torch
  import transformers

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


def _bench_long_tail(num: int, *, n: int, median: int, slots: int, seed: int) -> dict:
  cfg = models.ModelConfig.tiny(vocab_size=512)
  model = models.init_model(cfg, seed=seed)
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, cfg.vocab_size, size=int(k)).tolist() for k in rng.integers(8, 33, size=num)]
  lengths = np.clip(np.round(rng.lognormal(np.log(median), 1.0, size=num)), 1, None).astype(int)
  lengths[int(np.argmax(lengths))] = max(int(lengths.max()), 8 * int(np.median(lengths)))
  longest = int(lengths.max())
  max_len = 33 + longest
  real = int(lengths.sum()) * n
  engine = sampling.Engine(model, None, num_slots=slots, max_len=max_len, block_size=16,
                           num_blocks=slots * (-(-max_len // 16) + 1), eos_token_ids=[])
  sampler = sampling.Sampler(model, None, max_len=max_len, eos_token_ids=[])
  paged = sampling.Sampler(model, None, max_len=max_len, eos_token_ids=[], paged=True)  # generate on an engine
  requests = [sampling.Request(prompt=p, n=n, max_new_tokens=int(k), temperature=1.0, request_id=i)
              for i, (p, k) in enumerate(zip(prompts, lengths))]

  def run_engine():
    engine.submit(requests)
    return sum(len(c.tokens) for c in engine.completions())

  def run_sampler(s=sampler):
    out = s.generate(prompts, n=n, max_new_tokens=longest, temperature=1.0)
    return int(np.minimum(out.lengths, np.repeat(lengths, n)).sum())

  timings = {}
  for name, fn in (("engine", run_engine), ("whole_batch", run_sampler),
                   ("whole_batch_paged", lambda: run_sampler(paged))):
    fn()  # warm-up: compiles
    t = time.perf_counter()
    got = fn()
    timings[name] = time.perf_counter() - t
    assert got == real, (name, got, real)
  hf = hf_long_tail(model, prompts, lengths, n, slots=slots)
  res = dict(prompts=num, n=n, median=int(np.median(lengths)), longest=longest, real_tokens=real, slots=slots,
             engine_s=timings["engine"], whole_batch_s=timings["whole_batch"],
             engine_tok_s=real / timings["engine"], whole_batch_tok_s=real / timings["whole_batch"],
             whole_batch_paged_tok_s=real / timings["whole_batch_paged"],
             engine_stats=engine.stats(), hf=hf)
  res["engine_over_whole_batch"] = res["engine_tok_s"] / res["whole_batch_tok_s"]
  return res


def _has_torch() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def hf_long_tail(model, prompts, lengths, n, *, slots: int = 16, timeout: float = 3600) -> dict:
  """HF transformers on the long tail, in the TRL peer virtualenv (torch CPU + transformers; see
  ``jaxrl bench rl --setup trl``) as a subprocess (``benchmarks/sample_hf.py``): the same weights
  (written to a temporary HF directory), prompts and per-row lengths, temperature 1. Returns its
  JSON answer, or ``{"skipped": reason}`` when that virtualenv does not exist."""
  import subprocess
  from pathlib import Path

  py = bench_rl.peer_python("trl")
  if not py.exists():
    return {"skipped": f"no TRL virtualenv at {py.parent.parent} (create it with `jaxrl bench rl --setup trl`)"}
  with tempfile.TemporaryDirectory() as tmp:
    models.save_pretrained(model, Path(tmp) / "model")
    spec = Path(tmp) / "spec.json"
    spec.write_text(json.dumps({"hf_dir": str(Path(tmp) / "model"), "prompts": [list(map(int, p)) for p in prompts],
                                "lengths": [int(k) for k in lengths], "n": int(n), "slots": int(slots),
                                "threads": os.cpu_count() or 1}))
    proc = subprocess.run([str(py), str(harness(BENCHMARKS / "sample_hf.py")), str(spec)], capture_output=True,
                          text=True, timeout=timeout)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"bench sample: the HF worker ({py}) failed with status {proc.returncode}: {tail[0]}")
  return json.loads(lines[-1])


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
  p.add_argument("--long-tail", type=int, default=64, help="prompts in the long-tail run (0 = skip)")
  p.add_argument("--long-tail-n", type=int, default=2, help="samples per prompt in the long-tail run")
  p.add_argument("--long-tail-median", type=int, default=16, help="median completion length of the long-tail run")
  p.add_argument("--slots", type=int, default=16, help="engine decode slots in the long-tail run")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench_sample.json", help="JSON output path")
  args = p.parse_args(argv)

  import jax

  shapes = [s for s in args.shapes.split(",") if s]
  unknown = set(shapes) - set(SHAPES)
  if unknown:
    p.error(f"unknown shapes {sorted(unknown)}; choose from {SHAPES}")
  threads = os.cpu_count() or 1
  if shapes or _has_torch():
    import torch
    torch.set_num_threads(threads)
  results = []
  for name in shapes:
    new = args.new_tokens if name == "tiny" else args.new_tokens_large
    results.append(_bench_shape(name, batch=args.batch, prompt_len=args.prompt_len, new_tokens=new,
                                repeats=args.repeats, seed=args.seed))
  stream = _bench_stream(args.stream, args.seed) if args.stream else None
  tail = (_bench_long_tail(args.long_tail, n=args.long_tail_n, median=args.long_tail_median, slots=args.slots,
                           seed=args.seed) if args.long_tail else None)
  report = dict(
      date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
      processor=platform.processor(), cpus=threads, load_avg=list(os.getloadavg()),
      jax_backend=jax.default_backend(), jax=jax.__version__,
      torch=__import__("torch").__version__ if _has_torch() else None, results=results, stream=stream,
      long_tail=tail)

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
  if tail:
    hf = tail["hf"]
    print(f"long tail: {tail['prompts']}x{tail['n']} rows, completion median {tail['median']}, longest "
          f"{tail['longest']}, {tail['real_tokens']} real tokens | engine ({tail['slots']} slots) "
          f"{tail['engine_tok_s']:.1f} tok/s | whole batch {tail['whole_batch_tok_s']:.1f} tok/s | engine/whole "
          f"{tail['engine_over_whole_batch']:.2f}x | Sampler(paged=True) {tail['whole_batch_paged_tok_s']:.1f} "
          "tok/s | HF "
          + (f"skipped: {hf['skipped']}" if "skipped" in hf else
             f"{hf['method']} {hf['tok_s']:.1f} tok/s (engine/HF {tail['engine_tok_s'] / hf['tok_s']:.2f}x)"))
  print(f"load average {statistics.mean(report['load_avg']):.2f} over {threads} CPUs; JSON: {args.out}")
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  return 0
