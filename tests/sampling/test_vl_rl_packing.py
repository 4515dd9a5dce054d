"""The rollout-vs-trainer contract of a VLM RL run (issue 31): a rollout sampled with images, packed by the RL
packer (:func:`jaxrl.rl.pack_sequences`, several samples per row), gives the trainer the sampler's log-probs,
both through :func:`jaxrl.rl.policy_logprobs` and through the pi_old/reference program
(:func:`jaxrl.rl.make_logprob_program`). The reference is the sampler's own per-token log-probs; the test also
checks that the batch without its images, or without its M-RoPE positions, does NOT give them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sampling_testlib import HF_FIXTURES
from test_vl_rollout import KIND, _records
from vl_testlib import vl_model

from jaxrl import data, models, rl, sampling
from jaxrl.rl._async_rollout import Group, groups_to_rollout


def _rollout(tmp_path, *, fields: bool = True):
  model = vl_model(KIND)
  tokenizer = models.load_tokenizer(HF_FIXTURES / KIND)
  images = data.ImageConfig.from_hf(HF_FIXTURES / KIND, min_pixels=3136, max_pixels=50176)
  prompts = rl.EncodedPrompts(_records(tmp_path), tokenizer, max_tokens=200, images=images)
  n = 2
  imgs = [prompts.images(i) for i in range(3)]
  out = sampling.Sampler(model, tokenizer, max_len=160, eos_token_ids=[]).generate(
      [x.tolist() for x in prompts.ids], images=imgs, n=n, max_new_tokens=6, temperature=1.0, seed=5)
  ids = [prompts.ids[i] for i in range(3) for _ in range(n)]
  rollout = rl.Rollout(prompt_ids=tuple(ids), tokens=out.tokens, logprobs=out.logprobs, lengths=out.lengths,
                       truncated=np.zeros(6, bool), group_ids=np.repeat(np.arange(3, dtype=np.int32), n),
                       rewards=np.zeros(6, np.float32), task_rewards=np.zeros(6, np.float32), texts=tuple(out.texts),
                       **rl.vision_fields(model.cfg, ids, [x for x in imgs for _ in range(n)]))
  if not fields:
    return model, tokenizer, prompts, out
  return model, rl.sequence_fields(rollout, np.ones(out.tokens.shape, np.float32), rollout.response_mask())


def _logprobs(graphdef, params, batch: dict) -> np.ndarray:  # [M·R, T] over the interleaved rows
  lp = rl.policy_logprobs(graphdef, params, jax.tree.map(jnp.asarray, batch), temperature=1.0, chunk_size=64)
  return np.asarray(lp)


def test_packed_vlm_rollout_gives_the_sampler_logprobs(tmp_path):
  model, seqs = _rollout(tmp_path)
  row_len = max(len(s["tokens"]) for s in seqs) * 2  # two or more samples share a row
  pb = rl.pack_sequences(seqs, row_len=row_len, rows=2, vision=model.cfg.vision)
  assert any(len(row) > 1 and any("pixel_values" in seqs[i] for i in row) for micro in pb.assignment for row in micro)
  batch = pb.interleaved()
  m = pb.shape[0]
  assert batch["rope_positions"].shape == (*batch["tokens"].shape, 3)
  assert batch["pixel_values"].shape[:1] == batch["tokens"].shape[:1]
  keep = batch["loss_mask"] > 0
  want = batch["sampler_logprobs"][keep]
  graphdef, params = nnx.split(model)
  np.testing.assert_allclose(_logprobs(graphdef, params, batch)[keep], want, rtol=0, atol=2e-5)

  fn = rl.make_logprob_fn(graphdef, temperature=1.0, chunk_size=64)
  program = rl.make_logprob_program(fn, m, mesh=None, batch_sharding=None)
  np.testing.assert_allclose(np.asarray(program(params, jax.tree.map(jnp.asarray, batch)))[keep], want,
                             rtol=0, atol=2e-5)

  text_only = {k: v for k, v in batch.items() if k not in ("pixel_values", *models.VISION_LAYOUT_KEYS)}
  no_rope = {k: v for k, v in batch.items() if k != "rope_positions"}
  for broken in (text_only, no_rope):
    assert np.abs(_logprobs(graphdef, params, broken)[keep] - want).max() > 1e-3
    assert np.abs(np.asarray(program(params, jax.tree.map(jnp.asarray, broken)))[keep] - want).max() > 1e-3


def test_a_sampled_image_pad_in_a_response_stays_text(tmp_path):
  """Only the prompts' image tokens take image embeddings (the batch's ``image_token_mask``): a response token
  equal to ``<|image_pad|>`` in a row BEFORE another image sample must not shift that sample's images; that
  sample keeps the sampler's log-probs, and does not without the mask."""
  model, seqs = _rollout(tmp_path)
  first, second = [i for i, s in enumerate(seqs) if "pixel_values" in s][:2]
  row_len = len(seqs[first]["tokens"]) + len(seqs[second]["tokens"])
  pair = [dict(seqs[first]), seqs[second]]
  order = rl.assign_micro_batches([len(s["tokens"]) for s in pair], row_len=row_len, rows=1)[0][0]
  lead = pair[order[0]]
  lead["tokens"] = lead["tokens"].copy()
  lead["tokens"][-1] = model.cfg.image_token_id  # the last input token: a sampled response token
  pb = rl.pack_sequences(pair, row_len=row_len, rows=1, vision=model.cfg.vision)
  batch = pb.interleaved()
  graphdef, params = nnx.split(model)
  keep = (batch["loss_mask"] > 0) & (batch["segment_ids"] == 2)  # the second sample of the row
  np.testing.assert_allclose(_logprobs(graphdef, params, batch)[keep], batch["sampler_logprobs"][keep],
                             rtol=0, atol=2e-5)
  del batch["image_token_mask"]
  assert np.abs(_logprobs(graphdef, params, batch)[keep] - batch["sampler_logprobs"][keep]).max() > 1e-3


class _Completion:
  def __init__(self, tokens, logprobs):
    self.tokens, self.logprobs = tokens, logprobs
    self.versions, self.finish_reason = np.zeros(len(tokens), np.int64), "length"


def test_the_async_rollout_carries_the_images(tmp_path):
  """``groups_to_rollout`` (the async trainer's batch) with the prompts' images gives the same trainer batch
  contract: packed, its log-probs are the sampler's; without ``images`` it is text-only and they are not."""
  model, tokenizer, prompts, out = _rollout(tmp_path, fields=False)
  groups = [Group(index=g, prompt=g, request_id=g, version=0, n=2, rewards=np.zeros(2, np.float32),
                  completions={s: _Completion(out.tokens[2 * g + s, :out.lengths[2 * g + s]],
                                              out.logprobs[2 * g + s, :out.lengths[2 * g + s]]) for s in range(2)})
            for g in range(3)]
  graphdef, params = nnx.split(model)
  errors = []
  for kw in ({"images": prompts.images, "model_cfg": model.cfg}, {}):
    ro, _ = groups_to_rollout(groups, prompts.ids, max_new=out.tokens.shape[1], tokenizer=tokenizer, **kw)
    seqs = rl.sequence_fields(ro, np.ones(ro.tokens.shape, np.float32), ro.response_mask())
    pb = rl.pack_sequences(seqs, row_len=max(len(s["tokens"]) for s in seqs) * 2, rows=2, vision=model.cfg.vision)
    batch = pb.interleaved()
    keep = batch["loss_mask"] > 0
    errors.append(np.abs(_logprobs(graphdef, params, batch)[keep] - batch["sampler_logprobs"][keep]).max())
  assert errors[0] <= 2e-5 and errors[1] > 1e-3
