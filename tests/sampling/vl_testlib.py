"""Helpers of the VLM sampler and engine tests: the transformers fixtures' prompts with images, a teacher-forced
forward with M-RoPE positions, and a count of vision-tower runs."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sampling_testlib import HF_FIXTURES

from jaxrl import models

KINDS = ("qwen2_5_vl", "qwen2_vl")


@functools.lru_cache(maxsize=4)
def vl_model(kind: str):
  """The transformers fixture VLM of ``kind`` in float32 (its references ran bf16 weights upcast)."""
  return models.load_pretrained(HF_FIXTURES / kind, dtype="float32")


def generate_reference(kind: str) -> dict:
  """``generate.npz``: one image prompt, transformers' greedy tokens and per-step logits."""
  return dict(np.load(HF_FIXTURES / kind / "generate.npz"))


def fixture_prompts(kind: str) -> list[dict]:
  """Prompts as ``encode_vl_prompt`` returns them: the ``generate.npz`` prompt (one image), then the
  ``reference.npz`` rows unpadded (two images; one image in a later turn; text only, no image keys)."""
  gen = generate_reference(kind)
  out = [dict(tokens=gen["prompt"][0].astype(np.int32), pixel_values=gen["pixel_values"],
              grid_thw=gen["image_grid_thw"].astype(np.int32))]
  ref = np.load(HF_FIXTURES / kind / "reference.npz")
  grids, pix = ref["image_grid_thw"].astype(np.int32), ref["pixel_values"]
  starts = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])
  per_row = [[0, 1], [2], []]  # images of each row, in token order (make_vlm_fixtures.py)
  for row, imgs in enumerate(per_row):
    tokens = ref["input_ids"][row][ref["attention_mask"][row] > 0].astype(np.int32)
    if not imgs:
      out.append(dict(tokens=tokens))
      continue
    out.append(dict(tokens=tokens, pixel_values=np.concatenate([pix[starts[i]:starts[i + 1]] for i in imgs]),
                    grid_thw=grids[imgs]))
  return out


@functools.lru_cache(maxsize=8)
def _forward(graphdef):
  @jax.jit
  def f(state, tokens, prompt_len, rope, images, temperature):  # [B, T], [B, T, 3] -> [B, T, V]
    m = nnx.merge(graphdef, state)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kw = {}
    if images is not None:  # image embeddings at the prompt's image tokens only (a generated one is a token)
      embeds, mask = m.embed_images(tokens, images)
      kw = dict(embeds=embeds, embeds_mask=mask & (pos < prompt_len))
    logits = m(tokens, positions=pos, segment_ids=jnp.ones_like(tokens), rope_positions=rope, **kw)
    return jax.nn.log_softmax(logits / temperature, axis=-1)
  return f


def teacher_forced_logprobs(model, prompt: dict, completion: np.ndarray, temperature: float) -> np.ndarray:
  """Trainer-style log-probs ``[G]`` of ``completion`` after ``prompt``: one forward over prompt + completion,
  the prompt's M-RoPE positions (:func:`jaxrl.models.mrope_positions`) continued by ``position + delta`` over
  the completion, and the prompt's images at its image tokens."""
  tokens = prompt["tokens"].astype(np.int32)
  p, g = len(tokens), len(completion)
  grid = prompt.get("grid_thw", np.zeros((0, 3), np.int32))
  rope_p, deltas = models.mrope_positions(tokens[None], np.ones((1, p), np.int32), grid, model.cfg)
  rope_c = models.decode_rope_positions(np.arange(p, p + g, dtype=np.int32)[None], deltas[:, 0])
  rope = np.concatenate([rope_p, rope_c], axis=1)
  seq = np.concatenate([tokens, completion]).astype(np.int32)[None]
  images = None
  if len(grid):
    images = models.batch_vision_inputs(prompt["pixel_values"][None], grid, np.zeros(len(grid)), model.cfg.vision)
  graphdef, state = nnx.split(model)
  lp = np.asarray(_forward(graphdef)(state, jnp.asarray(seq), jnp.int32(p), jnp.asarray(rope), images,
                                     jnp.float32(temperature)))
  return np.take_along_axis(lp[0, p - 1:-1], completion[:, None].astype(np.int64), axis=-1)[:, 0]


@contextlib.contextmanager
def count_tower_runs():
  """Counts executions of the vision tower inside jitted programs traced while active: yields a list that
  gets the number of patch rows (``pixel_values.shape[0]``) of every run (a host callback per execution)."""
  runs: list[int] = []
  original = models.VisionTower.__call__

  def counted(self, pixel_values, layout, **kw):
    rows = pixel_values.shape[0]
    jax.debug.callback(lambda: runs.append(rows))
    return original(self, pixel_values, layout, **kw)

  models.VisionTower.__call__ = counted
  try:
    yield runs
  finally:
    models.VisionTower.__call__ = original
