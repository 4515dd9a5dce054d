"""The decoder: numerics of its pieces, packing, scan vs loop, remat, the KV cache."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from model_testlib import (HF_FIXTURES, TEST_CFG, arange_positions, cached_step, flat_arrays, forward,
                           logits_and_grads, packed_batch)

from jaxrl import models
from jaxrl.models import ModelConfig
from jaxrl.models._transformer import RMSNorm


def test_rmsnorm_matches_float64_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 16)).astype(np.float32)
  scale = rng.normal(size=(16,)).astype(np.float32)
  norm = RMSNorm(16, eps=1e-5, param_dtype=jnp.float32)
  norm.scale[...] = jnp.asarray(scale)
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * scale
  np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def _llama3_inv_freq_loop(theta, h, factor, low, high, old_len):
  """Per-frequency float64 loop, written from Meta's Llama 3.1 `apply_scaling`."""
  out = []
  for i in range(0, h, 2):
    freq = 1.0 / theta ** (i / h)
    wavelen = 2 * math.pi / freq
    if wavelen < old_len / high:
      out.append(freq)
    elif wavelen > old_len / low:
      out.append(freq / factor)
    else:
      smooth = (old_len / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def test_llama3_rope_frequencies_match_per_frequency_loop():
  cfg = ModelConfig.tiny(head_dim=64, hidden_size=256, rope_theta=500000.0,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
  want = _llama3_inv_freq_loop(500000.0, 64, 8.0, 1.0, 4.0, 8192)
  got = models.rope_frequencies(cfg)
  # all three regimes occur
  plain = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
  assert (got == plain.astype(np.float32)).any() and np.isclose(got, plain / 8, rtol=1e-6).any()
  assert (~np.isclose(got, plain, rtol=1e-6) & ~np.isclose(got, plain / 8, rtol=1e-6)).any()
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_rope_equals_complex_rotation_of_half_pairs():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 100, size=(2, 5)).astype(np.int32)
  inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
  z = (x[..., :4] + 1j * x[..., 4:]).astype(np.complex128) * np.exp(1j * pos[:, :, None, None] * inv_freq)
  want = np.concatenate([z.real, z.imag], axis=-1)
  got = models.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv_freq.astype(np.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_packed_row_equals_each_sequence_alone(fixture_models):
  model = fixture_models["llama_gqa"]
  rng = np.random.default_rng(2)
  width = 80  # the reference batch's shape, so the compiled forward is shared
  lengths = (27, 15, 31)
  seqs = [rng.integers(0, 256, size=n).astype(np.int32) for n in lengths]
  pad = np.zeros(width - sum(lengths), np.int32)  # trailing padding, segment 0
  tokens = np.concatenate(seqs + [pad])
  segment_ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)] + [pad])
  positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths] + [pad])
  # row 0: the packed row; row 1: one sequence alone at the start of the row
  packed, alone, start = [], [], 0
  for seq in seqs:
    n = len(seq)
    lone = np.zeros(width, np.int32)
    lone[:n] = seq
    lone_seg = (np.arange(width) < n).astype(np.int32)
    out = np.asarray(forward(model, np.stack([tokens, lone]), np.stack([positions, np.arange(width) * lone_seg]),
                             np.stack([segment_ids, lone_seg])))
    packed.append(out[0, start:start + n])
    alone.append(out[1, :n])
    start += n
  for p, a in zip(packed, alone):
    np.testing.assert_allclose(p, a, rtol=1e-5, atol=1e-5)


def test_scan_and_loop_layers_give_equal_logits(fixture_models):
  ref = np.load(HF_FIXTURES / "qwen3" / "reference.npz")
  tokens = ref["tokens"]
  loop = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32", scan_layers=False)
  assert isinstance(loop.layers, nnx.List) and len(loop.layers) == 2
  args = (tokens, arange_positions(tokens), np.ones_like(tokens))
  np.testing.assert_allclose(np.asarray(forward(loop, *args)), np.asarray(forward(fixture_models["qwen3"], *args)),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scan_layers,remat,unroll", [(True, "full", 1), (False, "dots", 1), (True, "none", True),
                                                       (True, "full", 2)])
def test_remat_and_unrolled_scans_leave_gradients_unchanged(grad_reference, tmp_path, scan_layers, remat, unroll):
  model, _, want = grad_reference
  models.save_pretrained(model, tmp_path)
  remat_model = models.load_pretrained(tmp_path, scan_layers=scan_layers, remat=remat, scan_unroll=unroll)
  assert remat_model.cfg.remat == remat and remat_model.cfg.scan_unroll == unroll
  _, grads = logits_and_grads(remat_model, *map(jnp.asarray, packed_batch()))
  got = flat_arrays(grads)
  assert got.keys() == want.keys()
  for path in want:
    assert np.abs(want[path]).max() > 0, path
    np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-6, err_msg="/".join(map(str, path)))


def test_hidden_states_times_unembed_matrix_equal_logits(fixture_models):
  model = fixture_models["qwen2_tied"]  # tied: the unembed matrix is the transposed embedding
  tokens = jnp.asarray(np.load(HF_FIXTURES / "qwen2_tied" / "reference.npz")["tokens"])
  pos, seg = jnp.asarray(arange_positions(np.asarray(tokens))), jnp.ones_like(tokens)
  hidden = forward(model, tokens, pos, seg, return_hidden=True)
  logits = forward(model, tokens, pos, seg)
  assert hidden.shape == (*tokens.shape, 48) and logits.dtype == jnp.float32
  w = model.unembed_matrix()
  assert w.shape == (48, 256)
  np.testing.assert_allclose(np.asarray(hidden @ w), np.asarray(logits), rtol=1e-5, atol=1e-5)


def test_ragged_prefill_then_decode_equals_full_forward(fixture_models):
  model = fixture_models["llama_gqa"]
  cfg = model.cfg
  rng = np.random.default_rng(3)
  prompt_lens = np.array([6, 4], np.int32)
  new = 5
  total = prompt_lens + new
  full = rng.integers(0, 256, size=(2, 80)).astype(np.int32)  # the reference batch's shape: shared compile
  seg_full = (np.arange(80)[None] < total[:, None]).astype(np.int32)
  want = np.asarray(forward(model, full, arange_positions(full) * seg_full, seg_full))

  cache = models.KVCache.init(cfg, batch=2, max_len=16)
  width = int(prompt_lens.max())
  seg = (np.arange(width)[None] < prompt_lens[:, None]).astype(np.int32)
  prompt = full[:, :width] * seg
  logits, cache = cached_step(model, cache, prompt, arange_positions(prompt) * seg, seg, np.zeros(2))
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits)[b, :prompt_lens[b]], want[b, :prompt_lens[b]], rtol=1e-5,
                               atol=1e-5)
  lengths = prompt_lens.copy()
  for _ in range(new):
    tok = full[np.arange(2), lengths][:, None]
    logits, cache = cached_step(model, cache, tok, lengths[:, None], np.ones((2, 1)), lengths)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], want[np.arange(2), lengths], rtol=1e-5, atol=1e-5)
    lengths = lengths + 1
  assert cache.k.shape == (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
  np.testing.assert_array_equal(np.asarray(cache.segment_ids), (np.arange(16)[None] < total[:, None]).astype(int))
  np.testing.assert_array_equal(np.asarray(cache.positions)[0, :total[0]], np.arange(total[0]))


def test_bfloat16_compute_keeps_float32_logits_close(fixture_models):
  tokens = np.load(HF_FIXTURES / "qwen3" / "reference.npz")["tokens"]
  args = (tokens, arange_positions(tokens), np.ones_like(tokens))
  want = np.asarray(forward(fixture_models["qwen3"], *args))
  bf16 = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="bfloat16", param_dtype="float32")
  assert bf16.cfg.dtype == "bfloat16" and bf16.embed.get_value().dtype == jnp.float32
  got = forward(bf16, *args)
  assert got.dtype == jnp.float32
  # bfloat16 has 8 mantissa bits: logits of size ~4 agree to a few 1e-2, far from the float32 result's 1e-6.
  err = np.abs(np.asarray(got) - want).max()
  assert 1e-4 < err < 0.15, err


def test_random_init_is_deterministic_per_seed():
  a, b, c = (models.init_model(TEST_CFG, seed=s) for s in (0, 0, 1))
  np.testing.assert_array_equal(np.asarray(a.embed.get_value()), np.asarray(b.embed.get_value()))
  assert not np.array_equal(np.asarray(a.embed.get_value()), np.asarray(c.embed.get_value()))
  q = np.asarray(a.layers.attn.q_proj.get_value())
  assert q.shape == (2, 64, 8, 8) and abs(q.std() - 0.02) < 0.002
  assert not np.array_equal(q[0], q[1])  # layers get different keys
  np.testing.assert_array_equal(np.asarray(a.final_norm.scale.get_value()), np.ones(64))


def test_param_dtype_is_the_storage_dtype():
  model = models.abstract_model(dataclasses.replace(TEST_CFG, param_dtype="bfloat16"))
  dtypes = {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}


def test_abstract_model_of_a_32b_preset_allocates_nothing():
  model = models.abstract_model(dataclasses.replace(ModelConfig.qwen3_32b(), param_dtype="bfloat16"))
  q = model.layers.attn.q_proj
  assert isinstance(q.get_value(), jax.ShapeDtypeStruct)
  assert q.get_value().shape == (64, 5120, 64, 128)
  assert q.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")


def test_mismatched_cache_is_refused(fixture_models):
  model = fixture_models["qwen3"]
  wrong = models.KVCache.init(dataclasses.replace(model.cfg, num_layers=3), batch=2, max_len=8)
  tokens = jnp.zeros((2, 1), jnp.int32)
  with pytest.raises(ValueError, match=r"cache shapes k \(3, 2, 8, 2, 16\).*expected k/v \(2, 2, 8, 2, 16\)"):
    model(tokens, positions=tokens, segment_ids=tokens, cache=wrong, cache_start=jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="cache and cache_start must be given together"):
    model(tokens, positions=tokens, segment_ids=tokens, cache=wrong)


def test_swiglu_keeps_only_gate_and_up_for_the_backward_pass(capsys):
  """Issue 34 item 4: the MLP saves its two projections and recomputes ``silu(gate) · up`` (and the sigmoid)
  in the backward pass; left to autodiff it also kept sigmoid(gate), silu(gate) and the product, three more
  ``[B, T, F]`` arrays per layer. Gradients equal the unrematerialised MLP's."""
  cfg = dataclasses.replace(TEST_CFG, dtype="float32")
  mlp = models._transformer.MLP(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, cfg.hidden_size)), jnp.float32)
  graphdef, params = nnx.split(mlp)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params)(x) ** 2)

  print_saved_residuals(loss, params, x)
  wide = [line for line in capsys.readouterr().out.splitlines() if f"[2,5,{cfg.intermediate_size}]" in line]
  assert len(wide) == 2 and all("dot_general" in line for line in wide), wide  # x·W_gate and x·W_up

  def plain(params, x):
    m = nnx.merge(graphdef, params)
    dt = jnp.float32
    gate, up = x @ m.gate_proj[...].astype(dt), x @ m.up_proj[...].astype(dt)
    return jnp.sum(((jax.nn.silu(gate) * up) @ m.down_proj[...].astype(dt)) ** 2)

  got, want = jax.grad(loss)(params, x), jax.grad(plain)(params, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
