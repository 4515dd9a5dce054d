"""The ``attention`` / ``decode_attention`` dispatcher (``_dispatch.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import kernels
from jaxrl._compile_target import compiling_for
from jaxrl.kernels import _decode, _paged


def small_inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 24, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 24, 2, 16)), jnp.float32)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 10 + [0] * 4], 2, axis=0), jnp.int32)
  return q, k, k, seg


def test_auto_is_the_reference_on_cpu():
  q, k, v, seg = small_inputs()
  got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, segment_ids=seg))(q, k, v)
  want = jax.jit(lambda q, k, v: kernels.attention_reference(q, k, v, segment_ids=seg))(q, k, v)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("platform, impl, suffix", [("cpu", "reference", "reference"), ("tpu", "pallas_tpu", "tpu"),
                                                     ("gpu", "pallas_triton", "triton"),
                                                     ("cuda", "pallas_triton", "triton")])
def test_auto_resolves_for_the_platform_compiled_for(monkeypatch, platform, impl, suffix):
  """``impl="auto"`` (attention, decode, paged decode) is the kernel of the platform the program is compiled
  for (``compiling_for``: a plan's target), not this CPU host's; each kernel entry point is replaced by a
  recorder, so nothing runs."""
  called = []
  for module, name in ((_decode, "decode_attention_"), (_paged, "paged_decode_attention_")):
    for kind in ("reference", "tpu", "triton"):
      monkeypatch.setattr(module, name + kind, lambda *a, _n=name + kind, **k: called.append(_n))
  q, k, v, seg = small_inputs()
  lengths = jnp.array([3, 4])
  with compiling_for(platform):
    assert kernels.resolve_impl("auto") == impl
    kernels.decode_attention(q[:, 0], k, v, lengths)
    kernels.paged_decode_attention(q[:, 0], k[0], v[0], jnp.zeros((2, 1), jnp.int32), lengths)
  assert called == [f"decode_attention_{suffix}", f"paged_decode_attention_{suffix}"]
  assert kernels.resolve_impl("auto") == "reference"  # outside: the host's backend again


def test_unknown_impl_is_rejected():
  q, k, v, seg = small_inputs()
  with pytest.raises(ValueError, match="unknown attention impl"):
    kernels.attention(q, k, v, segment_ids=seg, impl="flash")
  with pytest.raises(ValueError, match="unknown decode impl"):
    kernels.decode_attention(q[:, 0], k, v, jnp.array([3, 4]), impl="cudnn")


def test_unbuilt_mosaic_gpu_impl_raises_clearly():
  q, k, v, seg = small_inputs()
  with pytest.raises(NotImplementedError, match="pallas_mosaic_gpu"):
    kernels.attention(q, k, v, segment_ids=seg, impl="pallas_mosaic_gpu")


def test_cudnn_rejects_softcap_and_non_gpu_backends():
  q, k, v, seg = small_inputs()
  with pytest.raises(ValueError, match="soft-cap"):
    kernels.attention(q, k, v, segment_ids=seg, impl="cudnn", softcap=30.0)
  with pytest.raises(RuntimeError, match="GPU"):
    kernels.attention(q, k, v, segment_ids=seg, impl="cudnn")


def test_block_sizes_must_be_powers_of_two():
  with pytest.raises(ValueError, match="block_q"):
    kernels.BlockSizes(block_q=48)


def test_mismatched_heads_are_rejected_by_pallas_impls():
  q, k, v, seg = small_inputs()
  with pytest.raises(ValueError, match="multiple of kv heads"):
    kernels.attention(q[:, :, :3], k, v, segment_ids=seg, impl="pallas_triton", interpret=True)
