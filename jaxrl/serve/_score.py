"""Prompt scoring for ``echo``: the model's log-probability of every prompt token given those before it.

One forward pass over the (padded, batched) prompts: ``logp[t] = log_softmax(logits[t - 1])[ids[t]]``
for ``t >= 1`` (the first token has no context: ``None`` in OpenAI's format), in float32, at
temperature 1 (the model's own distribution, whatever the request's sampling temperature; the request's
``echo_temperature`` extension divides the logits by ``T`` first, as the RL trainer's log-prob program does
at ``rollout.temperature``), with the top ``k`` alternatives of each position when asked. The weights
are the backend's current ones (``backend.graphdef`` / ``backend.params``, as held by
:class:`jaxrl.sampling.Sampler` and :class:`jaxrl.sampling.Engine`), read at every call, so a backend
whose weights are updated scores with the new ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["PromptLogprobs", "PromptScorer"]


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
  """Per prompt token ``t >= 1``: its log-prob and the top ``k`` (ids, log-probs) at that position."""

  logprobs: list[float]  # [len - 1]
  top_ids: list[list[int]]  # [len - 1, k]
  top_logprobs: list[list[float]]  # [len - 1, k]


def _bucket(n: int, least: int) -> int:
  return max(least, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _program(graphdef, k: int):
  def run(params, tokens, positions, segment_ids, temperature):  # [B, T] each, temperature a scalar
    model = nnx.merge(graphdef, params)
    logits = model(tokens, positions=positions, segment_ids=segment_ids)  # [B, T, V] float32
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)  # [B, T-1, V]: predicts t+1
    target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    if not k:
      return target, None, None
    top_v, top_i = jax.lax.top_k(logp, k)  # [B, T-1, k]
    return target, top_i, top_v
  return jax.jit(run)


class PromptScorer:
  """``scorer(prompts, k, temperature)``: :class:`PromptLogprobs` of each token-id prompt (module docstring).

  Prompts are padded to a power-of-two length (at least ``min_len``) and row count, so a few shapes
  serve every request.
  """

  def __init__(self, backend, *, min_len: int = 16):
    if not (hasattr(backend, "graphdef") and hasattr(backend, "params")):
      raise ValueError("echo: the backend holds no model weights (graphdef/params) to score prompts with")
    self.backend = backend
    self.min_len = min_len

  def __call__(self, prompts: list[list[int]], k: int = 0, temperature: float = 1.0) -> list[PromptLogprobs]:
    rows, width = _bucket(len(prompts), 1), _bucket(max(len(p) for p in prompts), self.min_len)
    tokens = np.zeros((rows, width), np.int32)
    segs = np.zeros((rows, width), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)], segs[i, :len(p)] = p, 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
    target, top_i, top_v = _program(self.backend.graphdef, int(k))(
        self.backend.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segs), np.float32(temperature))
    target = np.asarray(target)
    top_i = None if top_i is None else np.asarray(top_i)
    top_v = None if top_v is None else np.asarray(top_v)
    out = []
    for i, p in enumerate(prompts):
      m = len(p) - 1
      out.append(PromptLogprobs(logprobs=target[i, :m].tolist(),
                                top_ids=top_i[i, :m].tolist() if k else [],
                                top_logprobs=top_v[i, :m].tolist() if k else []))
    return out
