"""``jaxrl bench lora``: a miniature of "LoRA Without Regret"'s learning-rate sweep (not a timed test).

A tiny decoder is first fully fine-tuned on an easy built-in arithmetic task (the "pretrained" base),
then fine-tuned on a harder one (2-3 terms up to 99) with full fine-tuning, all-layer LoRA at ranks
1, 4, 16, 64 and attention-only LoRA at rank 16, each over the same LR grid and the same batches.
Per setting it reports the best held-out loss and its LR, and the ratio of the best LoRA LR to the
best full-FT LR (the note: ~10x; ~15x for runs under ~100 steps; seeds file lines 448-478).

Every run uses ``jaxrl.train.make_optimizer`` (AdamW, clip 1, warmup 10 steps, linear decay to 0.1x)
with ``lr = 1`` and multiplies the update by the run's LR inside the jitted step (Adam's update is
linear in the LR, so this equals ``OptimConfig(lr=...)``); the LRs of one setting train side by side
under ``jax.vmap``, so one compilation serves the whole sweep. LoRA runs train only the adapters
(``jaxrl.models.lora_loss``); the frozen base is one shared, non-differentiated input.

Usage::

  jaxrl bench lora                                  # ~10 min on a (shared) 2-core CPU
  jaxrl bench lora --quick                          # smoke run (2 LRs, 20 steps)
  jaxrl bench lora --json docs/benchmarks_lora.json --plot docs/benchmarks_lora.png
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import models, train
from jaxrl.sft import SFTLoss, sft_loss_fn, sft_prepare

LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
RANKS = (1, 4, 16, 64)


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  lora: models.LoraConfig | None  # None: full fine-tuning


def _model_config() -> models.ModelConfig:
  return models.ModelConfig.tiny(vocab_size=128, hidden_size=64, intermediate_size=192, num_heads=4,
                                 num_kv_heads=2, head_dim=16, num_layers=2)


def _batches(paths, tokenizer, packing, n: int, *, seed: int, epochs) -> list[dict[str, np.ndarray]]:
  cfg = data_lib.DataConfig(paths=tuple(str(p) for p in paths), seed=seed, num_epochs=epochs,
                            shuffle=epochs is None)
  it = iter(data_lib.sft_batches(cfg, packing, tokenizer))
  out = []
  for _ in range(n):
    try:
      out.append(next(it).arrays)
    except StopIteration:
      break
  return out


def _step_fn(loss_fn, optimizer, n_extra: int):
  """``(params, opt_state, batch, lrs, *extra) -> (params, opt_state, loss)`` over a leading LR axis."""
  prepare = sft_prepare(SFTLoss())

  def one(params, opt_state, batch, lr, *extra):
    _, grads, metrics = train.accumulate_gradients(loss_fn, params, batch, *extra)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
    return params, opt_state, metrics["nll_sum"] / jnp.maximum(metrics["loss_tokens"], 1.0)

  many = jax.vmap(one, in_axes=(0, 0, None, 0) + (None,) * n_extra)
  return jax.jit(lambda params, opt_state, batch, lrs, *extra: many(params, opt_state, prepare(batch), lrs, *extra))


def _eval_fn(loss_fn, n_extra: int):
  """``(params, batch, *extra) -> (nll_sum, tokens)``, per LR."""
  prepare = sft_prepare(SFTLoss())

  def one(params, batch, *extra):
    _, metrics = loss_fn(params, batch, *extra)
    return metrics["nll_sum"], metrics["loss_tokens"]

  many = jax.vmap(one, in_axes=(0, None) + (None,) * n_extra)
  return jax.jit(lambda params, batch, *extra: many(params, prepare(batch), *extra))


def _heldout_loss(evaluate, params, batches, *extra) -> np.ndarray:  # [n_lr]
  nll = toks = 0.0
  for b in batches:
    n, t = evaluate(params, b, *extra)
    nll, toks = nll + np.asarray(n, np.float64), toks + np.asarray(t, np.float64)
  return nll / toks


def _stack(tree, n: int):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def pretrain(cfg, batches, *, lr: float):
  """The base: full fine-tuning of a random model on the easy task."""
  model = models.init_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  loss_fn = sft_loss_fn(graphdef, SFTLoss())
  optimizer = train.make_optimizer(train.OptimConfig(lr=1.0, schedule="linear", warmup_steps=10), len(batches))
  step = _step_fn(loss_fn, optimizer, 0)
  params = _stack(params, 1)
  opt_state = jax.vmap(optimizer.init)(params)
  loss = None
  for b in batches:
    params, opt_state, loss = step(params, opt_state, b, jnp.asarray([lr], jnp.float32))
  return graphdef, jax.tree.map(lambda x: x[0], params), float(loss[0])


def sweep(setting: Setting, graphdef, base_params, train_batches, eval_batches, lrs) -> dict:
  """Final train loss (mean of the last 10 steps) and held-out loss for each LR of one setting."""
  steps = len(train_batches)
  optimizer = train.make_optimizer(train.OptimConfig(lr=1.0, schedule="linear", warmup_steps=10), steps)
  if setting.lora is None:
    loss_fn = sft_loss_fn(graphdef, SFTLoss())
    params0, extra, trainable = base_params, (), sum(x.size for x in jax.tree.leaves(base_params))
  else:
    model = models.apply_lora(nnx.merge(graphdef, base_params), setting.lora, seed=0)
    lora_graphdef, params0, frozen = models.split_lora(model)
    loss_fn = models.lora_loss(sft_loss_fn(lora_graphdef, SFTLoss()))
    extra, trainable = (frozen,), sum(x.size for x in jax.tree.leaves(params0))
  step, evaluate = _step_fn(loss_fn, optimizer, len(extra)), _eval_fn(loss_fn, len(extra))
  t0 = time.perf_counter()
  params = _stack(params0, len(lrs))
  opt_state = jax.vmap(optimizer.init)(params)
  lr_vec = jnp.asarray(lrs, jnp.float32)
  losses = []
  for b in train_batches:
    params, opt_state, loss = step(params, opt_state, b, lr_vec, *extra)
    losses.append(loss)
  losses = np.asarray(jnp.stack(losses), np.float64)  # [steps, n_lr]
  heldout = _heldout_loss(evaluate, params, eval_batches, *extra)
  seconds = time.perf_counter() - t0
  rows = []
  for i, lr in enumerate(lrs):
    train_loss = float(np.mean(losses[-10:, i]))
    ok = math.isfinite(train_loss) and math.isfinite(heldout[i])
    rows.append({"lr": lr, "train_loss": train_loss if ok else math.inf,
                 "heldout_loss": float(heldout[i]) if ok else math.inf})
    print(f"  {setting.name:>14s} lr={lr:.0e}  train={train_loss:.4f}  heldout={heldout[i]:.4f}", flush=True)
  print(f"  ({seconds:.0f}s for {len(lrs)} LRs x {steps} steps, compile included)", flush=True)
  best = min(rows, key=lambda r: r["heldout_loss"])
  return {"setting": setting.name, "trainable_params": int(trainable), "runs": rows, "best_lr": best["lr"],
          "best_heldout_loss": best["heldout_loss"],
          "best_train_loss": min(r["train_loss"] for r in rows),
          "best_lr_at_grid_edge": best["lr"] in (min(lrs), max(lrs)), "seconds": seconds}


def _plot(results: list[dict], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for res in results:
    lrs = [r["lr"] for r in res["runs"]]
    loss = [r["heldout_loss"] if math.isfinite(r["heldout_loss"]) else np.nan for r in res["runs"]]
    style = "k-o" if res["setting"] == "full_ft" else "--s" if res["setting"].startswith("attn") else "-o"
    ax.plot(lrs, loss, style, label=res["setting"], markersize=4)
  ax.set_xscale("log")
  ax.set_xlabel("learning rate")
  ax.set_ylabel("held-out loss (nats/token)")
  ax.set_title(title)
  finite = [r["heldout_loss"] for res in results for r in res["runs"] if math.isfinite(r["heldout_loss"])]
  if finite:
    ax.set_ylim(min(finite) * 0.95, min(max(finite), 3 * min(finite)))
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def markdown_table(report: dict) -> str:
  full = next(r for r in report["results"] if r["setting"] == "full_ft")
  lines = ["| setting | trainable params | best LR | best held-out loss | best LR / full-FT best LR |",
           "| --- | ---: | ---: | ---: | ---: |"]
  for r in report["results"]:
    ratio = r["best_lr"] / full["best_lr"]
    edge = " (grid edge)" if r["best_lr_at_grid_edge"] else ""
    lines.append(f"| {r['setting']} | {r['trainable_params']:,} | {r['best_lr']:.0e}{edge} | "
                 f"{r['best_heldout_loss']:.4f} | {ratio:.3g} |")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench lora", description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=100, help="fine-tuning steps per run")
  p.add_argument("--pretrain-steps", type=int, default=200)
  p.add_argument("--pretrain-lr", type=float, default=3e-3)
  p.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
  p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
  p.add_argument("--attn-rank", type=int, default=16, help="rank of the attention-only LoRA run")
  p.add_argument("--rows", type=int, default=4, help="packed rows per batch")
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--quick", action="store_true", help="smoke run: 2 LRs, 20 steps, ranks 1 and 16")
  p.add_argument("--json", default="docs/benchmarks_lora.json")
  p.add_argument("--plot", default="docs/benchmarks_lora.png")
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.pretrain_steps, args.lrs, args.ranks = 20, 20, [1e-3, 1e-2], [1, 16]

  t_start = time.perf_counter()
  tokenizer = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  cfg = _model_config()
  packing = data_lib.PackingConfig(seq_len=args.seq_len, global_rows=args.rows)
  with tempfile.TemporaryDirectory() as tmp:
    easy = data_lib.write_arithmetic_splits(Path(tmp) / "easy", n_train=4000, n_heldout=16, seed=1,
                                            config=data_lib.ArithmeticConfig.level(1))
    hard = data_lib.write_arithmetic_splits(Path(tmp) / "hard", n_train=4000, n_heldout=256, seed=2,
                                            config=data_lib.ArithmeticConfig.level(3))
    pre_batches = _batches([easy["train"]], tokenizer, packing, args.pretrain_steps, seed=1, epochs=None)
    train_batches = _batches([hard["train"]], tokenizer, packing, args.steps, seed=2, epochs=None)
    eval_batches = _batches([hard["heldout"]], tokenizer, packing, args.eval_batches, seed=0, epochs=1)

  print(f"pretraining the base on the easy task ({args.pretrain_steps} steps)...", flush=True)
  graphdef, base, pre_loss = pretrain(cfg, pre_batches, lr=args.pretrain_lr)
  settings = [Setting("full_ft", None)]
  settings += [Setting(f"lora_r{r}", models.LoraConfig(rank=r)) for r in args.ranks]
  settings.append(Setting(f"attn_lora_r{args.attn_rank}", models.LoraConfig(rank=args.attn_rank, targets="attn")))
  base_eval = float(_heldout_loss(_eval_fn(sft_loss_fn(graphdef, SFTLoss()), 0), _stack(base, 1), eval_batches)[0])
  results = []
  for s in settings:
    print(f"{s.name}:", flush=True)
    results.append(sweep(s, graphdef, base, train_batches, eval_batches, args.lrs))
  full = results[0]
  report = {
      "benchmark": "lora", "date": datetime.date.today().isoformat(),
      "machine": f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} JAX device(s)",
      "jax": jax.__version__, "model": dataclasses.asdict(cfg), "steps": args.steps,
      "pretrain_steps": args.pretrain_steps, "pretrain_final_loss": pre_loss,
      "base_heldout_loss": base_eval, "rows": args.rows, "seq_len": args.seq_len, "lrs": args.lrs,
      "results": results,
      "best_lora_lr_over_full_ft_lr": {r["setting"]: r["best_lr"] / full["best_lr"] for r in results[1:]},
      "seconds": time.perf_counter() - t_start,
  }
  print()
  print(markdown_table(report))
  print(f"\nbase held-out loss before fine-tuning: {base_eval:.4f}; total {report['seconds']:.0f}s")
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
  if args.plot:
    _plot(results, Path(args.plot), f"held-out loss after {args.steps} steps vs LR (tiny decoder)")
    print(f"wrote {args.plot}")
  return 0
