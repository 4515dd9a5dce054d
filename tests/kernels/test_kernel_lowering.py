"""The Pallas kernels lower for their real targets (Triton IR for CUDA, Mosaic for TPU) on CPU.

``jax.export`` runs the Pallas→Triton and Pallas→Mosaic lowerings without a device, catching what
interpret mode cannot: non-power-of-two Triton tensors, ops without a lowering, bad TPU tilings
known at lowering time. (Triton→PTX and Mosaic→TPU compilation still happen on the device.)
"""

import jax
import jax.numpy as jnp
import pytest

from jaxrl import kernels

NO_CHECK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
TARGETS = [("pallas_triton", "cuda"), ("pallas_tpu", "tpu")]


def export(fn, *args, platform):
  return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=NO_CHECK)(*args)


@pytest.mark.parametrize("impl,platform", TARGETS)
@pytest.mark.parametrize("h,n,kh", [(128, 8, 2), (64, 14, 2), (256, 4, 4)],
                         ids=["d128_gqa4", "d64_gqa7", "d256_mha"])
def test_flash_forward_and_backward_lower(impl, platform, h, n, kh):
  b, t = 2, 1000
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def loss(q, k, v, s):
    out = kernels.attention(q, k, v, segment_ids=s, positions=s, impl=impl, softcap=30.0,
                            window=256)
    return jnp.sum(out.astype(jnp.float32))

  export(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg, platform=platform)


@pytest.mark.parametrize("impl,platform", TARGETS)
def test_decode_lowers(impl, platform):
  q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((4, 4096, 2, 128), jnp.bfloat16)
  n = jax.ShapeDtypeStruct((4,), jnp.int32)
  export(lambda q, k, v, n: kernels.decode_attention(q, k, v, n, impl=impl, window=1000), q, k, k,
         n, platform=platform)
