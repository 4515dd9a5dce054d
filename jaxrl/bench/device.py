"""``jaxrl bench device``: every number the first accelerator run must return, in one short run (issue 34).

On one NVIDIA GPU (H100/H200) or one TPU host, in under 8 minutes, five sections, each guarded so that one
failure records its error and the others still run:

  attention      Pallas attention forward+backward (packed segments, causal, GQA) against the float32 XLA
                 reference (max abs error of the output and of dq/dk/dv) and its effective TFLOP/s against
                 cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) on GPU or JAX's splash
                 kernel on TPU.
  paged_decode   paged decode attention against its reference, and rows per second of one layer's call.
  engine_decode  the rollout engine's (:func:`jaxrl.rl.build_engine`) decode tokens/s for a random
                 Qwen2.5-1.5B-shaped model in bf16 at 64 and 256 slots.
  train_step     the RL learner step's (:func:`jaxrl.rl.make_learner_step`, as ``jaxrl plan`` builds it)
                 tokens/s and MFU at 8K tokens per device.
  plan           ``jaxrl plan``'s predicted peak bytes and ``est. s`` for those programs, compiled for this
                 device, against the measured peak (``memory_stats()["peak_bytes_in_use"]``) and time.

``--dry-run`` runs the same code on CPU with tiny shapes in seconds (CI runs it: tests/bench/test_device.py);
there the timed attention is the reference and the Pallas kernels run in interpret mode for the error checks.

MFU = model FLOPs / seconds / peak FLOP/s, with model FLOPs = ``ModelConfig.flops_per_token(row_len,
training=True)`` (3× the forward) × tokens and the device's dense bf16 peak from :data:`jaxrl.targets.TARGETS`.
Timings: one warm-up call (the compile), then the median of a few calls, each ended by ``block_until_ready``.
Peaks: ``memory_stats()`` has no reset, so a phase's measured peak is the process's high-water mark after it;
``peak_exact`` says whether the phase raised it (the phases run from the smallest expected peak up).

Usage::

  bash scripts/device_check.sh                  # jaxrl bench device --out device_check
  jaxrl bench device --dry-run --out /tmp/dc    # CPU, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import kernels, models, plan, rl, sampling, train
from jaxrl.bench import attention as attention_bench
from jaxrl.targets import TARGETS, Target

SECTIONS = ("attention", "paged_decode", "engine_decode", "train_step", "plan")
PEAK_SOURCES = (("h200", "h200x8"), ("h100", "h100x8"), ("v6", "v6e-8"), ("v5 lite", "v5e-8"), ("v5e", "v5e-8"),
                ("v5", "v5p-8"))
"""``device_kind`` substring (lower case) → the :data:`TARGETS` entry whose per-device peak and bandwidth it has."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
  """What each section runs: the device run's shapes, or :meth:`dry` (CPU, seconds)."""

  preset: str = "qwen2p5_1p5b"
  model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  attn: tuple[int, int, int, int, int] = (1, 8192, 12, 2, 128)
  "Attention ``(B, T, N, K, H)``: one packed 8K row at the 1.5B model's heads."
  attn_dtype: str = "bfloat16"
  attn_layout: str = "mixed"
  "Documents in the packed row (:data:`jaxrl.bench.attention.LAYOUTS`)."
  paged: tuple[int, int, int, int, int, int] = (256, 12, 2, 128, 16, 2048)
  "Paged decode ``(rows, N, K, H, block_size, max context)``."
  slots: tuple[int, ...] = (64, 256)
  prompt_tokens: int = 128
  new_tokens: int = 256
  "Tokens each engine row decodes (the engine's ``max_len`` is the train row's length)."
  row_len: int = 2048
  token_budget: int = 8192
  "Train tokens per micro-batch (one device): ``token_budget // row_len`` packed rows."
  remat: str = "none"
  repeats: int = 3
  interpret: bool = False
  "Pallas kernels in interpret mode (CPU) for the error checks; the timed attention is then the reference."

  @classmethod
  def dry(cls) -> Shapes:
    """Tiny shapes for the CPU dry run (same code path, seconds)."""
    return cls(preset="tiny", model_overrides=dict(vocab_size=256, dtype="float32"),
               attn=(1, 256, 4, 2, 32), attn_dtype="float32", attn_layout="docs128",
               paged=(4, 4, 2, 32, 16, 128), slots=(4, 8),
               prompt_tokens=8, new_tokens=8, row_len=64, token_budget=256, repeats=1, interpret=True)


# ------------------------------------------------------------------------------------------------
# Device numbers, timing, MFU.


def device_target(device=None) -> tuple[Target, str]:
  """A one-device :class:`Target` for ``device``: its HBM (``memory_stats``, else the table's) and the dense bf16
  peak FLOP/s and HBM bandwidth of the :data:`TARGETS` entry its ``device_kind`` names; and that entry's name
  (``cpu``: nominal numbers)."""
  device = device or jax.devices()[0]
  kind = str(getattr(device, "device_kind", device.platform)).lower()
  source = next((name for key, name in PEAK_SOURCES if key in kind), "cpu")
  ref = TARGETS[source]
  limit = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
  return Target(name=f"local:{kind}", platform=device.platform, devices=1, hbm_bytes=int(limit or ref.hbm_bytes),
                peak_flops=ref.peak_flops, hbm_bandwidth=ref.hbm_bandwidth, topology={}), source


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: ``model_flops / seconds / peak_flops`` (a fraction of the device's peak)."""
  return model_flops / seconds / peak_flops


def train_flops(model_cfg: models.ModelConfig, row_len: int, tokens: int) -> float:
  """Model FLOPs of one train step over ``tokens`` tokens packed in rows of ``row_len``: forward and backward
  (``flops_per_token(training=True)``, three times the forward)."""
  return model_cfg.flops_per_token(row_len, training=True) * tokens


def median_seconds(call: Callable[[], Any], repeats: int) -> float:
  """Median wall seconds of ``call()`` (its result blocked on) over ``repeats`` runs, after one warm-up."""
  jax.block_until_ready(call())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def memory() -> dict[str, int | None]:
  """The first device's ``bytes_in_use`` and ``peak_bytes_in_use`` (None where the backend reports none)."""
  stats = jax.devices()[0].memory_stats() or {}
  return {"bytes_in_use": stats.get("bytes_in_use"), "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _peak_since(before: dict[str, int | None]) -> dict[str, Any]:
  after = memory()
  peak, old = after["peak_bytes_in_use"], before["peak_bytes_in_use"]
  return {"measured_peak_bytes": peak, "peak_exact": None if peak is None else peak > (old or 0),
          "bytes_in_use_before": before["bytes_in_use"]}


def _max_abs(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))


# ------------------------------------------------------------------------------------------------
# a. Attention.


def _attention_case(shapes: Shapes) -> dict[str, Any]:
  b, t, n, k, h = shapes.attn
  dtype = jnp.dtype(shapes.attn_dtype)
  (q, kk, v, do, seg, pos), lengths = attention_bench.make_inputs(0, b, t, n, k, h, dtype, shapes.attn_layout)
  kernel = "pallas_triton" if shapes.interpret else kernels.resolve_impl("auto")

  def grads(impl, interpret, q, kk, v):
    fn = lambda q, kk, v: kernels.attention(q, kk, v, segment_ids=seg, positions=pos, impl=impl,  # noqa: E731
                                            interpret=interpret)
    out, vjp = jax.vjp(fn, q, kk, v)
    return out, vjp(do.astype(out.dtype))

  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  with jax.default_matmul_precision("highest"):
    want, want_g = jax.jit(lambda *a: grads("reference", False, *a))(f32(q), f32(kk), f32(v))
  got, got_g = jax.jit(lambda *a: grads(kernel, shapes.interpret, *a))(q, kk, v)
  out = {"impl": kernel, "interpret": shapes.interpret, "shape_btnkh": [b, t, n, k, h], "dtype": dtype.name,
         "documents": len(lengths), "fwd_max_abs_err": _max_abs(got, want),
         "grad_max_abs_err": {name: _max_abs(g, w) for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g)},
         "out_scale": float(jnp.max(jnp.abs(want)))}
  timed = "reference" if shapes.interpret else "auto"
  impls = {"jaxrl": attention_bench.implementations(jax.default_backend(), quick=False)["jaxrl"]
           if timed == "auto" else attention_bench.implementations("cpu", quick=True)["jaxrl_reference"]}
  peer = {"gpu": "cudnn", "tpu": "jax_splash"}.get(jax.default_backend())
  if peer is not None:
    impls[peer] = attention_bench.implementations(jax.default_backend(), quick=False)[peer]
  timing = dict(min_time=0.01, repeats=1) if shapes.interpret else dict(min_time=0.2, repeats=shapes.repeats)
  rows = []
  for name, fn in impls.items():
    for mode in ("fwd", "fwd+bwd"):
      r = attention_bench.bench_one(name, fn, (q, kk, v, do, seg, pos), lengths, mode=mode, layout=shapes.attn_layout,
                                    heads=n, kv_heads=k, head_dim=h, dtype=dtype, **timing)
      rows.append({"impl": name if name != "jaxrl" else f"jaxrl:{kernels.resolve_impl(timed)}", "mode": mode,
                   "ms": r.ms, "tflops": r.tflops, "note": r.note})
  out["timings"] = rows
  return out


# ------------------------------------------------------------------------------------------------
# b. Paged decode attention.


def _paged_case(shapes: Shapes) -> dict[str, Any]:
  rows, n, k, h, bs, max_ctx = shapes.paged
  dtype = jnp.dtype(shapes.attn_dtype)
  rng = np.random.default_rng(1)
  max_blocks = -(-max_ctx // bs)
  pool = rows * max_blocks
  tables = rng.permutation(pool).reshape(rows, max_blocks).astype(np.int32)  # every row its own blocks
  lengths = rng.integers(1, max_ctx + 1, size=rows).astype(np.int32)
  q = jnp.asarray(rng.normal(size=(rows, n, h)), dtype)
  kp = jnp.asarray(rng.normal(size=(pool, bs, k, h)), dtype)
  vp = jnp.asarray(rng.normal(size=(pool, bs, k, h)), dtype)
  args = (q, kp, vp, jnp.asarray(tables), jnp.asarray(lengths))
  kernel = "pallas_triton" if shapes.interpret else "auto"
  f32 = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
  with jax.default_matmul_precision("highest"):
    want = jax.jit(kernels.paged_decode_attention_reference)(*map(f32, args))
  got = jax.jit(lambda *a: kernels.paged_decode_attention(*a, impl=kernel, interpret=shapes.interpret))(*args)
  timed = "reference" if shapes.interpret else "auto"
  run = jax.jit(lambda *a: kernels.paged_decode_attention(*a, impl=timed))
  secs = median_seconds(lambda: run(*args), shapes.repeats)
  return {"impl": kernel, "timed_impl": timed, "rows": rows, "shape_nkh": [n, k, h], "block_size": bs,
          "mean_context": float(lengths.mean()), "dtype": dtype.name, "max_abs_err": _max_abs(got, want),
          "out_scale": float(jnp.max(jnp.abs(want))), "seconds_per_call": secs,
          "tokens_per_s_one_layer": rows / secs}


# ------------------------------------------------------------------------------------------------
# c-e. The 1.5B-shaped recipe: rollout engine, train step, plan.


def recipe(shapes: Shapes, num_slots: int) -> rl.RLConfig:
  """The RL recipe the engine, train step and plan share: one micro-batch of ``token_budget`` tokens, KL off,
  bf16 compute over float32 master weights, an engine of ``num_slots`` slots holding every row at full length."""
  rows = shapes.token_budget // shapes.row_len
  max_new = shapes.row_len - shapes.prompt_tokens
  blocks = num_slots * -(-shapes.row_len // 16)
  data = {
      "model": {"preset": shapes.preset, "overrides": {"dtype": "bfloat16", "param_dtype": "float32",
                                                       "remat": shapes.remat, **shapes.model_overrides}},
      "data": {"builtin": {"n_train": 8, "n_heldout": 8}, "max_prompt_tokens": shapes.prompt_tokens},
      "rollout": {"prompts_per_step": rows, "n": 1, "max_new_tokens": max_new,
                  "engine": {"num_slots": num_slots, "num_blocks": blocks, "block_size": 16}},
      "algorithm": {"mini_batches": 1, "kl_coef": 0.0},
      "micro_batch": {"token_budget": shapes.token_budget, "row_len": shapes.row_len, "bucket": "exact"},
      "steps": 10, "eval": {"every": 0}, "tensorboard": False,
  }
  return config_lib.from_dict(rl.RLConfig, data)


def context(cfg: rl.RLConfig, target: Target) -> plan.PlanContext:
  """``jaxrl plan``'s context for ``cfg`` on this process's first device, with the backend's attention kernel."""
  mc = dataclasses.replace(cfg.model.config(), attention_impl=kernels.resolve_impl("auto"))
  return plan.build_context(cfg, jax.devices()[:1], mc, hbm_bytes=target.hbm_bytes)


def _concrete_batch(abstract: dict[str, jax.ShapeDtypeStruct], *, vocab: int, micro: int, groups: int,
                    seed: int = 0) -> dict[str, jax.Array]:
  """Random arrays for the learner step's abstract batch: every row one full sequence (no padding)."""
  rng = np.random.default_rng(seed)
  out = {}
  for key, sds in abstract.items():
    shape = sds.shape
    if key in ("tokens", "targets"):
      x = rng.integers(0, vocab, size=shape)
    elif key == "positions":
      x = np.broadcast_to(np.arange(shape[-1]), shape)
    elif key in ("segment_ids", "loss_mask"):
      x = np.ones(shape)
    elif key == "advantages":
      x = rng.normal(size=shape)
    elif key.endswith("logprobs"):
      x = -rng.uniform(0.5, 3.0, size=shape)
    elif key == "group_ids":
      x = np.broadcast_to((np.arange(shape[0]) // micro % groups).reshape(-1, *[1] * (len(shape) - 1)), shape)
    elif key == "mb_index":
      x = np.broadcast_to((np.arange(shape[0]) % micro).reshape(-1, *[1] * (len(shape) - 1)), shape)
    else:
      x = np.zeros(shape)
    out[key] = jax.device_put(np.asarray(x, sds.dtype), sds.sharding)
  return out


def _engine_case(cfg: rl.RLConfig, ctx: plan.PlanContext, params, shapes: Shapes) -> dict[str, Any]:
  """Decode tokens/s of the engine over a compute-dtype copy of ``params`` (the trainer's ``sampling_model``)."""
  before = memory()
  eng_cfg = cfg.rollout.engine
  model = models.cast_params(nnx.merge(ctx.graphdef, params), ctx.model_cfg.dtype)
  engine = rl.build_engine(model, None, eng_cfg, max_len=rl.rollout_max_len(cfg, 1), mesh=ctx.mesh, rules=ctx.rules)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, ctx.model_cfg.vocab_size, size=shapes.prompt_tokens).tolist()
             for _ in range(eng_cfg.num_slots)]
  marks = []

  def generate():
    m = engine.metrics
    start = (m.generated_tokens, m.decode_seconds, m.decode_calls)
    out = engine.generate(prompts, max_new_tokens=shapes.new_tokens, temperature=1.0, seed=len(marks))
    marks.append((m.generated_tokens - start[0], m.decode_seconds - start[1], m.decode_calls - start[2]))
    return out.lengths

  wall = median_seconds(generate, shapes.repeats)
  tokens, decode_s, calls = (float(np.median([mk[i] for mk in marks[1:]])) for i in range(3))
  result = {"slots": eng_cfg.num_slots, "prompt_tokens": shapes.prompt_tokens, "new_tokens": shapes.new_tokens,
            "max_len": engine.max_len, "num_blocks": engine.num_blocks, "steps_per_call": eng_cfg.steps_per_call,
            "generated_tokens": tokens, "wall_s": wall, "tokens_per_s_wall": tokens / wall,
            "decode_tokens_per_s": tokens / decode_s, "seconds_per_decode_call": decode_s / max(calls, 1.0),
            **_peak_since(before)}
  del engine, model
  gc.collect()
  return result


def _train_case(ctx: plan.PlanContext, state, shapes: Shapes, target: Target) -> tuple[dict[str, Any], Any]:
  """Tokens/s and MFU of the learner step ``jaxrl plan`` compiles for the recipe; returns the updated state."""
  before = memory()
  prog = plan.PROGRAMS["train"](ctx)[0]
  abstract_batch = prog.args[1]
  flag = jax.device_put(np.asarray(False), prog.args[2].sharding)  # as the plan lowers it: one program
  rows = abstract_batch["tokens"].shape[0]
  num_micro = max(1, rows // (shapes.token_budget // shapes.row_len))  # rows are [R·M] interleaved
  batch = _concrete_batch(abstract_batch, vocab=ctx.model_cfg.vocab_size, micro=num_micro,
                          groups=ctx.cfg.rollout.prompts_per_step)
  holder = [state]

  def step():
    holder[0], metrics = prog.fn(holder[0], batch, flag)
    return metrics

  secs = median_seconds(step, shapes.repeats)
  tokens = rows * shapes.row_len
  flops = train_flops(ctx.model_cfg, shapes.row_len, tokens)
  loss = float(np.asarray(step()["loss"]))
  return ({"program": prog.name, "rows": rows, "row_len": shapes.row_len, "tokens": tokens, "remat": shapes.remat,
           "seconds": secs, "tokens_per_s": tokens / secs, "model_flops": flops, "plan_model_flops": prog.flops,
           "peak_flops": target.peak_flops, "mfu": mfu(flops, secs, target.peak_flops), "loss": loss,
           **_peak_since(before)}, holder[0])


def _plan_rows(ctx: plan.PlanContext, target: Target, *, train_step: bool) -> dict[str, plan.Row]:
  """``jaxrl plan``'s rows (compiled for this device) of the engine's decode and, with ``train_step``, the
  learner step."""
  progs = [*(plan.PROGRAMS["train"](ctx) if train_step else []),
           *(p for p in plan.PROGRAMS["engine"](ctx) if "decode" in p.name)]
  rows, _ = plan.measure_programs(progs, None, ctx.model_cfg.num_layers, None, target, devices=1)
  return {r.program: r for r in rows}


def _compare(row: plan.Row, measured: dict[str, Any] | None, seconds_key: str) -> dict[str, Any]:
  out = {"program": row.program, "status": row.status, "error": row.error, "predicted_peak_bytes": row.peak,
         "est_s": row.est_seconds, "note": row.note}
  if measured is not None and "error" not in measured:
    peak, secs = measured.get("measured_peak_bytes"), measured.get(seconds_key)
    out.update(measured_peak_bytes=peak, peak_exact=measured.get("peak_exact"), measured_s=secs,
               peak_ratio=row.peak / peak if peak else None, time_ratio=row.est_seconds / secs if secs else None)
  return out


# ------------------------------------------------------------------------------------------------
# The run.


def _guard(results: dict[str, Any], name: str, fn: Callable[[], Any], *, log=print) -> Any:
  """``results[name] = fn()``, or ``{"error": ...}`` (the exception, one line) if it raises; returns the result."""
  t0 = time.perf_counter()
  log(f"[device check] {name} ...")
  try:
    results[name] = fn()
  except Exception as e:  # noqa: BLE001  (a failed section is recorded and the next one runs)
    msg = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
    results[name] = {"error": f"{type(e).__name__}: {msg}", "traceback": traceback.format_exc()[-2000:]}
  if isinstance(results[name], dict):
    results[name]["section_seconds"] = time.perf_counter() - t0
  log(f"[device check] {name}: {'error: ' + results[name]['error'] if 'error' in results[name] else 'ok'} "
      f"({time.perf_counter() - t0:.1f} s)")
  return results[name]


def run(shapes: Shapes, *, log=print, checkpoint: Callable[[dict[str, Any]], None] | None = None,
        only: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
  """The sections ``only`` names (the others are recorded as skipped errors) on this process's first device;
  the JSON-ready result (``meta`` and ``sections``).

  ``checkpoint(result so far)`` runs after each section (``main`` writes the files then, so a run killed at
  its time limit keeps what it measured).
  """
  t0 = time.perf_counter()
  target, source = device_target()
  dev = jax.devices()[0]
  meta = {"device": f"{dev.platform}:{getattr(dev, 'device_kind', 'unknown')}", "backend": jax.default_backend(),
          "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "dry_run": shapes.interpret, "peak_flops": target.peak_flops, "hbm_bandwidth": target.hbm_bandwidth,
          "hbm_bytes": target.hbm_bytes, "peak_source": f"jaxrl.targets.TARGETS[{source!r}]",
          "shapes": dataclasses.asdict(shapes)}
  sec: dict[str, Any] = {}
  cfgs = {s: recipe(shapes, s) for s in shapes.slots}
  ctxs: dict[int, plan.PlanContext] = {}
  state: list = []

  def train_state():
    ctx = ctxs[shapes.slots[0]] = context(cfgs[shapes.slots[0]], target)
    params = nnx.split(models.init_model(ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules))[1]
    placed = jax.tree.map(lambda a: a.sharding, ctx.state)  # the step's own in/out shardings: no recompile
    state.append(jax.device_put(train.init_train_state(params, ctx.optimizer), placed))

  def engines():
    if not state:
      train_state()
    out = []
    for s in shapes.slots:
      ctxs.setdefault(s, context(cfgs[s], target))
      out.append(_guard({}, f"engine {s} slots",
                        lambda s=s: _engine_case(cfgs[s], ctxs[s], state[0].params, shapes), log=log))
    return {"runs": out}

  def train_step():
    if not state:
      train_state()
    result, state[0] = _train_case(ctxs[shapes.slots[0]], state[0], shapes, target)
    return result

  def plans():
    out = []
    for i, s in enumerate(shapes.slots):
      ctx = ctxs.get(s) or context(cfgs[s], target)
      runs = sec["engine_decode"].get("runs", [])
      measured_engine = runs[i] if i < len(runs) else None
      for name, row in _plan_rows(ctx, target, train_step=i == 0).items():
        if name.startswith("train_step"):
          out.append(_compare(row, sec.get("train_step"), "seconds"))
        else:
          out.append({"slots": s, **_compare(row, measured_engine, "seconds_per_decode_call")})
    return {"rows": out}

  result = {"meta": meta, "sections": sec}
  for name, fn in (("attention", lambda: _attention_case(shapes)), ("paged_decode", lambda: _paged_case(shapes)),
                   ("engine_decode", engines), ("train_step", train_step), ("plan", plans)):
    if name in only:
      _guard(sec, name, fn, log=log)
    else:
      sec[name] = {"error": "skipped: not in --only"}
    meta["seconds"] = time.perf_counter() - t0
    if checkpoint is not None:
      checkpoint(result)
  return result


# ------------------------------------------------------------------------------------------------
# Output.

MD_HEADER = ("| section | metric | value | against | note |", "| --- | --- | ---: | ---: | --- |")


def _num(x, fmt: str = ".4g") -> str:
  return "-" if x is None else format(x, fmt)


def _gib(x) -> str:
  return "-" if x is None else f"{x / 2**30:.2f} GiB"


def _attention_rows(a: dict[str, Any]) -> list[tuple]:
  g = a["grad_max_abs_err"]
  rows = [("attention", "fwd max abs err", _num(a["fwd_max_abs_err"], ".2e"), "XLA reference (f32)",
           f"{a['impl']}{' (interpret)' if a['interpret'] else ''}, {a['dtype']}, B,T,N,K,H = {a['shape_btnkh']}, "
           f"{a['documents']} packed documents; max abs out {a['out_scale']:.3g}"),
          ("attention", "dq/dk/dv max abs err", "/".join(_num(g[k], ".2e") for k in ("dq", "dk", "dv")),
           "XLA reference (f32)", "")]
  for mode in ("fwd", "fwd+bwd"):
    mine = [t for t in a["timings"] if t["mode"] == mode and t["impl"].startswith("jaxrl")]
    peers = [t for t in a["timings"] if t["mode"] == mode and not t["impl"].startswith("jaxrl")]
    peer = peers[0] if peers else None
    rows.append(("attention", f"{mode} TFLOP/s", _num(mine[0]["tflops"] if mine else None),
                 f"{_num(peer['tflops'])} ({peer['impl']})" if peer else "- (no peer on this backend)",
                 "; ".join(f"{t['impl']} {_num(t['ms'])} ms {t['note']}".strip() for t in mine + peers)))
  return rows


def markdown(result: dict[str, Any]) -> str:
  """The result as a Markdown table: a heading line, then one row per number (a failed section: its error)."""
  m, sec = result["meta"], result["sections"]
  lines = [f"device check: {m['device']}, jax {m['jax']}, {m['date']}"
           + (" (DRY RUN: CPU, tiny shapes)" if m["dry_run"] else "") + f", {m['seconds']:.0f} s", "", *MD_HEADER]

  def failed(name):
    if "error" in sec.get(name, {"error": "not run"}):
      lines.append(f"| {name} | error | - | - | {sec.get(name, {}).get('error', 'not run')} |")
      return True
    return False

  rows: list[tuple] = []
  if not failed("attention"):
    rows += _attention_rows(sec["attention"])
  if not failed("paged_decode"):
    p = sec["paged_decode"]
    rows += [("paged_decode", "max abs err", _num(p["max_abs_err"], ".2e"), "reference (f32)",
              f"{p['impl']}, {p['rows']} rows, mean context {p['mean_context']:.0f}, {p['dtype']}"),
             ("paged_decode", "tokens/s (one layer)", _num(p["tokens_per_s_one_layer"]), "-",
              f"{p['timed_impl']}: {_num(p['seconds_per_call'] * 1e6)} µs per call")]
  if not failed("engine_decode"):
    for r in sec["engine_decode"]["runs"]:
      if "error" in r:
        rows.append(("engine_decode", "decode tokens/s", "error", "-", r["error"]))
        continue
      rows.append(("engine_decode", f"decode tokens/s, {r['slots']} slots", _num(r["decode_tokens_per_s"]),
                   f"{_num(r['tokens_per_s_wall'])} (wall, with prefill)",
                   f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens per row"))
  if not failed("train_step"):
    t = sec["train_step"]
    rows += [("train_step", "tokens/s", _num(t["tokens_per_s"]), "-",
              f"{t['rows']} rows x {t['row_len']} tokens, remat {t['remat']}, {_num(t['seconds'])} s per step"),
             ("train_step", "MFU", f"{100 * t['mfu']:.1f}%", "-",
              f"{_num(t['model_flops'] / 1e12)} model TFLOP / step; peak {_num(t['peak_flops'] / 1e12)} TFLOP/s")]
  if not failed("plan"):
    for r in sec["plan"]["rows"]:
      name = r["program"] + (f", {r['slots']} slots" if "slots" in r else "")
      if r["status"] == "error":
        rows.append(("plan", f"peak: {name}", "error", "-", r["error"][:200]))
        continue
      exact = "(measured: an earlier phase's high-water mark)" if r.get("peak_exact") is False else ""
      rows += [("plan", f"peak: {name}", _gib(r["predicted_peak_bytes"]), _gib(r.get("measured_peak_bytes")),
                f"predicted / measured {_num(r.get('peak_ratio'), '.2f')} {exact}".strip()),
               ("plan", f"est. s: {name}", _num(r["est_s"]), _num(r.get("measured_s")),
                f"predicted / measured {_num(r.get('time_ratio'), '.2f')}")]
  lines += [f"| {' | '.join(str(c).replace('|', '¦') for c in row)} |" for row in rows]
  return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
  """``out/device_check.json`` and ``out/device_check.md``; returns their paths."""
  out.mkdir(parents=True, exist_ok=True)
  js, md = out / "device_check.json", out / "device_check.md"
  js.write_text(json.dumps(result, indent=1, default=_json_default))
  md.write_text(markdown(result))
  return js, md


def _json_default(x):
  return x.item() if isinstance(x, (np.integer, np.floating)) else str(x)


def main(argv: list[str]) -> int:
  """``jaxrl bench device [--dry-run] [--out DIR] [--remat POLICY] [--only SECTION ...]``; 0 when every section
  ran without error."""
  p = argparse.ArgumentParser(prog="jaxrl bench device", description=__doc__.splitlines()[0])
  p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds (what CI runs)")
  p.add_argument("--out", default="device_check", help="folder for device_check.json and device_check.md")
  p.add_argument("--remat", default=None, help="the train step's rematerialisation, a ModelConfig.remat value "
                 "(default none)")
  p.add_argument("--only", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                 help="run only these sections (plan compares with the engine and train sections run with it)")
  a = p.parse_args(argv)
  shapes = Shapes.dry() if a.dry_run else Shapes()
  if a.remat:
    shapes = dataclasses.replace(shapes, remat=a.remat)
  result = run(shapes, checkpoint=lambda partial: write(partial, Path(a.out)), only=tuple(a.only))
  js, md = write(result, Path(a.out))
  print(md.read_text())
  print(f"wrote {js} and {md}")
  return 1 if any("error" in v for v in result["sections"].values()) else 0
