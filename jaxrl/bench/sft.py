"""``jaxrl bench sft``: packed vs padded throughput, jaxrl vs HF+PyTorch train step, log-prob memory.

(a) real (non-pad) tokens/s of the jitted SFT step on a long-tailed length distribution, rows
    packed best-fit vs one sample per padded row; (b) tokens/s of one AdamW training step, jaxrl vs
    transformers + PyTorch, same random weights (saved by jaxrl, loaded by torch), same batch, CPU,
    float32; (c) compiled peak temporary memory of chunked vs naive log-probs (XLA's memory analysis).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from jaxrl import data as data_lib
from jaxrl import losses, models, sharding, sft, train


def _tiny_cfg():
  return models.ModelConfig.tiny(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
                                 num_heads=4, num_kv_heads=2)


def _long_tail_samples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.lognormal(mean=np.log(seq_len / 8), sigma=0.9, size=n), 8, seq_len).astype(int)
  out = []
  for i, length in enumerate(lengths):
    tokens = rng.integers(1, vocab, size=length).astype(np.int32)
    mask = np.ones(length, np.float32)
    mask[: length // 4] = 0.0  # a prompt part without loss
    out.append({"tokens": tokens, "loss_mask": mask, "turn_id": (mask > 0).astype(np.int32),
                "sample_id": np.full(length, i + 1, np.int32)})
  return out


def _step_for(cfg, rows: int, mesh):
  model = models.init_model(cfg, mesh=mesh, seed=0)
  graphdef, params = nnx.split(model)
  loss_cfg = sft.SFTLoss(mode="global_token_mean", chunk_size=256)
  opt = train.make_optimizer(train.OptimConfig(lr=1e-4, schedule="constant"), 100)
  state = train.place_on_mesh(train.init_train_state(params, opt), mesh)
  step = train.make_train_step(sft.sft_loss_fn(graphdef, loss_cfg), opt, mesh=mesh,
                               prepare=sft.sft_prepare(loss_cfg))
  return state, step


def bench_packing(seq_len: int, rows: int, batches: int, console: Console) -> list[dict]:
  cfg = _tiny_cfg()
  mesh = sharding.make_mesh({"data": -1})
  bs = sharding.batch_sharding(mesh)
  samples = _long_tail_samples(rows * batches * 12, seq_len, cfg.vocab_size, seed=0)
  results = []
  for method in ("best_fit", "none"):
    packed = data_lib.pack_samples(samples, seq_len, method=method)
    n_rows = packed["tokens"].shape[0] // rows * rows
    state, step = _step_for(cfg, rows, mesh)
    put = lambda i: {k: jax.device_put(v[i * rows:(i + 1) * rows], bs) for k, v in packed.items()
                     if k in data_lib.ROW_KEYS}
    state, m = step(state, put(0))  # compile
    jax.block_until_ready(m)
    real = 0
    t0 = time.perf_counter()
    for i in range(1, min(batches, n_rows // rows)):
      b = put(i)
      state, m = step(state, b)
      real += int(np.sum(packed["segment_ids"][i * rows:(i + 1) * rows] > 0))
    jax.block_until_ready(m)
    dt = time.perf_counter() - t0
    eff = float(np.mean(packed["segment_ids"][:n_rows] > 0))
    results.append({"layout": method, "rows_needed": int(packed["tokens"].shape[0]), "efficiency": eff,
                    "real_tokens_per_s": real / dt})
    console.print(f"packing {method}: {real / dt:,.0f} real tok/s, efficiency {eff:.3f}")
  return results


def bench_vs_torch(cfg, name: str, batch: int, seq_len: int, steps: int, console: Console) -> dict:
  import torch
  import transformers
  torch.manual_seed(0)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  state, step = _step_for(cfg, batch, mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, size=(batch, seq_len)).astype(np.int32)
  arrays = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "positions": np.tile(np.arange(seq_len), (batch, 1)),
            "segment_ids": np.ones_like(tokens), "loss_mask": np.ones(tokens.shape, np.float32),
            "sample_ids": np.repeat(np.arange(1, batch + 1)[:, None], seq_len, 1).astype(np.int32),
            "turn_ids": np.repeat(np.arange(1, batch + 1)[:, None], seq_len, 1).astype(np.int32)}
  arrays["loss_mask"][:, -1] = 0
  arrays = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32) for k, v in arrays.items()}
  state, m = step(state, arrays)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = step(state, arrays)
  jax.block_until_ready(m)
  jax_tps = batch * seq_len * steps / (time.perf_counter() - t0)
  del state, step, m  # free the jaxrl model and optimizer before PyTorch builds its own

  with tempfile.TemporaryDirectory() as d:
    models.save_pretrained(nnx.merge(*nnx.split(models.init_model(cfg, seed=0))), d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
  hf.train()
  opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
  ids = torch.as_tensor(tokens, dtype=torch.long)

  def torch_step():
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

  torch_step()
  t0 = time.perf_counter()
  for _ in range(steps):
    torch_step()
  torch_tps = batch * seq_len * steps / (time.perf_counter() - t0)
  row = {"model": name, "params_M": cfg.num_params() / 1e6, "batch": batch, "seq_len": seq_len,
         "jaxrl_tok_s": jax_tps, "torch_tok_s": torch_tps, "ratio": jax_tps / torch_tps,
         "torch_threads": torch.get_num_threads()}
  console.print(f"train step {name}: jaxrl {jax_tps:,.0f} tok/s vs torch {torch_tps:,.0f} tok/s")
  return row


def bench_logprob_memory(tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
  h = jax.ShapeDtypeStruct((1, tokens, hidden), jnp.float32)
  w = jax.ShapeDtypeStruct((hidden, vocab), jnp.float32)
  t = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

  def chunked(h, w, t):
    return jnp.sum(losses.token_logprobs(h, w, t, chunk_size=chunk))

  def naive(h, w, t):
    logits = jnp.einsum("btd,dv->btv", h, w)
    return jnp.sum(losses.logprobs_from_logits(logits, t))

  def peak(fn):
    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(h, w, t).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  c, n = peak(chunked), peak(naive)
  return {"tokens": tokens, "vocab": vocab, "hidden": hidden, "chunk": chunk, "chunked_GiB": c / 2**30,
          "naive_GiB": n / 2**30, "ratio": c / n}


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench sft", description=__doc__)
  p.add_argument("--quick", action="store_true", help="small sizes, no 0.5B model (about a minute)")
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
  p.add_argument("--json", default="runs/bench_sft.json")
  ns = p.parse_args(argv)
  console = Console()
  seq_len, rows, batches = (256, 8, 4) if ns.quick else (1024, 8, 8)
  results = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {jax.device_count()} "
             f"{jax.devices()[0].device_kind} devices, jax {jax.__version__}"}
  results["packing"] = bench_packing(seq_len, rows, batches, console)
  if not ns.no_torch:
    results["vs_torch"] = [bench_vs_torch(_tiny_cfg(), "tiny", 8, 256, 3 if ns.quick else 5, console)]
    if not ns.quick:
      cfg = dataclasses.replace(models.ModelConfig.qwen2p5_0p5b(), dtype="float32", param_dtype="float32")
      results["vs_torch"].append(bench_vs_torch(cfg, "qwen2.5-0.5B-shaped", 1, 256, 2, console))
  results["logprob_memory"] = bench_logprob_memory(2048 if ns.quick else 16384, 151936, 896, 1024)

  table = Table(title="jaxrl bench sft")
  for col in ("what", "jaxrl", "peer / baseline", "ratio"):
    table.add_column(col)
  pk = {r["layout"]: r for r in results["packing"]}
  table.add_row(f"real tok/s, long-tail lengths, T={seq_len} (packed vs padded)",
                f"{pk['best_fit']['real_tokens_per_s']:,.0f}", f"{pk['none']['real_tokens_per_s']:,.0f}",
                f"{pk['best_fit']['real_tokens_per_s'] / pk['none']['real_tokens_per_s']:.2f}x")
  for r in results.get("vs_torch", []):
    table.add_row(f"train step tok/s {r['model']} (vs HF+PyTorch)", f"{r['jaxrl_tok_s']:,.0f}",
                  f"{r['torch_tok_s']:,.0f}", f"{r['ratio']:.2f}x")
  mem = results["logprob_memory"]
  table.add_row(f"log-prob fwd+bwd temp GiB, {mem['tokens']} tok × V={mem['vocab']} (chunked vs naive)",
                f"{mem['chunked_GiB']:.3f}", f"{mem['naive_GiB']:.3f}", f"{mem['ratio']:.3f}")
  console.print(table)
  Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
  Path(ns.json).write_text(json.dumps(results, indent=2))
  console.print(f"wrote {ns.json}")
  return 0
