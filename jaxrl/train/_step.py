"""One jitted, sharded training step with gradient accumulation and a non-finite guard."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.sharding import LogicalRules

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
"""``loss_fn(params, micro_batch, *extra) -> (loss, metrics)``.

The loss of a micro-batch must be a plain weighted *sum* whose weights already carry the global
normalisation (``jaxrl.losses`` computes them once per global batch), so summing micro-batch losses
and gradients gives the global-batch result exactly, whatever the split. Metrics are summed too.
"""


NONFINITE_KEY = "mb/nonfinite"
"""Step metric ``[M]`` int32: 1 for each micro-batch whose loss or gradient is not finite."""


class TrainState(NamedTuple):
  step: jax.Array  # [] int32: updates applied so far
  params: Any  # trainable parameters (a pytree)
  opt_state: Any
  skipped: jax.Array  # [] int32: updates skipped because the loss or gradient was not finite


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    skipped=jnp.zeros((), jnp.int32))


def place_on_mesh(tree, mesh: Mesh | None):
  """Replicates every leaf not yet laid out on ``mesh`` (step counters, optimizer counts...).

  Leaves created outside ``jit`` live on one device; once checkpointed and restored they would be
  committed there and clash with the sharded parameters in the next jitted step.
  """
  if mesh is None:
    return tree
  replicated = NamedSharding(mesh, PartitionSpec())

  def place(x):
    if isinstance(x, jax.Array) and not (isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh):
      return jax.device_put(x, replicated)
    return x
  return jax.tree.map(place, tree)


def _batch_axes(batch_axes: Sequence[str] | None, rules: LogicalRules | None) -> tuple[str, ...]:
  """The mesh axes rows are split over: ``batch_axes`` if given, else the rules' ``batch`` axes."""
  if batch_axes is not None:
    return tuple(batch_axes)
  return (rules or LogicalRules.default()).mesh_axes("batch")


def split_micro_batches(batch, micro_batches: int, *, mesh: Mesh | None = None,
                        batch_axes: Sequence[str] | None = None, rules: LogicalRules | None = None):
  """``[G, ...]`` → ``[M, G/M, ...]`` with micro-batch ``m`` holding rows ``m, m+M, m+2M, ...``.

  Interleaving keeps every micro-batch spread over all data-parallel devices: a device's
  contiguous block of rows contains rows of each micro-batch, so no resharding is needed. The rows
  stay split over the mesh axes that ``rules`` (default :meth:`LogicalRules.default`) map the logical
  ``batch`` axis to; ``batch_axes`` overrides them.
  """
  batch_axes = _batch_axes(batch_axes, rules)

  def split(x):
    g = x.shape[0]
    if g % micro_batches:
      raise ValueError(f"global batch of {g} rows does not split into {micro_batches} micro-batches")
    y = x.reshape(g // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
    if mesh is not None:
      axes = tuple(a for a in batch_axes if mesh.shape[a] > 1) or None
      spec = PartitionSpec(None, axes, *([None] * (x.ndim - 1)))
      y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
    return y
  return jax.tree.map(split, batch)


def _nonfinite(loss, grads) -> jax.Array:  # [] int32: 1 when the loss or any gradient entry is NaN/inf
  total = sum(jnp.sum(g.astype(jnp.float32)) for g in jax.tree.leaves(grads))  # a NaN/inf survives the sum
  return (~(jnp.isfinite(loss) & jnp.isfinite(total))).astype(jnp.int32)


def accumulate_gradients(loss_fn: LossFn, params, batch, *extra, micro_batches: int = 1,
                         mesh: Mesh | None = None, batch_axes: Sequence[str] | None = None,
                         rules: LogicalRules | None = None, report_nonfinite: bool = False):
  """Σ over micro-batches of (loss, grads, metrics), scanning so only one micro-batch is live.

  ``rules``/``batch_axes``: where the rows of each micro-batch live (:func:`split_micro_batches`).
  ``report_nonfinite`` adds ``metrics["mb/nonfinite"]`` ``[M]`` int32: 1 for each micro-batch whose
  loss or gradient holds a NaN or an infinity (one extra reduction over the gradient per micro-batch).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    (loss, metrics), grads = grad_fn(params, batch, *extra)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    if report_nonfinite:
      metrics = dict(metrics, **{NONFINITE_KEY: _nonfinite(loss, grads)[None]})
    return loss, grads, metrics
  micro = split_micro_batches(batch, micro_batches, mesh=mesh, batch_axes=batch_axes, rules=rules)
  first = jax.tree.map(lambda x: x[0], micro)
  (_, metrics_shape), _ = jax.eval_shape(grad_fn, params, first, *extra)

  def body(carry, mb):
    loss_acc, grads_acc, metrics_acc = carry
    (loss, metrics), grads = grad_fn(params, mb, *extra)
    grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
    metrics_acc = jax.tree.map(jnp.add, metrics_acc, metrics)
    return (loss_acc + loss, grads_acc, metrics_acc), (_nonfinite(loss, grads) if report_nonfinite else None)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  zero_metrics = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metrics_shape)
  (loss, grads, metrics), flags = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros, zero_metrics), micro)
  if report_nonfinite:
    metrics = dict(metrics, **{NONFINITE_KEY: flags})
  return loss, grads, metrics


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    mesh: Mesh | None = None,
    state_sharding=None,
    batch_axes: Sequence[str] | None = None,
    rules: LogicalRules | None = None,
    schedule: optax.Schedule | None = None,
    prepare: Callable | None = None,
    donate: bool = True,
    compute_view: Callable | None = None,
):
  """Builds ``step(state, batch, *extra) -> (state, metrics)``, jitted once.

  ``prepare(batch) -> batch`` runs on the whole global batch before it is split into
  micro-batches: the place to fold global normalisers into per-token loss weights (a ``jnp.sum``
  over the global batch inside ``jit`` is a sum over every data-parallel shard).

  The update is skipped (parameters and optimizer state unchanged, ``state.skipped`` + 1) when the
  loss or the gradient norm is not finite; the metrics then name the culprits (``mb/nonfinite``, one
  0/1 flag per micro-batch, :func:`accumulate_gradients`). ``extra`` are non-differentiated inputs (frozen base
  weights for LoRA, a reference policy...). Parameters keep ``state_sharding`` on output. Micro-batch rows
  are split over the mesh axes ``rules`` give the logical ``batch`` axis (``batch_axes`` overrides).

  ``compute_view(params) -> params`` (e.g. :func:`jaxrl.models.compute_view` at the compute dtype): the
  gradients are taken with respect to this view of the parameters, made once per step; they come back
  float32 and update the parameters as they are stored. Use it only with a view whose gradients equal the
  stored parameters' (a cast the loss makes anyway): the loops then carry the compute-dtype weights.
  """
  def step(state: TrainState, batch, *extra):
    if prepare is not None:
      batch = prepare(batch)
    params = state.params if compute_view is None else compute_view(state.params)
    loss, grads, metrics = accumulate_gradients(
        loss_fn, params, batch, *extra, micro_batches=micro_batches, mesh=mesh,
        batch_axes=batch_axes, rules=rules, report_nonfinite=True)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(params, opt_state, grads):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    # A skipped update returns the old parameters and optimizer state. A `lax.cond`, not a select of
    # new vs old: selecting made XLA copy every donated Adam moment first (2 × parameter-size temporaries,
    # issue 20); the cond updates the donated buffers in place.
    params, opt_state = jax.lax.cond(ok, apply, lambda p, o, g: (p, o), state.params, state.opt_state, grads)
    new_state = TrainState(
        step=state.step + ok.astype(jnp.int32), params=params, opt_state=opt_state,
        skipped=state.skipped + (~ok).astype(jnp.int32))
    out = dict(metrics, loss=loss, grad_norm=grad_norm, skipped=(~ok).astype(jnp.int32))
    if schedule is not None:
      out["lr"] = schedule(state.step)
    return new_state, out

  return _StateShardedStep(step, state_sharding, donate)


class _StateShardedStep:
  """``jax.jit(step)`` whose new state keeps the shardings of the state passed in (or ``state_sharding``).

  Left to the compiler, the outputs of the update's ``lax.cond`` came out replicated on GPU targets (every
  H100 holding the whole updated weights and Adam moments: 165 GiB a GPU for a 14B model, issue 11), while
  TPU and CPU kept the input's FSDP sharding. One jitted program per distinct input sharding (in practice
  one); ``lower`` does the same for ahead-of-time compiles of abstract states (``jaxrl plan``).
  """

  def __init__(self, step, state_sharding, donate: bool):
    self._step, self._state_sharding, self._donate = step, state_sharding, donate
    self._jitted: dict = {}

  def _for(self, state):
    shard = self._state_sharding
    if shard is None:
      leaves, treedef = jax.tree.flatten(state)
      got = [getattr(x, "sharding", None) for x in leaves]
      placed = all(isinstance(g, NamedSharding) and getattr(x, "committed", True) for g, x in zip(got, leaves))
      shard = jax.tree.unflatten(treedef, got) if placed else None  # not all on a mesh: the compiler's choice
      key = None if shard is None else (treedef, tuple(got))
    else:
      key = "given"
    if key not in self._jitted:
      self._jitted[key] = jax.jit(self._step, donate_argnums=(0,) if self._donate else (),
                                  out_shardings=None if shard is None else (shard, None))
    return self._jitted[key]

  def __call__(self, state, *args):
    return self._for(state)(state, *args)

  def lower(self, state, *args, **kwargs):
    return self._for(state).lower(state, *args, **kwargs)
