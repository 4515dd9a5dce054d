"""Chunked log-probs: parity with the naive log-softmax gather and a float64 reference, the target logit traced
for the platform compiled for, temperature, memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl._compile_target import compile_platform, compiling_for
from jaxrl.losses._logprobs import logprobs_from_logits, token_logprobs


def _inputs(b=2, t=13, d=8, v=37, seed=0):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  unembed = rng.normal(size=(d, v)).astype(np.float32)
  targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
  return hidden, unembed, targets


def _naive(hidden, unembed, targets, temperature):
  logits = jnp.einsum("btd,dv->btv", hidden, unembed) / temperature
  logp = jax.nn.log_softmax(logits, axis=-1)
  target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return target_logp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@pytest.mark.parametrize("chunk_size", [1, 5, 26, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_match_naive(chunk_size, temperature):
  hidden, unembed, targets = _inputs()
  logp, ent = token_logprobs(hidden, unembed, targets, chunk_size=chunk_size,
                             temperature=temperature, return_entropy=True)
  ref_logp, ref_ent = _naive(hidden, unembed, targets, temperature)
  assert logp.shape == (2, 13) and logp.dtype == jnp.float32
  np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 64])  # several chunks (rematerialised) / one chunk (stored logits)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_chunked_gradients_match_naive(temperature, chunk_size):
  hidden, unembed, targets = _inputs(seed=1)
  coef = np.random.default_rng(2).normal(size=(2, 2, 13)).astype(np.float32)

  def objective(fn):
    def f(h, w):
      logp, ent = fn(h, w)
      return jnp.sum(coef[0] * logp + coef[1] * ent)
    return jax.jit(jax.grad(f, argnums=(0, 1)))

  chunked = objective(lambda h, w: token_logprobs(
      h, w, targets, chunk_size=chunk_size, temperature=temperature, return_entropy=True))
  naive = objective(lambda h, w: _naive(h, w, targets, temperature))
  for got, want, name in zip(chunked(hidden, unembed), naive(hidden, unembed), ("hidden", "unembed")):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_out_of_range_targets_read_zero_and_get_no_gradient():
  """The gathered target logit keeps the one-hot sum's meaning for ids outside the vocabulary (padding):
  a zero logit (log p = −logsumexp, finite) and no gradient through the target term."""
  hidden, unembed, targets = _inputs(seed=3)
  targets[0, :3] = [-1, 37, 10**6]

  def f(h, w):
    return jnp.sum(token_logprobs(h, w, jnp.asarray(targets), chunk_size=64))
  logp = token_logprobs(hidden, unembed, targets, chunk_size=64)
  lse = jax.nn.logsumexp(jnp.einsum("btd,dv->btv", hidden, unembed), axis=-1)
  np.testing.assert_allclose(logp[0, :3], -lse[0, :3], rtol=1e-6)
  dh, _ = jax.grad(f, argnums=(0, 1))(hidden, unembed)
  probs = jax.nn.softmax(jnp.einsum("btd,dv->btv", hidden, unembed), axis=-1)
  np.testing.assert_allclose(dh[0, :3], -(probs[0, :3] @ unembed.T), rtol=1e-5, atol=1e-6)  # −∂lse only


def _objective(targets, coef, chunk_size, temperature=0.7):
  """A fresh ``(h, w) -> (Σ c0·logp + c1·H, (logp, H))`` each call: ``jax.jit`` caches traces by function,
  so every platform gets its own trace."""
  def f(h, w):
    logp, ent = token_logprobs(h, w, jnp.asarray(targets), chunk_size=chunk_size, temperature=temperature,
                               return_entropy=True)
    return jnp.sum(coef[0] * logp + coef[1] * ent), (logp, ent)
  return f


def _reference64(hidden, unembed, targets, coef, temperature):
  """float64 numpy: ``(objective, logp, H, d/dh, d/dW)`` of :func:`_objective`. With ``z = h W / T``,
  ``p = softmax(z)``: ``∂ log p_y / ∂z = 1[v = y] − p`` and ``∂H / ∂z = −p (log p + H)``; a target outside
  the vocabulary reads a zero logit (``log p = −lse``) and has no one-hot term."""
  h, w = hidden.astype(np.float64), unembed.astype(np.float64)
  z = np.einsum("btd,dv->btv", h, w) / temperature
  m = z.max(-1, keepdims=True)
  lse = m + np.log(np.exp(z - m).sum(-1, keepdims=True))
  logp_all = z - lse
  p = np.exp(logp_all)
  onehot = np.arange(z.shape[-1]) == targets[..., None]
  logp = np.where(onehot, z, 0.0).sum(-1) - lse[..., 0]
  ent = -(p * logp_all).sum(-1)
  gz = coef[0][..., None] * (onehot - p) - coef[1][..., None] * p * (logp_all + ent[..., None])
  dh = np.einsum("btv,dv->btd", gz, w) / temperature
  dw = np.einsum("btd,btv->dv", h, gz) / temperature
  return np.sum(coef[0] * logp + coef[1] * ent), logp, ent, dh, dw


def _gathers_of_logits(text: str, vocab: int) -> int:
  """Gathers in a lowered module whose operand is ``[..., vocab]`` float32 logits (the CPU target logit);
  the embedding lookup's operand is ``[vocab, D]``."""
  return len(re.findall(rf'"?stablehlo\.gather"?\(.*?: \(tensor<(?:\d+x)*{vocab}xf32>', text))


@pytest.mark.parametrize("chunk_size", [4, 64])  # several chunks (lax.map, rematerialised) / one chunk
@pytest.mark.parametrize("platform, gathers", [("cpu", True), ("tpu", False), ("gpu", False), ("cuda", False)])
def test_target_logit_is_traced_for_the_platform_compiled_for(platform, gathers, chunk_size):
  """``compiling_for`` picks the target logit traced into the value and gradient: a gather of the logits
  when compiling for CPU, the iota-select reduction (no gather at all) for TPU and GPU (``jaxrl plan`` on a
  CPU host compiles those for its targets)."""
  hidden, unembed, targets = _inputs(seed=4)
  coef = np.ones((2, 2, 13), np.float32)
  with compiling_for(platform):
    text = jax.jit(jax.value_and_grad(_objective(targets, coef, chunk_size), argnums=(0, 1), has_aux=True)
                   ).lower(hidden, unembed).as_text()
  assert (_gathers_of_logits(text, 37) > 0) == gathers, text
  if not gathers:
    assert "gather" not in text and "scatter" not in text


def test_host_backend_is_the_platform_outside_compiling_for():
  """Outside any ``compiling_for``, the platform is this process's backend: CPU here, so the gather."""
  hidden, unembed, targets = _inputs(seed=4)
  assert compile_platform() == jax.default_backend() == "cpu"
  f = _objective(targets, np.ones((2, 2, 13), np.float32), 64)
  assert _gathers_of_logits(jax.jit(f).lower(hidden, unembed).as_text(), 37) == 1


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_cpu_gather_and_other_platforms_one_hot_sum_agree_exactly_and_with_float64(chunk_size):
  """The CPU variant gathers the target logit, the TPU/GPU one sums a one-hot select: the same values and
  gradients, bit for bit, and both the float64 reference's (targets outside the vocabulary included)."""
  hidden, unembed, targets = _inputs(seed=4)
  targets[1, :2] = [-1, 37]  # outside the vocabulary
  coef = np.random.default_rng(5).normal(size=(2, 2, 13)).astype(np.float32)

  def run(platform):
    with compiling_for(platform):
      fn = jax.jit(jax.value_and_grad(_objective(targets, coef, chunk_size), argnums=(0, 1), has_aux=True))
      (loss, (logp, ent)), (dh, dw) = fn(hidden, unembed)
    return [np.asarray(x) for x in (loss, logp, ent, dh, dw)]

  cpu = run("cpu")
  want = _reference64(hidden, unembed, targets, coef, 0.7)
  for platform in ("tpu", "gpu"):
    for got, same in zip(run(platform), cpu):
      np.testing.assert_array_equal(got, same, err_msg=platform)
  for got, ref, name in zip(cpu, want, ("objective", "logp", "entropy", "d/dh", "d/dW")):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_temperature_is_log_softmax_of_scaled_logits():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 4
  targets = rng.integers(0, 11, size=(3, 5))
  got = logprobs_from_logits(logits, targets, 0.5)
  scaled = logits.astype(np.float64) / 0.5
  ref = scaled - np.log(np.sum(np.exp(scaled - scaled.max(-1, keepdims=True)), -1, keepdims=True)) \
      - scaled.max(-1, keepdims=True)
  np.testing.assert_allclose(got, np.take_along_axis(ref, targets[..., None], -1)[..., 0], rtol=1e-5)


def test_bfloat16_inputs_give_float32_logprobs():
  hidden, unembed, targets = _inputs()
  logp = token_logprobs(jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(unembed, jnp.bfloat16),
                        targets, chunk_size=8)
  assert logp.dtype == jnp.float32
  ref, _ = _naive(jnp.asarray(hidden, jnp.bfloat16).astype(jnp.float32),
                  jnp.asarray(unembed, jnp.bfloat16).astype(jnp.float32), targets, 1.0)
  np.testing.assert_allclose(logp, ref, rtol=1e-5, atol=1e-5)


def test_bad_temperature_is_an_error():
  hidden, unembed, targets = _inputs()
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(hidden, unembed, targets, temperature=0.0)


def test_chunked_temp_memory_is_at_most_a_quarter_of_naive():
  # 2048 tokens x 32k vocab: naive logits alone are 256 MiB; compile only, nothing runs.
  shapes = (jax.ShapeDtypeStruct((2, 1024, 32), jnp.float32),
            jax.ShapeDtypeStruct((32, 32768), jnp.float32),
            jax.ShapeDtypeStruct((2, 1024), jnp.int32))

  def naive(h, w, y):
    return jnp.sum(logprobs_from_logits(jnp.einsum("btd,dv->btv", h, w), y, 0.7))

  def chunked(h, w, y):
    return jnp.sum(token_logprobs(h, w, y, chunk_size=256, temperature=0.7))

  def temp_bytes(f):
    return jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  for transform in (lambda f: f, lambda f: jax.grad(f, argnums=(0, 1))):
    assert temp_bytes(transform(chunked)) <= temp_bytes(transform(naive)) / 4
