"""Paged ragged decode attention (``_paged.py``): reference vs contiguous decode, Pallas kernels (interpret)."""

import jax.numpy as jnp
import numpy as np
import pytest
from kernels_testlib import assert_close, run_jitted

from jaxrl import kernels

LENGTHS = [0, 1, 15, 16, 37, 64]  # empty row, single key, mid-block, block edge, full table
NB, BS, MB, KH, G, H = 40, 16, 4, 2, 4, 64


def paged(seed, dtype=jnp.float32):
  """A pool with rows' blocks scattered (shuffled, shared between two rows), plus the contiguous view."""
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  q = jnp.asarray(rng.normal(size=(b, KH * G, H)), dtype)
  k = jnp.asarray(rng.normal(size=(NB, BS, KH, H)), dtype)
  v = jnp.asarray(rng.normal(size=(NB, BS, KH, H)), dtype)
  tables = rng.permutation(NB)[:b * MB].reshape(b, MB).astype(np.int32)
  tables[5, :2] = tables[4, :2]  # two rows share their first blocks (a forked prompt)
  for i, n in enumerate(LENGTHS):  # entries past a row's last block are garbage, never read
    tables[i, -(-n // BS):] = -7
  return q, k, v, jnp.asarray(tables), jnp.asarray(LENGTHS, jnp.int32)


def contiguous(pages, tables):
  return pages[np.clip(np.asarray(tables), 0, NB - 1)].reshape(len(LENGTHS), MB * BS, KH, H)


@pytest.mark.parametrize("kw", [dict(), dict(window=20, softcap=5.0)], ids=["plain", "window"])
def test_paged_reference_equals_contiguous_decode(kw):
  q, k, v, tables, lengths = paged(0)
  got = kernels.paged_decode_attention(q, k, v, tables, lengths, impl="reference", **kw)
  want = kernels.decode_attention_reference(q, contiguous(k, tables), contiguous(v, tables), lengths, **kw)
  assert_close(got, want, "out")
  assert np.all(np.asarray(got)[0] == 0)


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_paged_pallas_matches_reference(impl):
  q, k, v, tables, lengths = paged(1)
  kw = dict(window=40, softcap=5.0)
  got = run_jitted(lambda *a: kernels.paged_decode_attention(*a, impl=impl, interpret=True, **kw),
                   q, k, v, tables, lengths)
  want = kernels.paged_decode_attention(q, k, v, tables, lengths, impl="reference", **kw)
  assert_close(got, want, "out")
  assert np.all(np.asarray(got)[0] == 0)


def test_paged_triton_splits_combine_bf16():
  q, k, v, tables, lengths = paged(2, jnp.bfloat16)
  from jaxrl.kernels._paged import paged_decode_attention_triton
  got = run_jitted(lambda *a: paged_decode_attention_triton(*a, num_splits=3, interpret=True), q, k, v, tables, lengths)
  want = kernels.paged_decode_attention(*(x.astype(jnp.float32) for x in (q, k, v)), tables, lengths,
                                        impl="reference")
  assert got.dtype == jnp.bfloat16
  assert_close(got, want, "out")


def test_unknown_impl_is_refused():
  q, k, v, tables, lengths = paged(0)
  with pytest.raises(ValueError, match="paged decode impl"):
    kernels.paged_decode_attention(q, k, v, tables, lengths, impl="cudnn")
