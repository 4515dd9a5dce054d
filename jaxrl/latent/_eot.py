"""The ``<eot>`` classifier: a linear head on the final hidden state that says "end thoughts now".

Coconut (Hao et al. 2024, §3 "Inference Process", option a) trains a binary classifier on the latent
thoughts to decide when to stop latent reasoning. Here the head reads the final normed hidden state
at ``<bot>`` and at every continuous thought: label 1 on the last of them (the next input is
``<eot>``), 0 before. It is trained jointly with the language loss (``eot_head`` weight in
:class:`jaxrl.latent.CoconutConfig`), and :func:`jaxrl.latent.latent_generate` can stop thinking
when it fires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.sampling import eot_logits  # noqa: F401  (defined a layer below, for decoding)


def init_eot_head(hidden_size: int) -> dict[str, jax.Array]:
  """``{"w": [D] zeros, "b": [] zeros}`` float32 (initial probability 1/2 everywhere)."""
  return {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def eot_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:  # [B, T] x3 -> []
  """Weighted binary cross-entropy ``Σ w · (softplus(z) - y·z)`` (= ``-y log σ(z) - (1-y) log(1-σ(z))``).

  Args:
    logits: ``z`` from :func:`eot_logits`.
    labels: ``y`` in {0, 1}.
    weights: per-position weights (0 off the decision columns; ``mask / Σ mask`` for the mean).

  Example::

    eot_loss(jnp.zeros(2), jnp.array([1.0, 0.0]), jnp.array([0.5, 0.5]))  # log 2
  """
  z = logits.astype(jnp.float32)
  return jnp.sum(weights * (jax.nn.softplus(z) - labels * z))
