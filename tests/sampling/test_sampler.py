"""Sampler: HF greedy parity, log-prob contract, sharding, interrupt/resume, fork, buckets, bad input."""

import jax
import numpy as np
import pytest
from flax import nnx
from sampling_testlib import FIXTURE_NAMES, HF_FIXTURES, recomputed_log_softmax, recomputed_logprobs

from jaxrl import _host_memory, models, sampling, sharding
from jaxrl._compile_target import compiling_for

NEW = 16  # the reference's new tokens


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_matches_hf_generate(name, fixture_models):
  ref = np.load(HF_FIXTURES / name / "generate.npz")
  sampler = sampling.Sampler(fixture_models[name], None, max_len=64, eos_token_ids=[])
  out = sampler.generate(ref["prompt"], max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, ref["tokens"])
  assert out.finish_reason == ["length"] * len(ref["prompt"])
  np.testing.assert_array_equal(out.lengths, [NEW] * len(ref["prompt"]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_recompute(temperature, qwen3_sampler, qwen3_reference, fixture_models):
  prompt = qwen3_reference["prompt"]
  out = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=temperature, seed=5)
  expected = recomputed_logprobs(fixture_models["qwen3"], prompt, out.tokens, temperature)
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
  # Without truncation the sampled distribution is the full one.
  np.testing.assert_allclose(out.sampling_logprobs, out.logprobs, atol=1e-5, rtol=0)


def test_sampling_logprobs_are_renormalised_under_top_p(qwen3_sampler, qwen3_reference, fixture_models):
  prompt = qwen3_reference["prompt"]
  out = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=1.0, top_p=0.5, seed=2)
  full = recomputed_log_softmax(fixture_models["qwen3"], prompt, out.tokens, 1.0)  # [B, G, V]
  np.testing.assert_allclose(out.logprobs, np.take_along_axis(full, out.tokens[..., None], -1)[..., 0],
                             atol=1e-5, rtol=0)
  # Kept set: smallest descending prefix with mass >= 0.5; its log-mass renormalises.
  p = np.exp(full.astype(np.float64))
  order = np.sort(p, axis=-1)[..., ::-1]
  cum = np.cumsum(order, axis=-1)
  kept = np.argmax(cum >= 0.5 * cum[..., -1:], axis=-1)
  mass = np.take_along_axis(cum, kept[..., None], -1)[..., 0]
  np.testing.assert_allclose(out.sampling_logprobs, out.logprobs - np.log(mass), atol=1e-5, rtol=0)


def test_top_logprobs_and_entropy_match_recompute(qwen3_sampler, qwen3_reference, fixture_models):
  prompt = qwen3_reference["prompt"]
  out = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0, return_top_logprobs=3,
                               return_entropy=True)
  full = recomputed_log_softmax(fixture_models["qwen3"], prompt, out.tokens, 1.0)
  np.testing.assert_array_equal(out.top_logprobs.ids[..., 0], out.tokens)
  np.testing.assert_allclose(out.top_logprobs.logprobs, np.sort(full, axis=-1)[..., ::-1][..., :3], atol=1e-5)
  np.testing.assert_allclose(out.entropy, -(np.exp(full) * full).sum(-1), atol=1e-5)


def test_sharded_sampling_equals_single_device(qwen3_sampler, qwen3_tokenizer):
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  model = models.load_pretrained(HF_FIXTURES / "qwen3", mesh=mesh, dtype="float32")
  sharded = sampling.Sampler(model, qwen3_tokenizer, mesh=mesh, max_len=64, eos_token_ids=[])
  prompts = [[5, 9, 17], [40, 41, 42, 43, 44]]
  kw = dict(n=2, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11, return_state=True)
  out = sharded.generate(prompts, **kw)
  ref = qwen3_sampler.generate(prompts, **kw)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
  assert _spec(out.state.rows.cache.k) == (None, "data", None, "tensor", None)
  assert _spec(out.state.rows.tokens) == ("data", None)


def _spec(x: jax.Array) -> tuple:
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def test_interrupt_resume_same_weights_equals_uninterrupted(qwen3_sampler, qwen3_reference):
  prompt = qwen3_reference["prompt"]
  kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3)
  full = qwen3_sampler.generate(prompt, **kw)
  part = qwen3_sampler.generate(prompt, **kw, max_steps=5)
  assert part.finish_reason == ["interrupted"] * 2 and part.lengths.tolist() == [5, 5]
  part = qwen3_sampler.resume(part.state, max_steps=4)
  assert part.lengths.tolist() == [9, 9]
  done = qwen3_sampler.resume(part.state)
  assert done.state is None
  np.testing.assert_array_equal(done.tokens, full.tokens)
  np.testing.assert_array_equal(done.logprobs, full.logprobs)
  np.testing.assert_array_equal(done.versions, np.zeros_like(full.versions))
  assert done.finish_reason == full.finish_reason


def _perturbed(model, seed: int):
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)
  leaves = [np.asarray(x) * (1 + 0.3 * rng.standard_normal(x.shape)).astype(np.float32) for x in leaves]
  placed = [jax.device_put(x, old.sharding) for x, old in zip(leaves, jax.tree.leaves(state))]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, placed))


def test_resume_with_new_weights_records_versions_and_recomputes_cache(fixture_models, qwen3_tokenizer,
                                                                        qwen3_reference):
  old = fixture_models["qwen3"]
  new = _perturbed(old, seed=1)
  sampler = sampling.Sampler(old, qwen3_tokenizer, max_len=64, eos_token_ids=[], version=3)
  prompt = qwen3_reference["prompt"]
  part = sampler.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=4, max_steps=5)
  out = sampler.resume(part.state, new_model=new, version=7)
  assert sampler.version == 7
  np.testing.assert_array_equal(out.versions[:, :5], 3)
  np.testing.assert_array_equal(out.versions[:, 5:], 7)
  np.testing.assert_array_equal(out.tokens[:, :5], part.tokens[:, :5])
  lp_old = recomputed_logprobs(old, prompt, out.tokens, 1.0)
  lp_new = recomputed_logprobs(new, prompt, out.tokens, 1.0)
  np.testing.assert_allclose(out.logprobs[:, :5], lp_old[:, :5], atol=1e-5, rtol=0)
  np.testing.assert_allclose(out.logprobs[:, 5:], lp_new[:, 5:], atol=1e-5, rtol=0)
  assert np.abs(lp_new[:, 5:] - lp_old[:, 5:]).max() > 1e-2  # the weights really changed


def test_released_weights_are_refused_until_set_weights_and_the_copy_shares_the_embedding(
    fixture_models, qwen3_reference, monkeypatch):
  """The memory contract (issue 34): the unstacked sampling copy shares the source's non-layer arrays (the
  embedding is not copied), release_weights drops the copy (generate then refuses) and set_weights gives
  the sampler the same tokens as before."""
  model = fixture_models["qwen3"]
  assert model.cfg.scan_layers
  sampler = sampling.Sampler(model, None, max_len=64, eos_token_ids=[], unstack_layers=True)
  assert sampler.params["embed"].get_value() is model.embed.get_value()  # shared, not copied
  prompt = qwen3_reference["prompt"]
  before = sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0)
  source = jax.tree.leaves(nnx.state(model))
  copies = [x for x in jax.tree.leaves(sampler.params) if not any(x is y for y in source)]
  assert len(copies) == model.cfg.num_layers * len(jax.tree.leaves(nnx.state(model.layers)))
  assert sampler.copied_bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.layers))) > 0
  trims = []
  monkeypatch.setattr(_host_memory, "trim", lambda: trims.append(1) or True)
  sampler.release_weights()
  assert sampler.params is None and sampler.copied_bytes == 0
  assert all(x.is_deleted() for x in copies)  # the per-layer copies are freed at once, not by the GC
  assert trims == [1]  # and their pages handed back to the OS (tests/test_host_memory.py)
  sampler.release_weights()
  assert trims == [1]  # nothing more was freed: no second trim
  assert not any(x.is_deleted() for x in source)  # the caller's arrays are not touched
  with pytest.raises(RuntimeError, match="release_weights"):
    sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0)
  sampler.set_weights(model, version=2)
  after = sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(after.tokens, before.tokens)
  np.testing.assert_array_equal(after.tokens, qwen3_reference["tokens"])
  np.testing.assert_array_equal(after.versions[after.versions >= 0], 2)
  with pytest.raises(ValueError, match="structure differs"):
    sampler.set_weights(sampling.unstack_layers(model))
  flat = sampling.unstack_layers(model)  # a model with per-layer weights is read in place: nothing copied
  assert sampling.Sampler(flat, None, max_len=64, eos_token_ids=[], unstack_layers=True).copied_bytes == 0


def test_fork_continues_k_samples_from_shared_prefix(qwen3_sampler, qwen3_reference, fixture_models):
  prompt = qwen3_reference["prompt"]
  part = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=6, max_steps=5)
  recomputes = qwen3_sampler.compile_counts["recompute"]
  branches = qwen3_sampler.fork(part.state, rows=[1, 0], k=2)
  out = qwen3_sampler.resume(branches)
  assert qwen3_sampler.compile_counts["recompute"] == recomputes
  np.testing.assert_array_equal(out.prompt_index, [1, 1, 0, 0])
  np.testing.assert_array_equal(out.tokens[:, :5], part.tokens[[1, 1, 0, 0], :5])
  assert (out.tokens[0, 5:] != out.tokens[1, 5:]).any() and (out.tokens[2, 5:] != out.tokens[3, 5:]).any()
  expected = recomputed_logprobs(fixture_models["qwen3"], prompt[[1, 1, 0, 0]], out.tokens, 1.0)
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
  # The parent state is still usable after forking.
  assert qwen3_sampler.resume(part.state).lengths.tolist() == [NEW, NEW]


def test_stream_of_mixed_requests_compiles_once_per_bucket(qwen3_sampler):
  rng = np.random.default_rng(0)
  requests = []
  for _ in range(50):
    lens = rng.integers(1, 17, size=2)
    requests.append(dict(
        prompts=[rng.integers(0, 200, size=int(n)).tolist() for n in lens],
        max_new_tokens=int(rng.integers(9, 17)), temperature=rng.uniform(0.0, 1.5, size=2).tolist(),
        top_p=float(rng.uniform(0.1, 1.0)), top_k=int(rng.integers(0, 50)), seed=int(rng.integers(100))))
  buckets = {(sampling.length_bucket(max(len(p) for p in r["prompts"])), sampling.length_bucket(r["max_new_tokens"]))
             for r in requests}
  before = dict(qwen3_sampler.compile_counts)
  for r in requests:
    out = qwen3_sampler.generate(**r)
    assert out.lengths.tolist() == [r["max_new_tokens"]] * 2
  counts = qwen3_sampler.compile_counts
  for program in ("prefill", "decode"):
    assert counts[program] - before.get(program, 0) <= len(buckets), (program, buckets)
  after = dict(counts)
  for r in requests[:10]:
    qwen3_sampler.generate(**r)
  assert dict(qwen3_sampler.compile_counts) == after


def test_eos_and_stop_tokens_end_completions(qwen3_sampler, qwen3_reference, fixture_models, qwen3_tokenizer):
  prompt, ref = qwen3_reference["prompt"], qwen3_reference["tokens"]
  stop = int(ref[0, 4])
  out = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0, stop_token_ids=[stop])
  for i in range(2):
    hits = np.flatnonzero(ref[i] == stop)
    end = hits[0] + 1 if len(hits) else NEW
    assert out.lengths[i] == end
    assert out.finish_reason[i] == ("stop" if len(hits) else "length")
    np.testing.assert_array_equal(out.tokens[i, :end], ref[i, :end])
    assert (out.tokens[i, end:] == qwen3_sampler.pad_token_id).all()
    assert (out.logprobs[i, end:] == 0).all()
  with_eos = sampling.Sampler(fixture_models["qwen3"], qwen3_tokenizer, max_len=64, eos_token_ids=[stop])
  out = with_eos.generate(prompt, max_new_tokens=NEW, temperature=0.0)
  assert out.finish_reason[0] == "eos" and out.lengths[0] == np.flatnonzero(ref[0] == stop)[0] + 1


def test_stop_string_truncates_after_the_completing_token(qwen3_sampler, qwen3_reference, qwen3_tokenizer):
  prompt, ref = qwen3_reference["prompt"], qwen3_reference["tokens"]
  text = qwen3_tokenizer.decode(ref[0].tolist(), skip_special_tokens=False)
  target = text[len(text) // 3:len(text) // 3 + 3]
  end = next(k for k in range(1, NEW + 1)
             if target in qwen3_tokenizer.decode(ref[0, :k].tolist(), skip_special_tokens=False))
  out = qwen3_sampler.generate(prompt, max_new_tokens=NEW, temperature=0.0, stop_strings=[target])
  assert out.finish_reason[0] == "stop" and out.lengths[0] == end
  assert target in qwen3_tokenizer.decode(out.tokens[0, :end].tolist(), skip_special_tokens=False)


def test_per_prompt_parameters_apply_to_their_rows(qwen3_sampler, qwen3_reference):
  prompt, ref = qwen3_reference["prompt"], qwen3_reference["tokens"]
  out = qwen3_sampler.generate(prompt, n=2, max_new_tokens=NEW, temperature=[0.0, 1.0], seed=1)
  np.testing.assert_array_equal(out.prompt_index, [0, 0, 1, 1])
  np.testing.assert_array_equal(out.tokens[:2], ref[[0, 0]])  # prompt 0 greedy: both samples
  np.testing.assert_array_equal(out.sampling_logprobs[:2], 0.0)
  assert (out.tokens[2] != out.tokens[3]).any()  # prompt 1 sampled: its two rows draw independently


def test_rows_do_not_depend_on_their_slot(qwen3_sampler):
  a, b = [3, 4, 5, 6], [9, 8, 7]
  together = qwen3_sampler.generate([a, b], max_new_tokens=10, temperature=1.0, seed=9, request_ids=[10, 11])
  alone = qwen3_sampler.generate([b, a], max_new_tokens=10, temperature=1.0, seed=9, request_ids=[11, 10])
  np.testing.assert_array_equal(together.tokens, alone.tokens[::-1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[""]), "empty"),
    (dict(prompts=[list(range(64))]), "max_len"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(stop_token_ids=["<|no-such-token|>"]), "not a token"),
    (dict(stop_token_ids=[10**6]), "not a token id"),
    (dict(prompts=[[1, 999]]), "outside"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=[1, 2, 3]), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n:"),
    (dict(stop_strings=[""]), "stop_strings"),
])
def test_bad_input_raises_clear_error(kwargs, match, qwen3_sampler):
  args = dict(prompts=[[1, 2], [3]], max_new_tokens=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    qwen3_sampler.generate(args.pop("prompts"), **args)


def test_resumed_state_cannot_be_resumed_twice(qwen3_sampler):
  part = qwen3_sampler.generate([[1, 2, 3], [4]], max_new_tokens=NEW, temperature=1.0, max_steps=2)
  qwen3_sampler.resume(part.state)
  with pytest.raises(ValueError, match="already resumed"):
    qwen3_sampler.resume(part.state)


def test_completion_is_cut_at_max_len(fixture_models):
  sampler = sampling.Sampler(fixture_models["qwen3"], None, max_len=20, eos_token_ids=[])
  out = sampler.generate([list(range(15)), [1, 2]], max_new_tokens=NEW, temperature=0.0)
  assert out.lengths.tolist() == [5, NEW] and out.finish_reason == ["length", "length"]


def test_model_cache_path_with_scanned_layers_matches_hf(fixture_models, qwen3_reference):
  sampler = sampling.Sampler(fixture_models["qwen3"], None, max_len=64, eos_token_ids=[], decode_impl="model",
                             unstack_layers=False)
  out = sampler.generate(qwen3_reference["prompt"], max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, qwen3_reference["tokens"])


@pytest.mark.parametrize("decode_impl", ["kernel", "model"])
def test_unmerged_lora_adapters_sample_like_their_merged_weights(decode_impl, qwen3_reference):
  """Both decode paths add s·(x·A)·B of every adapter (attention and MLP): the same tokens and
  log-probs as the merged model, and different ones from the base alone."""
  base = models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32")
  adapted = models.apply_lora(models.load_pretrained(HF_FIXTURES / "qwen3", dtype="float32"),
                              models.LoraConfig(rank=4, alpha=32), seed=0)
  graphdef, adapters, frozen = models.split_lora(adapted)
  rng = np.random.default_rng(0)
  adapters = nnx.map_state(lambda path, v: v.replace(jax.numpy.asarray(rng.normal(0.0, 0.05, v.shape), v.dtype))
                           if str(path[-1]).endswith("_lora_b") else v, adapters)
  adapted = nnx.merge(graphdef, adapters, frozen)
  prompt = qwen3_reference["prompt"]
  runs = {}
  for name, model in [("lora", adapted), ("merged", models.merged_base(adapted)), ("base", base)]:
    sampler = sampling.Sampler(model, None, max_len=64, eos_token_ids=[], decode_impl=decode_impl)
    runs[name] = sampler.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=3)
  np.testing.assert_array_equal(runs["lora"].tokens, runs["merged"].tokens)
  np.testing.assert_allclose(runs["lora"].logprobs, runs["merged"].logprobs, atol=1e-5, rtol=0)
  np.testing.assert_allclose(runs["lora"].logprobs, recomputed_logprobs(adapted, prompt, runs["lora"].tokens, 1.0),
                             atol=1e-5, rtol=0)
  assert not np.array_equal(runs["lora"].tokens, runs["base"].tokens)


@pytest.mark.parametrize("platform, unstacked", [("cpu", True), ("tpu", False), ("gpu", False)])
def test_sampler_unstacks_the_layers_only_when_compiling_for_cpu(fixture_models, platform, unstacked):
  """``unstack_layers``' default follows the platform compiled for (``compiling_for``), not this CPU host."""
  model = fixture_models["qwen3"]
  assert model.cfg.scan_layers
  with compiling_for(platform):
    sampler = sampling.Sampler(model, None, max_len=64, eos_token_ids=[])
  assert sampler.unstack_layers is unstacked
  assert nnx.merge(sampler.graphdef, sampler.params).cfg.scan_layers is not unstacked
