"""Rollout engine: sampler parity through fewer slots than requests, streaming, weight updates,
preemption under a tiny cache, sharding, bounded cache, bad input."""

import jax
import numpy as np
import pytest
from flax import nnx
from sampling_testlib import HF_FIXTURES, recomputed_logprobs

from jaxrl import models, sampling, sharding
from jaxrl._compile_target import compiling_for

NEW = 16
PROMPT_LENS = (3, 6, 11)  # few distinct lengths: the trainer-style recompute groups rows by length


def _engine(model, **kw):
  args = dict(num_slots=4, max_len=64, block_size=8, num_blocks=64, eos_token_ids=[], row_tile=1, prefill_rows=1)
  args.update(kw)
  return sampling.Engine(model, None, **args)


@pytest.fixture(scope="module")
def qwen3(fixture_models):
  return fixture_models["qwen3"]


@pytest.fixture(scope="module")
def engine4(qwen3):
  return _engine(qwen3)


@pytest.fixture(scope="module")
def workload():
  """50 requests (prompt groups of n=1 or 2) with very different completion lengths (1..40)."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 200, size=PROMPT_LENS[i % 3]).tolist() for i in range(25)]
  max_new = np.where(rng.random(25) < 0.3, rng.integers(24, 41, 25), rng.integers(1, 8, 25)).tolist()
  return prompts, max_new


def _requests(prompts, max_new, **kw):
  return [sampling.Request(prompt=p, n=2, max_new_tokens=int(m), request_id=100 + i, seed=5, **kw)
          for i, (p, m) in enumerate(zip(prompts, max_new))]


def _run(engine, requests):
  engine.submit(requests)
  return {(c.request_id, c.sample): c for c in engine.completions()}


def test_greedy_matches_hf_generate_through_the_engine(engine4, qwen3_reference):
  out = engine4.generate(qwen3_reference["prompt"], max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, qwen3_reference["tokens"])
  assert out.finish_reason == ["length", "length"] and out.lengths.tolist() == [NEW, NEW]


def test_fifty_rows_on_four_slots_equal_the_sampler_and_the_trainer_recompute(engine4, qwen3, workload):
  prompts, max_new = workload
  sampler = sampling.Sampler(qwen3, None, max_len=64, eos_token_ids=[])
  kw = dict(temperature=1.0, top_p=0.9, top_k=40)
  got = _run(engine4, _requests(prompts, max_new, **kw))
  assert len(got) == 50
  assert engine4.stats()["busy_slots"] == 0 and engine4.pool.used == 0
  # One sampler call at the longest length: a row's draws depend only on (seed, request id, sample, step).
  ref = sampler.generate(prompts, n=2, max_new_tokens=max(max_new), seed=5, request_ids=100 + np.arange(25), **kw)
  for i, m in enumerate(max_new):
    for j in range(2):
      c = got[(100 + i, j)]
      assert c.finish_reason == "length" and len(c.tokens) == m
      np.testing.assert_array_equal(c.tokens, ref.tokens[2 * i + j, :m])
      np.testing.assert_allclose(c.logprobs, ref.logprobs[2 * i + j, :m], atol=1e-5, rtol=0)
      np.testing.assert_array_equal(c.versions, 0)
  for length in PROMPT_LENS:  # trainer-style recompute over prompt + completion
    keys = [k for k, c in got.items() if len(c.prompt) == length]
    toks = np.zeros((len(keys), max(max_new)), np.int32)
    for r, k in enumerate(keys):
      toks[r, :len(got[k].tokens)] = got[k].tokens
    lp = recomputed_logprobs(qwen3, np.stack([got[k].prompt for k in keys]), toks, 1.0)
    for r, k in enumerate(keys):
      np.testing.assert_allclose(got[k].logprobs, lp[r, :len(got[k].tokens)], atol=1e-5, rtol=0)


def test_results_are_bit_identical_whatever_the_slot_count(engine4, qwen3, workload):
  prompts, max_new = workload
  reqs = _requests(prompts[:12], max_new[:12], temperature=0.8)
  a = _run(engine4, reqs)
  b = _run(_engine(qwen3, num_slots=16, row_tile=1), reqs)  # rows one by one, as in engine4
  for k in a:
    np.testing.assert_array_equal(a[k].tokens, b[k].tokens)
    np.testing.assert_array_equal(a[k].logprobs, b[k].logprobs)
    np.testing.assert_array_equal(a[k].sampling_logprobs, b[k].sampling_logprobs)


def test_allocated_cache_does_not_grow_with_requests(engine4, workload):
  prompts, max_new = workload
  before = engine4.cache_bytes
  shapes = [x.shape for x in engine4.pages]
  decodes = engine4.compile_counts["decode"]
  _run(engine4, _requests(prompts * 2, max_new * 2, temperature=1.0))
  assert engine4.cache_bytes == before == 64 * engine4.block_bytes
  assert [x.shape for x in engine4.pages] == shapes
  assert engine4.compile_counts["decode"] == decodes  # one decode program, whatever the stream


def test_samples_of_a_prompt_share_its_prefill(qwen3):
  engine = _engine(qwen3)
  prompt = list(range(1, 20))  # 18 cached tokens: two full blocks shared, the partial one copied
  engine.submit([sampling.Request(prompt=prompt, n=6, max_new_tokens=4, temperature=1.0)])
  out = list(engine.completions())
  assert engine.metrics.prefill_tokens == len(prompt) - 1  # prefilled once for 6 samples
  assert sorted(c.sample for c in out) == list(range(6))
  assert len({tuple(c.tokens) for c in out}) > 1


def test_completions_stream_as_rows_finish(engine4):
  reqs = [sampling.Request(prompt=[1, 2, 3], max_new_tokens=30, request_id=0, temperature=0.0),
          sampling.Request(prompt=[4, 5], max_new_tokens=2, request_id=1, temperature=0.0)]
  seen = []
  order = [c.request_id for c in _stream(engine4, reqs, seen)]
  assert order == [1, 0] and seen == [1, 0]
  assert engine4.metrics.time_to_first_token and engine4.stats()["tokens_per_s"] > 0


def _stream(engine, reqs, seen):
  engine.submit(reqs)
  return list(engine.completions(callback=lambda c: seen.append(c.request_id)))


def _perturbed(model, seed: int):
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)
  leaves = [np.asarray(x) * (1 + 0.3 * rng.standard_normal(x.shape)).astype(np.float32) for x in leaves]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in leaves]))


def test_interrupted_rows_carry_both_versions_and_their_logprobs(qwen3, engine4):
  new = _perturbed(qwen3, seed=1)
  prompts = [[5, 9, 17], [40, 41, 42], [7, 7, 8]]
  engine4.submit([sampling.Request(prompt=p, max_new_tokens=24, request_id=i, temperature=1.0, seed=2)
                  for i, p in enumerate(prompts)])
  for _ in range(2):
    engine4.step()
  engine4.update_weights(new, version=7)
  got = sorted(engine4.completions(), key=lambda c: c.request_id)
  engine4.update_weights(qwen3, version=0)  # the module's engine returns to the fixture weights
  assert engine4.metrics.interruptions >= 3
  prompt, tokens = np.stack([c.prompt for c in got]), np.stack([c.tokens for c in got])
  lp_old = recomputed_logprobs(qwen3, prompt, tokens, 1.0)
  lp_new = recomputed_logprobs(new, prompt, tokens, 1.0)
  for r, c in enumerate(got):
    cut = int(np.argmax(c.versions == 7))
    assert 0 < cut < len(c.tokens) and (c.versions[:cut] == 0).all() and (c.versions[cut:] == 7).all()
    np.testing.assert_allclose(c.logprobs[:cut], lp_old[r, :cut], atol=1e-5, rtol=0)
    np.testing.assert_allclose(c.logprobs[cut:], lp_new[r, cut:], atol=1e-5, rtol=0)
    assert np.abs(lp_new[r, cut:] - lp_old[r, cut:]).max() > 1e-2  # the weights really changed


def test_preemption_under_a_tiny_cache_completes_every_row_like_an_ample_one(qwen3, engine4, workload):
  prompts, max_new = workload
  reqs = _requests(prompts[:6], [30] * 6, temperature=1.0)
  ample = _run(engine4, reqs)
  tiny = _engine(qwen3, num_blocks=9)  # one row of max_len=64 needs 8 blocks (+1 look-ahead)
  got = _run(tiny, reqs)
  assert tiny.metrics.preemptions > 0
  assert got.keys() == ample.keys()
  for k in ample:
    assert got[k].finish_reason == "length" and len(got[k].tokens) == 30
    np.testing.assert_array_equal(got[k].tokens, ample[k].tokens)
    np.testing.assert_allclose(got[k].logprobs, ample[k].logprobs, atol=1e-5, rtol=0)


def test_chunked_prefill_is_bit_identical_to_whole_prefill(qwen3, engine4):
  """Prompts of 9..45 tokens (n=2: the second sample forks the chunk-prefilled blocks) prefilled in
  chunks of 1 block, 3 blocks (not a divisor of the 64-slot context) and whole."""
  rng = np.random.default_rng(3)
  reqs = [sampling.Request(prompt=rng.integers(0, 200, size=m).tolist(), n=2, max_new_tokens=6, request_id=i,
                           seed=4, temperature=1.0) for i, m in enumerate((9, 23, 37, 45))]
  calls = engine4.metrics.prefill_calls
  whole = _run(engine4, reqs)
  calls = engine4.metrics.prefill_calls - calls
  for chunk in (8, 24):
    engine = _engine(qwen3, prefill_chunk=chunk)
    got = _run(engine, reqs)
    assert engine.metrics.prefill_calls > calls
    assert got.keys() == whole.keys()
    for k in whole:
      np.testing.assert_array_equal(got[k].tokens, whole[k].tokens)
      np.testing.assert_array_equal(got[k].logprobs, whole[k].logprobs)


def test_long_prompt_prefill_interleaves_with_decode(qwen3):
  engine = _engine(qwen3, prefill_chunk=8, steps_per_call=1)
  engine.submit([sampling.Request(prompt=[1, 2, 3], max_new_tokens=30, request_id=0, temperature=0.0)])
  engine.step()
  engine.submit([sampling.Request(prompt=list(range(1, 50)), max_new_tokens=4, request_id=1, temperature=0.0)])
  made = []
  for _ in range(5):  # 48 cached tokens = 6 chunks: the short row decodes while the long prompt prefills
    before = engine.metrics.generated_tokens
    engine.step()
    assert engine.stats()["prefilling"] == 1 and engine.stats()["busy_slots"] == 1
    made.append(engine.metrics.generated_tokens - before)
  assert made == [1] * 5
  engine.step()  # the last chunk: the long row joins the decode call
  assert engine.stats()["prefilling"] == 0 and engine.stats()["busy_slots"] == 2
  out = {c.request_id: c for c in engine.completions()}
  ref = _run(_engine(qwen3), [sampling.Request(prompt=list(range(1, 50)), max_new_tokens=4, request_id=1,
                                               temperature=0.0)])
  np.testing.assert_array_equal(out[1].tokens, ref[(1, 0)].tokens)


def test_top_logprobs_and_entropy_equal_the_samplers_through_preemption(qwen3, qwen3_sampler, workload):
  """A tiny cache preempts rows, so their top-k and entropy columns go to the host and back."""
  prompts, _ = workload
  kw = dict(n=2, max_new_tokens=30, temperature=0.8, seed=6, return_top_logprobs=3, return_entropy=True)
  engine = _engine(qwen3, num_blocks=9, max_top_logprobs=5, entropy=True)
  got = engine.generate(prompts[:2], **kw)
  ref = qwen3_sampler.generate(prompts[:2], **kw)
  assert engine.metrics.preemptions > 0
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.top_logprobs.ids, ref.top_logprobs.ids)
  np.testing.assert_allclose(got.top_logprobs.logprobs, ref.top_logprobs.logprobs, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got.entropy, ref.entropy, atol=1e-5, rtol=0)
  assert got.top_logprobs.ids.shape == (4, 30, 3) and (got.entropy > 0).all()
  with pytest.raises(ValueError, match="max_top_logprobs"):
    engine.generate(prompts[:1], return_top_logprobs=6)


def test_serve_on_the_engine_returns_top_logprobs(qwen3, qwen3_tokenizer, qwen3_sampler):
  from fastapi.testclient import TestClient

  from jaxrl import serve
  engine = _engine(qwen3, max_top_logprobs=3)
  engine.tokenizer = qwen3_tokenizer
  app = serve.create_app(engine, qwen3_tokenizer, model_name="q", batch_wait_s=0.0)
  prompt = [5, 9, 17, 30, 2]
  with TestClient(app) as client:
    body = client.post("/v1/completions", json=dict(model="q", prompt=[prompt], max_tokens=8, temperature=0,
                                                     logprobs=3)).json()
    too_many = client.post("/v1/completions", json=dict(model="q", prompt=[prompt], max_tokens=2, logprobs=4))
  assert too_many.status_code == 400
  ref = qwen3_sampler.generate([prompt], max_new_tokens=8, temperature=0.0, return_top_logprobs=3)
  lp = body["choices"][0]["logprobs"]
  np.testing.assert_allclose(lp["token_logprobs"], ref.logprobs[0], atol=1e-5, rtol=0)
  for top, want in zip(lp["top_logprobs"], ref.top_logprobs.logprobs[0]):  # keyed by piece: ids may share one
    assert top and all(np.abs(want - v).min() <= 1e-5 for v in top.values())


def test_sharded_engine_equals_single_device(qwen3_tokenizer, engine4, workload):
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  model = models.load_pretrained(HF_FIXTURES / "qwen3", mesh=mesh, dtype="float32")
  engine = sampling.Engine(model, qwen3_tokenizer, mesh=mesh, num_slots=8, max_len=64, block_size=8,
                           num_blocks=64, eos_token_ids=[])
  prompts, max_new = workload
  reqs = _requests(prompts[:8], max_new[:8], temperature=1.0)
  got, ref = _run(engine, reqs), _run(engine4, reqs)
  for k in ref:
    np.testing.assert_array_equal(got[k].tokens, ref[k].tokens)
    np.testing.assert_allclose(got[k].logprobs, ref[k].logprobs, atol=1e-5, rtol=0)
  spec = tuple(engine.pages[0].sharding.spec) + (None,) * 5
  assert spec[:5] == (None, "data", None, "tensor", None)
  assert tuple(engine.slots.tokens.sharding.spec)[0] == "data"


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=5), "cannot hold one row"),
    (dict(num_blocks=None), "exactly one of"),
    (dict(kv_cache_bytes=100, num_blocks=None), "cannot hold one row"),
    (dict(num_slots=0), "num_slots"),
    (dict(paged_impl="cudnn"), "paged_impl"),
    (dict(prefill_chunk=12), "prefill_chunk"),
])
def test_bad_engine_arguments_raise_clear_errors(qwen3, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _engine(qwen3, **kwargs)


def test_bad_requests_raise_clear_errors(engine4):
  with pytest.raises(ValueError, match="max_new_tokens"):
    engine4.submit([sampling.Request(prompt=[1, 2], max_new_tokens=0)])
  with pytest.raises(ValueError, match="max_len"):
    engine4.submit([sampling.Request(prompt=list(range(64)))])
  with pytest.raises(ValueError, match="Sampler-only"):
    engine4.generate([[1, 2]], max_steps=2)
  with pytest.raises(ValueError, match="entropy"):
    engine4.generate([[1, 2]], return_entropy=True)
  with pytest.raises(ValueError, match="top_logprobs"):
    engine4.submit([sampling.Request(prompt=[1, 2], top_logprobs=1)])
  assert engine4.idle


def test_paged_sampler_generate_keeps_the_samplers_contract(qwen3, qwen3_tokenizer, qwen3_sampler, qwen3_reference):
  """Sampler(paged=True).generate runs on an engine sized to the call: same rows, draws, padding, eos/stop
  handling, log-probs, top-logprobs and entropy as the whole-batch path; resumable calls keep that path."""
  paged = sampling.Sampler(qwen3, qwen3_tokenizer, max_len=64, eos_token_ids=[], paged=True)
  out = paged.generate(qwen3_reference["prompt"], max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, qwen3_reference["tokens"])
  assert paged.compile_counts["install"] >= 1  # it ran on the engine
  stop = int(qwen3_reference["tokens"][0, 4])
  prompts = [[5, 9, 17], list(range(1, 12)), [40, 41]]
  kw = dict(n=2, max_new_tokens=13, temperature=[0.0, 1.0, 0.7], top_p=0.9, seed=3, request_ids=[7, 8, 9],
            stop_token_ids=[stop], return_top_logprobs=2, return_entropy=True)
  got, ref = paged.generate(prompts, **kw), qwen3_sampler.generate(prompts, **kw)
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.lengths, ref.lengths)
  assert got.finish_reason == ref.finish_reason and got.texts == ref.texts and got.state is None
  for name in ("prompt_lengths", "prompt_index", "versions"):
    np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
  for a, b in ((got.logprobs, ref.logprobs), (got.sampling_logprobs, ref.sampling_logprobs), (got.entropy, ref.entropy),
               (got.top_logprobs.logprobs, ref.top_logprobs.logprobs)):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(got.top_logprobs.ids, ref.top_logprobs.ids)
  part = paged.generate(prompts, max_new_tokens=8, temperature=1.0, max_steps=3)  # the whole-batch path
  assert part.state is not None and part.lengths.tolist() == [3] * 3


def test_prefill_context_is_capped_at_the_rows_blocks(qwen3):
  """A prefill's context is the power-of-two bucket capped at ``max_blocks`` blocks: a 34-token prompt
  at ``max_len`` 40 runs over 40 slots (5 blocks), not 64, and still decodes the sampler's tokens."""
  from jaxrl.sampling._engine_programs import context_bucket
  assert [context_bucket(n, 8, 16, 2176) for n in (5, 1000, 34_814)] == [16, 1024, 34_816]
  engine = _engine(qwen3, num_slots=2, max_len=40, num_blocks=16)
  prompt = np.random.default_rng(1).integers(0, 200, size=34).tolist()
  calls = []
  prefill = engine._programs.prefill
  engine._programs.prefill = lambda *a: calls.append(a[4].shape) or prefill(*a)
  out = engine.generate([prompt], max_new_tokens=6, temperature=0.0)
  ref = sampling.Sampler(qwen3, None, max_len=40, eos_token_ids=[]).generate([prompt], max_new_tokens=6,
                                                                             temperature=0.0)
  assert calls == [(1, 5)]  # tables [rows, 40 / 8 blocks]
  np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_paged_sampler_second_call_with_the_same_shapes_compiles_nothing(qwen3):
  """``Sampler(paged=True)`` sizes an engine to each call; a second call with the same shapes (other
  prompts and draws) finds that engine's programs compiled and traces no program again."""
  paged = sampling.Sampler(qwen3, None, max_len=64, eos_token_ids=[], paged=True)
  kw = dict(n=2, max_new_tokens=9, temperature=1.0, return_top_logprobs=1)
  paged.generate([[3, 4, 5], [6, 7]], seed=1, **kw)
  first = dict(paged.compile_counts)
  assert first["decode"] >= 1 and first["install"] >= 1
  out = paged.generate([[8, 9, 10], [11, 12]], seed=2, **kw)
  assert out.lengths.tolist() == [9] * 4
  assert dict(paged.compile_counts) == first


@pytest.mark.parametrize("platform, unstacked", [("cpu", True), ("tpu", False), ("gpu", False)])
def test_engine_unstacks_the_layers_only_when_compiling_for_cpu(qwen3, platform, unstacked):
  """``unstack_layers``' default follows the platform compiled for (``compiling_for``: a plan's target), not
  this CPU host: a scanned model keeps its stacked layers for TPU and GPU, as the engine there holds them."""
  assert qwen3.cfg.scan_layers
  with compiling_for(platform):
    engine = _engine(qwen3)
  assert engine.unstack_layers is unstacked
  assert nnx.merge(engine.graphdef, engine.params).cfg.scan_layers is not unstacked
