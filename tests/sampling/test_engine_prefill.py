"""The engine's row-local paged prefill on the 8-device CPU mesh: each pool shard prefills its own rows
(keys/values equal the model's contiguous-cache forward, chunked bit for bit equal to one piece), and the
compiled program neither gathers the pool across devices nor materialises every row's context on each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import models, sharding
from jaxrl.sampling import _engine_programs as _engine

CFG = models.ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def _programs(mesh, *, num_slots, max_len, block_size, num_blocks, row_tile=None):
  rules = sharding.LogicalRules.default()
  model = models.Transformer(CFG, rngs=nnx.Rngs(0))  # unplaced: the reference forward
  graphdef, params = nnx.split(models.shard_model(model, mesh, rules))
  progs = _engine.engine_programs(graphdef, CFG, mesh, rules, jnp.float32, "reference", num_slots, max_len,
                            max_len // block_size, num_blocks, block_size, row_tile)
  return model, params, progs


def test_chunked_row_local_prefill_writes_the_models_keys_and_values():
  """4 rows on a (data=4, tensor=2) mesh, one per pool shard, each holding blocks of its own shard only
  (scattered, not in order); prefilled whole and in 2-block chunks (``row_tile``: bit for bit equal),
  the pool holds the keys/values of the model's own forward over a contiguous cache, and no other block
  is written."""
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  bs, p, shards, per_shard = 8, 48, 4, 20
  model, params, progs = _programs(mesh, num_slots=4, max_len=p, block_size=bs, num_blocks=shards * per_shard,
                                   row_tile=1)
  rng = np.random.default_rng(0)
  n_cache = np.array([37, 48, 9, 30], np.int32)
  tokens = rng.integers(0, CFG.vocab_size, (4, p)).astype(np.int32)
  tables = np.full((4, p // bs), shards * per_shard, np.int32)
  for d, n in enumerate(n_cache):  # row d lives on shard d: blocks of [d * per_shard, (d + 1) * per_shard)
    nb = -(-int(n) // bs)
    tables[d, :nb] = d * per_shard + rng.permutation(per_shard)[:nb]

  whole = progs.prefill(params, progs.init()[0], jnp.asarray(tokens), jnp.asarray(n_cache), jnp.asarray(tables),
                        jnp.zeros((4,), jnp.int32))
  pages = progs.init()[0]
  for s in range(0, p, 16):  # chunks of 16 tokens, each reading the earlier chunks' blocks
    pages = progs.prefill(params, pages, jnp.asarray(tokens[:, s:s + 16]), jnp.asarray(n_cache),
                          jnp.asarray(tables), jnp.full((4,), s, jnp.int32))
  for a, b in zip(whole, pages):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  seg = (np.arange(p)[None, :] < n_cache[:, None]).astype(np.int32)
  forward = nnx.jit(lambda m, x, pos, seg: m(x, positions=pos, segment_ids=seg, cache=models.KVCache.init(CFG, 4, p),
                                              cache_start=jnp.zeros((4,), jnp.int32))[1])
  ref = forward(model, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(p), (4, p)), jnp.asarray(seg))
  written = np.zeros(shards * per_shard, bool)
  for pool, want in zip(pages, (ref.k, ref.v)):
    pool, want = np.asarray(pool), np.asarray(want)  # [L, NB, bs, K, H], [L, U, P, K, H]
    for u, n in enumerate(n_cache):
      nb = -(-int(n) // bs)
      got = pool[:, tables[u, :nb]].reshape(CFG.num_layers, nb * bs, CFG.num_kv_heads, CFG.head_dim)
      np.testing.assert_allclose(got[:, :n], want[:, u, :n], atol=2e-5, rtol=0)
      written[tables[u, :nb]] = True
    assert not pool[:, ~written].any()  # no stray writes (a row's blocks on another shard, padding)


def test_prefill_compiles_row_local_without_gathering_the_pool():
  """8 rows x 1024 slots on (data=8): each device reads only its row's blocks, so the compiled program
  has no all-gather and its temporaries stay under half of the keys and values of every row's whole
  context (the old up-front ``[L, U, P, K, H]`` gather came out replicated: 4.3x that, 18 all-gathers)."""
  mesh = sharding.make_mesh({"data": 8})
  rows, p, bs, t = 8, 1024, 16, 16
  _, params, progs = _programs(mesh, num_slots=8, max_len=p, block_size=bs, num_blocks=8 * (p // bs + 2))
  pages = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=progs.page_sharding)
                for x in jax.eval_shape(progs._init)[0])
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  compiled = progs.prefill.lower(params, pages, i32(rows, t), i32(rows), i32(rows, p // bs), i32(rows)).compile()
  context = 2 * CFG.num_layers * rows * p * CFG.num_kv_heads * CFG.head_dim * 4  # K and V, float32
  assert "all-gather" not in compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes < context / 2


def test_prefill_rows_must_split_over_the_pool_shards():
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  _, params, progs = _programs(mesh, num_slots=4, max_len=16, block_size=8, num_blocks=16)
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
  with pytest.raises(ValueError, match="do not split over the pool's 4 shards"):
    progs.prefill(params, progs.init()[0], i32(2, 16), i32(2), i32(2, 2))
  assert _engine.prefill_batch_rows(4, 8) == 8 and _engine.prefill_batch_rows(32, 32) == 32
  assert _engine.prefill_batch_rows(5, 4) == 8 and _engine.prefill_batch_rows(3, 1) == 3
