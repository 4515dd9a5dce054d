"""A decoder trunk with a scalar head: PPO's critic (``jaxrl.rl``) and the Bradley–Terry reward model
(``jaxrl.pref``) are both this model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models._placement import state_shardings
from jaxrl.models._source import ModelSource
from jaxrl.models._transformer import Transformer
from jaxrl.models._vision import VisionInputs


class ValueModel(nnx.Module):
  """A decoder trunk (:class:`jaxrl.models.Transformer`, unembedding dropped) and a scalar value head.

  ``V = h · w + b`` with ``h`` the final normed hidden state ``[B, T, D]``; float32 out.
  """

  def __init__(self, trunk: Transformer):
    trunk.lm_head = None  # the value head replaces the unembedding (tied: the embedding stays, as the input)
    self.trunk = trunk
    d = trunk.cfg.hidden_size
    self.value_head = nnx.Param(jnp.zeros((d,), jnp.float32), out_sharding=("embed",), eager_sharding=False)
    self.value_bias = nnx.Param(jnp.zeros((), jnp.float32))

  def __call__(self, tokens: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
               rope_positions: jax.Array | None = None, images: VisionInputs | None = None) -> jax.Array:
    """``V [B, T]`` float32; a VLM trunk takes ``rope_positions [B, T, 3]`` and per-row ``images``."""
    h = self.trunk(tokens, positions=positions, segment_ids=segment_ids, rope_positions=rope_positions,
                   images=images, return_hidden=True)  # [B, T, D]
    return self.head(h)

  def head(self, h: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T] float32
    """``h · w + b``, the scalar head on final normed hidden states."""
    with jax.named_scope("value_head"):
      v = jnp.einsum("btd,d->bt", h, self.value_head[...].astype(h.dtype), preferred_element_type=jnp.float32)
    return v + self.value_bias[...]


def build_value_model(source: ModelSource, *, mesh=None, rules=None) -> ValueModel:
  """The value model built from ``source`` (trunk weights) with a zero value head, placed on ``mesh``."""
  return place_value_model(ValueModel(source.build(mesh=mesh, rules=rules)), mesh=mesh, rules=rules)


def place_value_model(vm: ValueModel, *, mesh=None, rules=None) -> ValueModel:
  """``vm`` with every parameter (the head included) placed by ``rules`` on ``mesh`` (``mesh`` None: as is)."""
  if mesh is None:
    return vm
  graphdef, state = nnx.split(vm)
  state = jax.device_put(state, state_shardings(state, mesh, rules))
  return nnx.merge(graphdef, state)
