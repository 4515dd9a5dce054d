"""Shared tiny model, tokenizer and chains for the latent tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data, latent, models

CFG = models.ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                              head_dim=8)


@functools.cache
def tokenizer_and_tokens():
  tok = models.load_tokenizer(str(data.tiny_tokenizer_dir()))
  return tok, latent.latent_tokens(tok, CFG.vocab_size)


def tiny_model(seed: int = 0):
  return models.Transformer(CFG, rngs=nnx.Rngs(seed))


def chains():
  """Chains of 2, 1 and 3 steps (so a stage-2 batch has rows with fewer thoughts than others)."""
  return [latent.Chain("6+5+2=?", ("6+5=11", "11+2=13"), "13"),
          latent.Chain("0*1=?", ("0*1=0",), "0"),
          latent.Chain("1+2+3+4=?", ("1+2=3", "3+3=6", "6+4=10"), "10")]


def unrolled_hidden(model, rows, n_thoughts: int):
  """Naive reference: ``N + 1`` full forward passes without a cache, each feeding back the last one's
  hidden states at the thought columns (pass ``m`` makes every column before ``P + m - 1`` exact)."""
  mask = jnp.asarray(rows["thought_mask"])
  b, t = mask.shape
  feed = jnp.zeros((b, t, CFG.hidden_size), jnp.float32)
  for _ in range(n_thoughts + 1):
    h = model(jnp.asarray(rows["tokens"]), positions=jnp.asarray(rows["positions"]),
              segment_ids=jnp.asarray(rows["segment_ids"]), return_hidden=True, embeds=feed, embeds_mask=mask)
    feed = jnp.zeros_like(h).at[:, 1:].set(h[:, :-1])
  return h


def nll(model, hidden, rows):
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden, model.unembed_matrix()), axis=-1)
  tok = jnp.take_along_axis(logp, jnp.asarray(rows["targets"])[..., None], axis=-1)[..., 0]
  mask = jnp.asarray(rows["loss_mask"])
  return -jnp.sum(mask * tok) / jnp.sum(mask)


def teacher_forced_logprobs(model, prompts, tokens, lengths, ids, n_thoughts, *, greedy=False):
  """Log-probs of generated tokens under the training forward (``latent_hidden``): row ``r`` is prompt
  ``r`` (ending with ``<bot>``), ``n_thoughts[r]`` continuous thoughts, ``<eot>``, ``tokens[r, :lengths[r]]``.
  With ``greedy``, each row's ``(log-probs, argmax tokens)`` at the same positions."""
  examples = []
  for p, gen, length, n in zip(prompts, tokens, lengths, n_thoughts):
    suffix = np.concatenate([[ids.eot], gen[:length]]).astype(np.int32)
    examples.append(latent.StageExample(prompt=np.asarray(p, np.int32), n_thoughts=int(n), kind="latent",
                                        suffix=suffix, suffix_loss=np.ones(len(suffix), bool), answer=""))
  layout = latent.Layout.fit(examples)
  rows = latent.make_rows(examples, layout, ids)
  h = latent.latent_hidden(model, *(jnp.asarray(rows[k]) for k in ("tokens", "positions", "segment_ids",
                                                                      "thought_mask")),
                           prefix=layout.prefix, thoughts=layout.thoughts)
  logp = np.asarray(jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, model.unembed_matrix()), axis=-1))
  first = layout.prefix + layout.thoughts  # every row's <eot> column predicts its first language token
  if greedy:
    return [(logp[r, first + np.arange(n), gen[:n]], logp[r, first + np.arange(n)].argmax(-1))
            for r, (gen, n) in enumerate(zip(tokens, lengths))]
  return [logp[r, first + np.arange(n), gen[:n]] for r, (gen, n) in enumerate(zip(tokens, lengths))]
