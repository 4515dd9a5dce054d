"""``jaxrl bench judge``: judge calls per second through `jaxrl serve` at several client concurrencies.

A random tiny judge (the character tokenizer) is served on a free loopback port; a `Judge` scores
``--calls`` distinct RaR-style prompts (implicit rubric, one token, expected score over the digits'
log-probs) with ``max_concurrency = c`` client threads for each ``c`` in ``--concurrency``. Each
concurrency runs once untimed first (it compiles the row buckets it uses), then timed. Reported per
``c``: calls/s, mean rows per ``generate`` call (how much the server batched) and errors.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import platform
import time

from jaxrl import data, models, rewards, sampling, serve


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench judge", description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=64)
  p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
  p.add_argument("--batch-wait-ms", type=float, default=20.0)
  p.add_argument("--out", default="runs/bench_judge.json")
  args = p.parse_args(argv)

  cfg = models.ModelConfig.tiny(vocab_size=128, dtype="float32", param_dtype="float32")
  tok = models.load_tokenizer(data.tiny_tokenizer_dir())
  sampler = sampling.Sampler(models.init_model(cfg, seed=0), tok, max_len=512)
  app = serve.create_app(sampler, model_name="judge", max_batch_rows=64, batch_wait_s=args.batch_wait_ms / 1000,
                         max_top_logprobs=128)
  rows = []
  with serve.ServerThread(app, port=0) as srv:
    for c in args.concurrency:
      judge = rewards.Judge(rewards.JudgeConfig(base_url=srv.url, model="judge", max_concurrency=c,
                                                score_top_logprobs=128, max_retries=0, timeout_s=600))

      def one(i, tag):
        return rewards.rubric_reward(f"{i}+{i}=?", f"Answer: {2 * i} ({tag})", rubric=["is correct", "is brief"],
                                     judge=judge, mode="logprobs", max_tokens=1).value

      for tag in ("warm", "timed"):
        before = len(app.state.batcher.batch_sizes)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(c) as pool:
          futs = [pool.submit(one, i, f"{tag}{c}") for i in range(args.calls)]
          errors = sum(f.exception() is not None for f in futs)
        dt = time.perf_counter() - t0
      sizes = app.state.batcher.batch_sizes[before:]
      rows.append({"concurrency": c, "calls": args.calls, "seconds": dt, "calls_per_s": args.calls / dt,
                   "mean_batch_rows": sum(sizes) / len(sizes), "errors": errors})
  print(f"{'concurrency':>11} {'calls':>6} {'s':>7} {'calls/s':>8} {'rows/batch':>10} {'errors':>6}")
  for r in rows:
    print(f"{r['concurrency']:>11} {r['calls']:>6} {r['seconds']:>7.2f} {r['calls_per_s']:>8.2f} "
          f"{r['mean_batch_rows']:>10.2f} {r['errors']:>6}")
  out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "load_avg": os.getloadavg(), "rows": rows}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  return 0
