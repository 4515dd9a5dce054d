"""Placement: where a model's arrays live on a mesh, and the copies the programs read.

A model is placed on a mesh by its parameters' logical axis names (``out_sharding`` metadata) and
:class:`jaxrl.sharding.LogicalRules`: :func:`state_shardings` maps them to ``NamedSharding`` s, and
:func:`shard_model`, :func:`init_model` and :func:`abstract_model` (and
:func:`jaxrl.models.load_pretrained`) record the mesh and rules on the model as a
:class:`jaxrl.models.Placement`, which its forward pass uses for activations and kernels.
:func:`compute_view` and :func:`cast_params` give the compute-dtype weights the train step, the samplers
and the frozen reference read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.models._config import ModelConfig
from jaxrl.models._transformer import Placement, Transformer
from jaxrl.sharding import LogicalRules


def state_shardings(state_or_model, mesh: Mesh | None, rules: LogicalRules | None = None):
  """``NamedSharding`` of every variable from its logical ``out_sharding`` names.

  Args:
    state_or_model: an ``nnx.State`` (concrete or abstract) or an ``nnx.Module``.
    mesh: target mesh; ``None`` gives a single-device sharding on the first device.
    rules: logical-to-mesh rules (default :meth:`LogicalRules.default`).

  Returns:
    A state of the same structure whose variables hold shardings (usable as ``out_shardings`` or in
    ``jax.device_put``).
  """
  state = nnx.state(state_or_model) if isinstance(state_or_model, nnx.Module) else state_or_model
  rules = rules or LogicalRules.default()

  def one(_, var):
    if mesh is None:
      return var.replace(SingleDeviceSharding(jax.devices()[0]))
    names = var.get_metadata().get("out_sharding")
    if not names:
      return var.replace(NamedSharding(mesh, PartitionSpec()))
    return var.replace(rules.sharding(names, mesh, var.shape))

  return nnx.map_state(one, state)


def _set_placement(model: Transformer, mesh: Mesh | None, rules: LogicalRules | None) -> Transformer:
  """Records ``(mesh, rules)`` on ``model`` (``None`` mesh: no placement) and returns it."""
  model.placement = None if mesh is None else Placement(mesh, rules or LogicalRules.default())
  return model


def shard_model(model: Transformer, mesh: Mesh, rules: LogicalRules | None = None) -> Transformer:
  """A copy of ``model`` with every parameter placed as ``rules`` say on ``mesh``.

  The copy holds a :class:`Placement`: its forward pass constrains activations and runs attention
  kernels per shard on ``mesh``. Arrays already placed so are not copied.
  """
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, state_shardings(state, mesh, rules))
  return _set_placement(nnx.merge(graphdef, state), mesh, rules)


def abstract_model(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: LogicalRules | None = None) -> Transformer:
  """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and metadata, no memory, no init.

  With ``mesh`` it holds a :class:`Placement` like a model placed there (e.g. to lower its programs
  ahead of time for a target mesh).
  """
  return _set_placement(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), mesh, rules)


def init_model(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: LogicalRules | None = None,
               seed: int = 0) -> Transformer:
  """A randomly initialised model, each parameter created directly on its shards (jit + out_shardings).

  The initialiser is compiled once per ``(cfg, mesh, rules)``; the seed is a traced argument.
  """
  graphdef, state = _init_fn(cfg, mesh, rules)(jnp.asarray(seed, jnp.uint32))
  return _set_placement(nnx.merge(graphdef, state), mesh, rules)


KEEP_MASTER_DTYPE = ("embed", "scale")
"""Parameter names :func:`compute_view` leaves in the master dtype: the input embedding (its gradient is a
scatter-add over tokens, accumulated in float32) and every RMSNorm ``scale`` (norms run in float32)."""


def compute_view(params, dtype):
  """The weights a train step's forward and backward passes read, cast to the compute ``dtype`` once.

  Every floating array is cast except the :data:`KEEP_MASTER_DTYPE` ones. The model casts each of these
  arrays to the compute dtype before every use (``w.astype(dt)`` in each projection and in the
  unembedding), and a cast's transpose only converts the cotangent back, so the gradients with respect to
  the view are the master weights' gradients in the compute dtype (the train step accumulates them in
  float32). Traceable: call it inside ``jit``. With ``dtype`` equal to the master dtype it returns
  ``params`` unchanged.

  Why: the micro-batch loop and the layer loops of a jitted train step carry the weights they read, and
  XLA gives each loop its own copy of a donated argument (measured for DeepCoder 14B on h100x8: two
  float32 copies of every layer beside the gradients, docs/scaling.md). Carrying the compute-dtype view
  halves those copies.
  """
  dtype = jnp.dtype(dtype)

  def cast(path, x):
    names = {getattr(k, "key", None) for k in path}
    if names & set(KEEP_MASTER_DTYPE) or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
      return x
    return x.astype(dtype)
  return jax.tree_util.tree_map_with_path(cast, params)


def cast_params(tree, dtype, *, copy: bool = False):
  """A copy of a model's (or any pytree's) floating-point arrays in ``dtype``, cast on device.

  How the sampler and the frozen KL reference get their compute-dtype weights from float32 master
  weights: each array is converted where it lives (its sharding is kept), in one jitted program.
  Arrays already in ``dtype`` and non-float leaves are returned as they are unless ``copy``.

  Args:
    tree: an ``nnx.Module`` (the result is the same module type over the cast state; its config is
      unchanged) or a pytree of arrays (e.g. an ``nnx.State``).
    dtype: e.g. ``"bfloat16"`` or ``model.cfg.dtype``.
    copy: also copy float arrays already in ``dtype`` (a frozen reference that must outlive the
      originals being donated to a train step).
  """
  dtype = jnp.dtype(dtype)
  if isinstance(tree, nnx.Module):
    graphdef, state = nnx.split(tree)
    return nnx.merge(graphdef, cast_params(state, dtype, copy=copy))
  leaves, treedef = jax.tree.flatten(tree)
  todo = [i for i, x in enumerate(leaves)
          if jnp.issubdtype(jnp.result_type(x), jnp.floating) and (copy or jnp.result_type(x) != dtype)]
  if todo:
    cast = _cast_fn(dtype)([leaves[i] for i in todo])
    for i, x in zip(todo, cast):
      leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=8)
def _cast_fn(dtype):
  return jax.jit(lambda xs: [jnp.copy(x.astype(dtype)) for x in xs])


@functools.lru_cache(maxsize=32)
def _init_fn(cfg: ModelConfig, mesh: Mesh | None, rules: LogicalRules | None):
  graphdef, abs_state = nnx.split(abstract_model(cfg))
  shardings = state_shardings(abs_state, mesh, rules)

  def make(seed):
    return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))))

  make = jax.jit(make, out_shardings=shardings)
  return lambda seed: (graphdef, make(seed))
