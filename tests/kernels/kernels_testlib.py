"""Seeded packed layouts and a reference comparison shared by the kernel tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import kernels


def positions_for(seg: np.ndarray) -> np.ndarray:
  """Positions restarting at 0 at every change of segment id (the packing convention)."""
  pos = np.zeros_like(seg)
  for t in range(1, seg.shape[-1]):
    pos[t] = 0 if seg[t] != seg[t - 1] else pos[t - 1] + 1
  return pos


def random_row(rng: np.random.Generator, t: int, *, max_segments: int = 16) -> np.ndarray:
  """1–``max_segments`` documents of random lengths (length-1 ones likely), then padding."""
  n = int(rng.integers(1, max_segments + 1))
  used = int(rng.integers(n, t + 1))  # tokens covered by documents; the rest is trailing padding
  cuts = np.sort(rng.choice(np.arange(1, used), size=n - 1, replace=False)) if n > 1 else []
  lengths = np.diff(np.concatenate([[0], cuts, [used]])).astype(int)
  seg = np.zeros(t, np.int32)
  start = 0
  for i, ln in enumerate(lengths):
    seg[start:start + ln] = i + 1
    start += ln
  return seg


def packed_batch(seed: int, t: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows covering the layouts the kernels must get right, ``([R, t], [R, t])`` int32.

  Rows: three random packings (1–16 documents, length-1 documents, trailing padding); many short
  documents (shorter than any tile); all padding; one document then padding; an id that reappears
  later in the row with continuing positions; an id that reappears with restarting positions.
  """
  rng = np.random.default_rng(seed)
  rows, pos_rows = [], []
  for _ in range(3):
    seg = random_row(rng, t)
    rows.append(seg)
    pos_rows.append(positions_for(seg))
  seg = np.repeat(np.arange(1, t // 3 + 2), 3)[:t].astype(np.int32)
  seg[-2:] = 0
  rows.append(seg)
  pos_rows.append(positions_for(seg))
  rows.append(np.zeros(t, np.int32))
  pos_rows.append(np.zeros(t, np.int32))
  seg = np.zeros(t, np.int32)
  seg[: t - 7] = 5
  rows.append(seg)
  pos_rows.append(positions_for(seg))
  a, b = t // 3, (2 * t) // 3
  seg = np.concatenate([np.full(a, 1), np.full(b - a, 2), np.full(t - b, 1)]).astype(np.int32)
  pos = np.concatenate([np.arange(a), np.arange(b - a), a + np.arange(t - b)]).astype(np.int32)
  rows.append(seg)
  pos_rows.append(pos)
  seg = np.concatenate([np.full(a, 3), np.full(b - a, 4), np.full(t - b, 3)]).astype(np.int32)
  rows.append(seg)
  pos_rows.append(positions_for(seg))
  return np.stack(rows), np.stack(pos_rows)


def qkv(seed: int, b: int, t: int, n: int, kh: int, h: int, dtype, s: int | None = None):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  q = rng.normal(size=(b, t, n, h))
  k = rng.normal(size=(b, s, kh, h))
  v = rng.normal(size=(b, s, kh, h))
  do = rng.normal(size=(b, t, n, h))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, do))


# float32: elementwise ``atol = rtol``; the reference itself is ~1e-6 away from a float64 evaluation
# at these sizes, so 2e-6 is the tightest meaningful output bound. bfloat16: max error relative to
# the tensor's scale (elementwise bounds sit below bf16 rounding of the largest gradients: the
# bf16 reference itself is ~0.3-0.5% of scale away from the float32 one).
TOL = {jnp.dtype(jnp.float32): dict(out=2e-6, grad=3e-5),
       jnp.dtype(jnp.bfloat16): dict(out=1e-2, grad=1e-2)}


def assert_close(got, want, kind: str, name: str = ""):
  """Compare a kernel result with the float32 reference under :data:`TOL` for ``got.dtype``."""
  dtype = jnp.dtype(got.dtype)
  tol = TOL[dtype][kind]
  got = np.asarray(got.astype(jnp.float32))
  want = np.asarray(want.astype(jnp.float32))
  assert np.all(np.isfinite(got)), f"{name}: non-finite values"
  if dtype == jnp.dtype(jnp.bfloat16):
    err = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} x scale {scale:.3g}"
  else:
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=name)


# Interpret-mode kernels unroll into large CPU programs; XLA's backend optimisations roughly double
# their compile time and buy nothing for a correctness test (same options for kernel and reference).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_jitted(fn, *args):
  """``jax.jit(fn)(*args)``, compiled with :data:`FAST_COMPILE`."""
  return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def value_and_grads(fn, q, k, v, do):
  """``(out, (dq, dk, dv))`` of ``fn(q, k, v)`` under the cotangent ``do``, jitted once."""

  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)

  return run_jitted(run, q, k, v, do)


def reference_value_and_grads(q, k, v, do, **kw):
  """The float32 reference on the same (possibly bf16-rounded) inputs."""
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return value_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, **kw),
                         f32(q), f32(k), f32(v), f32(do))
