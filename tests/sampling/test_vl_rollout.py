"""RL prompts with images: JSONL records in the VL chat format -> prompt ids and images -> the sampler -> the
rollout's trainer arrays (M-RoPE positions, pixels), checked against a teacher-forced forward over them.

The reference is the model's own forward over ``sequence_fields``' arrays (tokens, ``rope_positions``, the
prompt's pixels through :func:`jaxrl.models.batch_vision_inputs`): the trainer's view of the rollout must give
the sampler's log-probs (the rollout-vs-actor contract of issue 30).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
from sampling_testlib import HF_FIXTURES
from vl_testlib import vl_model

from jaxrl import data, models, rl, sampling

KIND = "qwen2_5_vl"


def _records(tmp_path) -> list[dict]:
  """Three prompt records: an image part, a top-level ``images`` list with an ``<image>`` marker, text only."""
  raw = np.load(HF_FIXTURES / KIND / "vision.npz")
  for k in (0, 2):
    Image.fromarray(raw[f"images_{k}"]).save(tmp_path / f"img{k}.png")
  lines = [
      {"prompt": [{"role": "user", "content": [{"type": "image", "image": "img2.png"},
                                               {"type": "text", "text": "how many?"}]}], "answer": "3"},
      {"prompt": "<image> what colour?", "images": ["img0.png"], "answer": "red"},
      {"prompt": "one plus one", "answer": "2"},
  ]
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  return rl.read_records([str(path)])


def test_image_prompts_flow_to_the_sampler_and_the_trainer_sees_the_same_inputs(tmp_path):
  model = vl_model(KIND)
  tokenizer = models.load_tokenizer(HF_FIXTURES / KIND)
  images = data.ImageConfig.from_hf(HF_FIXTURES / KIND, min_pixels=3136, max_pixels=50176)
  records = _records(tmp_path)
  prompts = rl.EncodedPrompts(records, tokenizer, max_tokens=200, images=images)
  assert prompts.has_images and prompts.with_images == [True, True, False]
  first = data.encode_vl_prompt(tokenizer, records[0], images=images, image_root=tmp_path)
  np.testing.assert_array_equal(prompts.ids[0], first["tokens"])
  np.testing.assert_array_equal(prompts.images(0)["pixel_values"], first["pixel_values"])
  assert rl.reward_fields(records[1]) == {"answer": "red"}  # images are prompt, not reward input

  n = 2
  imgs = [prompts.images(i) for i in range(3)]
  sampler = sampling.Sampler(model, tokenizer, max_len=160, eos_token_ids=[])
  out = sampler.generate([x.tolist() for x in prompts.ids], images=imgs, n=n, max_new_tokens=6, temperature=1.0,
                         seed=3)
  ids = [prompts.ids[i] for i in range(3) for _ in range(n)]
  rollout = rl.Rollout(prompt_ids=tuple(ids), tokens=out.tokens, logprobs=out.logprobs, lengths=out.lengths,
                       truncated=np.zeros(6, bool), group_ids=np.repeat(np.arange(3, dtype=np.int32), n),
                       rewards=np.zeros(6, np.float32), task_rewards=np.zeros(6, np.float32), texts=tuple(out.texts),
                       **rl.vision_fields(model.cfg, ids, [x for x in imgs for _ in range(n)]))
  rollout = rl.concat_rollouts([rollout.select_groups(np.array([2, 0])), rollout.select_groups(np.array([1]))])
  fields = rl.sequence_fields(rollout, np.ones(out.tokens.shape, np.float32), rollout.response_mask())
  for i, f in enumerate(fields):
    seq_rope = f["rope_positions"]
    assert seq_rope.shape == (len(f["tokens"]), 3)
    assert ("pixel_values" in f) == (rollout.prompt_images[i] is not None)
    np.testing.assert_allclose(_trainer_logprobs(model, f), f["sampler_logprobs"][f["loss_mask"] > 0],
                               rtol=0, atol=2e-5)


def _trainer_logprobs(model, f: dict) -> np.ndarray:
  """Log-probs of the response targets from one forward over the sample's trainer arrays."""
  tokens = jnp.asarray(f["tokens"])[None]
  t = tokens.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  kw = {}
  if "pixel_values" in f:
    grid = f["grid_thw"]
    vis = models.batch_vision_inputs(f["pixel_values"][None], grid, np.zeros(len(grid)), model.cfg.vision)
    embeds, mask = model.embed_images(tokens, jax.tree.map(jnp.asarray, vis))
    prompt_len = int(np.argmax(f["loss_mask"] > 0))  # response targets start at P - 1: prompt tokens < P
    kw = dict(embeds=embeds, embeds_mask=mask & (pos <= prompt_len))
  logits = model(tokens, positions=pos, segment_ids=jnp.ones_like(tokens), rope_positions=jnp.asarray(f["rope_positions"])[None],
                 **kw)
  lp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
  keep = f["loss_mask"] > 0
  return np.take_along_axis(lp[keep], f["targets"][keep][:, None].astype(np.int64), axis=-1)[:, 0]
