"""Latent-mode greedy decoding through the model's KV cache.

Prompts (question, then ``<bot>``) are left-padded to a common width ``P`` (the layout of training
rows, :func:`jaxrl.latent.make_rows`), prefilled, then ``N`` continuous thoughts are fed one by one
as input embeddings (each the final normed hidden state of the previous position), then ``<eot>``
and ordinary greedy token decoding until the end-of-turn token or ``max_new_tokens``. The thought
count is fixed (Coconut, Hao et al. 2024, §3 "Inference Process", option b: pad the latent thoughts
to a constant length) or decided per row by the ``<eot>`` classifier head (option a, with the fixed
count as the maximum).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.sampling import decode_tokens, left_pad, think


class LatentOutput(NamedTuple):
  tokens: np.ndarray  # [B, G] int32, pad after the end
  lengths: np.ndarray  # [B] int32: generated language tokens, end-of-turn included
  thoughts: np.ndarray  # [B, N, D] float32: the continuous thoughts fed back (0 after a row stopped)
  n_thoughts: np.ndarray  # [B] int32: thoughts each row took (N without a classifier)


@functools.partial(jax.jit, static_argnames=("graphdef", "thoughts", "eot", "eos", "pad", "max_new_tokens"))
def _decode(graphdef, state, head, tokens, positions, segment_ids, *, thoughts: int, eot: int | None, eos: int,
            pad: int, max_new_tokens: int):
  model = nnx.merge(graphdef, state)
  th = think(model, graphdef, state, head, tokens, positions, segment_ids, thoughts=thoughts, eot=eot,
             extra=max_new_tokens)
  greedy = lambda logits, i: (jnp.argmax(logits, axis=-1).astype(jnp.int32), ())
  out, _, lengths = decode_tokens(graphdef, state, th, greedy, eos=eos, pad=pad, max_new_tokens=max_new_tokens)
  return out, lengths, th.thought_inputs, th.count


def latent_generate(model, prompts: Sequence[np.ndarray], *, thoughts: int, eot: int | None, eos: int, pad: int,
                    max_new_tokens: int, eot_head=None) -> LatentOutput:
  """Greedy completions after continuous thoughts (``eot=None``: no ``<eot>`` is fed).

  Args:
    model: a :class:`jaxrl.models.Transformer`.
    prompts: token ids per row, ending with ``<bot>`` in latent mode (:func:`jaxrl.latent.prompt_ids`).
    thoughts: ``N`` continuous thoughts per row (0: plain greedy decoding); with ``eot_head`` the most
      a row may think.
    eot: id of ``<eot>``, fed after the thoughts; None when the model was trained without markers.
    eos: end-of-turn id (generation stops after it).
    pad: id written after the end.
    max_new_tokens: language tokens to generate at most.
    eot_head: the ``<eot>`` classifier (:func:`jaxrl.latent.init_eot_head`): before each thought a
      row stops thinking when the head's logit on its last hidden state (``<bot>``'s, then each
      thought's) is positive. None: exactly ``thoughts`` thoughts.
  """
  rows = left_pad(prompts, pad)
  graphdef, state = nnx.split(model)
  out, lengths, th, count = _decode(graphdef, state, eot_head, rows["tokens"], rows["positions"], rows["segment_ids"],
                                    thoughts=thoughts, eot=eot, eos=eos, pad=pad, max_new_tokens=max_new_tokens)
  return LatentOutput(tokens=np.asarray(out), lengths=np.asarray(lengths), thoughts=np.asarray(th),
                      n_thoughts=np.asarray(count))
