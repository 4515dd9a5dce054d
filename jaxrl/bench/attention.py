"""``jaxrl bench attention``: packed-sequence attention kernels against their peers.

Effective TFLOP/s count only the unmasked (visible) query-key pairs, so a packed row of short
documents is not credited with the work a dense kernel wastes on cross-document tiles:

    pairs  = Σ_rows Σ_documents L·(L+1)/2        (causal)
    fwd    = 4 · pairs · N · H                    (q·kᵀ and p·v)
    bwd    = 10 · pairs · N · H                   (recomputed q·kᵀ, dp, dq, dk, dv)

Layouts of a ``[B, T]`` row: ``causal`` (one document), ``docs128`` (T/128 documents of 128),
``docs1k`` (T/1024 documents of 1024) and ``mixed`` (a seeded long-tailed mix of lengths).

Usage::

  jaxrl bench attention                      # full sweep T = 2k…32k on the current device
  jaxrl bench attention --quick              # CPU smoke run (reference only, < 1 minute)
  jaxrl bench attention --device-check       # H200 acceptance: correctness, then targets
  jaxrl bench attention --json out.json --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import kernels

LAYOUTS = ("causal", "docs128", "docs1k", "mixed")
MODES = ("fwd", "fwd+bwd")


# ------------------------------------------------------------------------------------------------
# Layouts and FLOPs.


def document_lengths(layout: str, t: int, seed: int = 0) -> list[int]:
  """Document lengths filling one row of ``t`` tokens."""
  if layout == "causal":
    return [t]
  if layout == "docs128":
    return [128] * (t // 128) + ([t % 128] if t % 128 else [])
  if layout == "docs1k":
    return [1024] * (t // 1024) + ([t % 1024] if t % 1024 else [])
  if layout == "mixed":
    rng = np.random.default_rng(seed)
    out, left = [], t
    while left > 0:
      n = int(min(left, max(16, rng.lognormal(mean=6.0, sigma=1.2))))
      out.append(n)
      left -= n
    return out
  raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def row_ids(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids (1, 2, …) and positions restarting per document."""
  seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])
  pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
  return seg, pos


def visible_pairs(lengths: list[int], *, causal: bool = True) -> int:
  return int(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))


def flops(pairs: int, heads: int, head_dim: int, mode: str) -> float:
  per_pair = {"fwd": 4, "bwd": 10, "fwd+bwd": 14}[mode]
  return float(per_pair) * pairs * heads * head_dim


# ------------------------------------------------------------------------------------------------
# Implementations under test: fn(q, k, v, seg, pos) -> out.


def _ours(impl):
  def fn(q, k, v, seg, pos, causal_only):
    del causal_only
    return kernels.attention(q, k, v, segment_ids=seg, positions=pos, impl=impl)
  return fn


def _cudnn(q, k, v, seg, pos, causal_only):
  if causal_only:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  mask = kernels.make_mask(seg, seg, pos, pos, causal=True, window=None)[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def _repeat_kv(q, k, v):
  g = q.shape[2] // k.shape[2]
  return jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)


def _jax_pallas_gpu(q, k, v, seg, pos, causal_only):
  """JAX's shipped Pallas GPU kernel (no GQA: K/V repeated; causal by index == by position)."""
  del pos
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  k, v = _repeat_kv(q, k, v)
  return gpu_attention.mha(q, k, v, None if causal_only else seg, causal=True,
                           sm_scale=q.shape[-1] ** -0.5)


def _jax_splash(q, k, v, seg, pos, causal_only):
  """JAX's shipped splash attention (TPU), causal mask + segment ids, K/V repeated."""
  del pos
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  k, v = _repeat_kv(q, k, v)
  _, t, n, h = q.shape
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(n)])
  kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
  tr = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, N, T, H]
  q = tr(q) * h**-0.5

  def one(q, k, v, s):
    return kernel(q, k, v, segment_ids=None if causal_only else sk.SegmentIds(s, s))

  return tr(jax.vmap(one)(q, tr(k), tr(v), seg))


def _tokamax(q, k, v, seg, pos, causal_only):
  import tokamax  # optional peer; absent → the row reports the ImportError
  if causal_only:
    return tokamax.dot_product_attention(q, k, v, is_causal=True)
  mask = kernels.make_mask(seg, seg, pos, pos, causal=True, window=None)[:, None]
  return tokamax.dot_product_attention(q, k, v, mask=mask)


def implementations(backend: str, *, quick: bool) -> dict[str, Callable]:
  if quick:
    return {"jaxrl_reference": _ours("reference")}
  impls = {"jaxrl": _ours("auto")}
  if backend == "gpu":
    impls.update(cudnn=_cudnn, jax_pallas_gpu=_jax_pallas_gpu)
  if backend == "tpu":
    impls.update(jax_splash=_jax_splash)
  impls.update(xla_reference=_ours("reference"), tokamax=_tokamax)
  return impls


# Dense [T, S] work beyond which an implementation is skipped (memory, not time).
_DENSE_LIMIT = {"xla_reference": 2**33, "cudnn": 2**36, "tokamax": 2**36}


# ------------------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Row:
  impl: str
  layout: str
  seq_len: int
  batch: int
  mode: str
  ms: float | None
  tflops: float | None
  pairs: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  note: str = ""


def time_call(fn: Callable, args, *, min_time: float = 0.2, repeats: int = 3) -> float:
  """Median seconds per call of a compiled ``fn`` (after warm-up)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = max(time.perf_counter() - t0, 1e-6)
  iters = max(1, min(200, int(min_time / once)))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times))


def make_inputs(seed, batch, t, heads, kv_heads, head_dim, dtype, layout):
  rng = np.random.default_rng(seed)
  lengths = document_lengths(layout, t, seed)
  seg, pos = row_ids(lengths)
  seg = jnp.asarray(np.broadcast_to(seg, (batch, t)))
  pos = jnp.asarray(np.broadcast_to(pos, (batch, t)))
  shape_q, shape_k = (batch, t, heads, head_dim), (batch, t, kv_heads, head_dim)
  q = jnp.asarray(rng.normal(size=shape_q), dtype)
  k = jnp.asarray(rng.normal(size=shape_k), dtype)
  v = jnp.asarray(rng.normal(size=shape_k), dtype)
  do = jnp.asarray(rng.normal(size=shape_q), dtype)
  return (q, k, v, do, seg, pos), lengths


def bench_one(name, fn, inputs, lengths, *, mode, layout, heads, kv_heads, head_dim, dtype,
              min_time=0.2, repeats=3):
  q, k, v, do, seg, pos = inputs
  batch, t = seg.shape
  pairs = batch * visible_pairs(lengths)
  row = Row(name, layout, t, batch, mode, None, None, pairs, heads, kv_heads, head_dim,
            jnp.dtype(dtype).name)
  limit = _DENSE_LIMIT.get(name)
  if limit is not None and batch * heads * t * t > limit:
    row.note = "skipped: dense T×S too large"
    return row
  causal_only = layout == "causal"
  if mode == "fwd":
    run = jax.jit(lambda q, k, v, seg, pos: fn(q, k, v, seg, pos, causal_only))
    args = (q, k, v, seg, pos)
  else:
    def fwd_bwd(q, k, v, do, seg, pos):
      _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg, pos, causal_only), q, k, v)
      return vjp(do)
    run = jax.jit(fwd_bwd)
    args = (q, k, v, do, seg, pos)
  try:
    secs = time_call(run, args, min_time=min_time, repeats=repeats)
  except Exception as e:  # a peer that cannot run this case reports why instead of aborting
    row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row
  row.ms = secs * 1e3
  row.tflops = flops(pairs, heads, head_dim, mode) / secs / 1e12
  return row


def sweep(*, seq_lens, layouts, modes, impls, heads, kv_heads, head_dim, dtype, tokens,
          min_time=0.2, repeats=3, log=print) -> list[Row]:
  rows = []
  for t in seq_lens:
    batch = max(1, tokens // t)
    for layout in layouts:
      inputs, lengths = make_inputs(t, batch, t, heads, kv_heads, head_dim, dtype, layout)
      for mode in modes:
        for name, fn in impls.items():
          row = bench_one(name, fn, inputs, lengths, mode=mode, layout=layout, heads=heads,
                          kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                          min_time=min_time, repeats=repeats)
          rows.append(row)
          log(format_row(row))
  return rows


# ------------------------------------------------------------------------------------------------
# Output.

_HEADER = f"{'impl':<16} {'layout':<8} {'T':>6} {'B':>3} {'mode':<8} {'ms':>9} {'TF/s':>7}  note"


def format_row(r: Row) -> str:
  ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
  tf = f"{r.tflops:7.1f}" if r.tflops is not None and r.tflops >= 1 else (
      f"{r.tflops:7.4f}" if r.tflops is not None else f"{'-':>7}")
  return f"{r.impl:<16} {r.layout:<8} {r.seq_len:>6} {r.batch:>3} {r.mode:<8} {ms} {tf}  {r.note}"


def device_name() -> str:
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}"


def write_json(rows: list[Row], path: str, extra: dict | None = None) -> None:
  meta = dict(device=device_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  meta.update(extra or {})
  with open(path, "w") as f:
    json.dump(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows]), f, indent=1)


def append_markdown(rows: list[Row], path: str) -> None:
  """Append a dated table of results to a markdown file (e.g. ``docs/benchmarks.md``)."""
  date = datetime.date.today().isoformat()
  lines = [f"\n### attention — {device_name()}, jax {jax.__version__}, {date}\n",
           "| impl | layout | T | B | mode | dtype | H | N/K | ms | eff. TF/s | note |",
           "| --- | --- | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | --- |"]
  for r in rows:
    ms = f"{r.ms:.3f}" if r.ms is not None else "-"
    tf = f"{r.tflops:.4g}" if r.tflops is not None else "-"
    lines.append(f"| {r.impl} | {r.layout} | {r.seq_len} | {r.batch} | {r.mode} | {r.dtype} | "
                 f"{r.head_dim} | {r.heads}/{r.kv_heads} | {ms} | {tf} | {r.note} |")
  with open(path, "a") as f:
    f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------
# Device check (H200 acceptance run).


def _max_rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


CHECK_CASES = (
    ("bf16 d128 gqa4 causal mixed T=2048", jnp.bfloat16, 2048, 16, 4, 128, "mixed",
     dict(causal=True)),
    ("bf16 d64 mha window+softcap docs128 T=1000", jnp.bfloat16, 1000, 8, 8, 64, "docs128",
     dict(causal=True, window=200, softcap=30.0)),
    ("f32 d256 gqa2 bidir docs1k T=3000", jnp.float32, 3000, 4, 2, 256, "docs1k",
     dict(causal=False)),
)


def correctness_checks(cases=CHECK_CASES, *, interpret=False,
                       log=print) -> list[tuple[str, bool, str]]:
  """Triton path vs the float32 reference: outputs and dq/dk/dv, packed rows with padding."""
  results = []
  for name, dtype, t, n, kh, h, layout, kw in cases:
    (q, k, v, do, seg, pos), _ = make_inputs(1, 2, t, n, kh, h, dtype, layout)
    seg = seg.at[:, -37:].set(0)  # trailing padding

    def vg(fn, q, k, v, do):
      out, vjp = jax.vjp(fn, q, k, v)
      return out, vjp(do)

    ours = jax.jit(lambda q, k, v, do: vg(lambda q, k, v: kernels.attention(
        q, k, v, segment_ids=seg, positions=pos, impl="pallas_triton", interpret=interpret,
        **kw), q, k, v, do))
    ref = jax.jit(lambda q, k, v, do: vg(lambda q, k, v: kernels.attention_reference(
        q, k, v, segment_ids=seg, positions=pos, **kw), q, k, v, do))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
      want, want_g = ref(f32(q), f32(k), f32(v), f32(do))
    got, got_g = ours(q, k, v, do)
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3  # f32 inputs run as TF32 in tl.dot
    errs = [_max_rel_err(got, want)] + [_max_rel_err(a, b) for a, b in zip(got_g, want_g)]
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (got, *got_g))
    ok = finite and max(errs) <= tol
    msg = "max err / scale out/dq/dk/dv = " + "/".join(f"{e:.1e}" for e in errs) + f" (tol {tol})"
    results.append((f"correct: {name}", ok, msg))
    log(f"[{'PASS' if ok else 'FAIL'}] correct: {name}: {msg}")
  return results


def device_check(*, impl="pallas_triton", seq_lens=(4096, 8192, 16384), packed_len=16384,
                 heads=32, kv_heads=8, head_dim=128, tokens=32768, check_cases=CHECK_CASES,
                 peers=True, require_gpu=True, min_time=0.2, repeats=3, log=print) -> int:
  """Correctness first, then the issue's H200 targets; prints PASS/FAIL per target.

  The keyword arguments exist for a CPU dry run of this code path (tiny shapes, the reference);
  the defaults are the acceptance run.
  """
  if require_gpu and jax.default_backend() != "gpu":
    log(f"--device-check needs a GPU; backend is {jax.default_backend()!r}")
    return 2
  log(f"device: {device_name()}  jax {jax.__version__}")
  results = correctness_checks(check_cases, log=log)
  dtype = jnp.bfloat16
  impls = {"jaxrl": _ours(impl)}
  kw = dict(impls=impls, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
            tokens=tokens, min_time=min_time, repeats=repeats, log=log)
  log(_HEADER)
  rows = sweep(seq_lens=list(seq_lens), layouts=["causal"], modes=MODES, **kw)
  if packed_len not in seq_lens:
    rows += sweep(seq_lens=[packed_len], layouts=["causal"], modes=["fwd"], **kw)
  rows += sweep(seq_lens=[packed_len], layouts=["docs1k", "mixed"], modes=["fwd"], **kw)
  peer_rows = []
  if peers:
    peer_rows = sweep(seq_lens=[seq_lens[len(seq_lens) // 2]], layouts=["causal"], modes=MODES,
                      **{**kw, "impls": {"cudnn": _cudnn}})
  get = {(r.layout, r.seq_len, r.mode): r for r in rows}
  for t in seq_lens:
    fwd, both = get[("causal", t, "fwd")], get[("causal", t, "fwd+bwd")]
    ok = fwd.tflops is not None and fwd.tflops >= 300
    results.append((f"fwd T={t} causal >= 300 TF/s", ok, f"{fwd.tflops or 0:.1f} TF/s"))
    bwd_tf = 0.0
    if fwd.ms is not None and both.ms is not None and both.ms > fwd.ms:
      bwd_tf = flops(fwd.pairs, heads, head_dim, "bwd") / ((both.ms - fwd.ms) * 1e-3) / 1e12
    results.append((f"bwd T={t} causal >= 280 TF/s", bwd_tf >= 280, f"{bwd_tf:.1f} TF/s"))
  dense = get[("causal", packed_len, "fwd")]
  for layout in ("docs1k", "mixed"):
    r = get[(layout, packed_len, "fwd")]
    ratio = (r.tflops or 0.0) / (dense.tflops or math.inf)
    # Scaling: time / Σ len² relative to the dense row (1.0 = perfect, ≤ 1/0.75 passes).
    scale = ((r.ms or math.inf) / r.pairs) / ((dense.ms or math.inf) / dense.pairs)
    target = "docs ≥ 1k" if layout == "docs1k" else "long-tailed mix, info only"
    results.append((f"packed {layout} T={packed_len} ({target}) eff. >= 75% of dense causal",
                    ratio >= 0.75 or layout == "mixed",
                    f"{ratio:.0%} of dense; time/Σlen² = {scale:.2f}× dense"))
  log("")
  for r in peer_rows:
    log(f"peer: {format_row(r)}")
  log("")
  for name, ok, msg in results:
    log(f"[{'PASS' if ok else 'FAIL'}] {name}: {msg}")
  return 0 if all(ok for _, ok, _ in results) else 1


# ------------------------------------------------------------------------------------------------
# Entry point.


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench attention", description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="CPU smoke run: reference only, tiny shapes")
  p.add_argument("--device-check", action="store_true", help="H200 acceptance run (≤ 8 min)")
  p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                 help="default 2k…32k (256 512 with --quick)")
  p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
  p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  p.add_argument("--impls", nargs="+", default=None, help="subset of implementations to run")
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens / T)")
  p.add_argument("--json", default="bench_attention.json", help="where to write the results")
  p.add_argument("--markdown", default=None, help="append a results table to this file")
  a = p.parse_args(argv)
  if a.device_check:
    return device_check()
  backend = jax.default_backend()
  timing = dict(min_time=0.2, repeats=3)
  if a.quick:
    a.seq_lens = a.seq_lens or [256, 512]
    a.heads, a.kv_heads, a.head_dim, a.tokens, a.dtype = 4, 2, 64, 512, "float32"
    timing = dict(min_time=0.01, repeats=1)
  a.seq_lens = a.seq_lens or [2048, 4096, 8192, 16384, 32768]
  impls = implementations(backend, quick=a.quick)
  if a.impls:
    unknown = set(a.impls) - set(impls)
    if unknown:
      print(f"unknown impls {sorted(unknown)}; available: {sorted(impls)}", file=sys.stderr)
      return 2
    impls = {k: v for k, v in impls.items() if k in a.impls}
  print(f"device: {device_name()}  jax {jax.__version__}")
  print(_HEADER)
  rows = sweep(seq_lens=a.seq_lens, layouts=a.layouts, modes=a.modes, impls=impls, heads=a.heads,
               kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=jnp.dtype(a.dtype),
               tokens=a.tokens, **timing)
  write_json(rows, a.json, dict(quick=a.quick))
  print(f"wrote {a.json}")
  if a.markdown:
    append_markdown(rows, a.markdown)
    print(f"appended to {a.markdown}")
  return 0
