"""The jitted programs an RL recipe runs, as abstract (shape-only) inputs on a target mesh.

Each builder in :data:`PROGRAMS` takes a :class:`PlanContext` and returns :class:`Program` rows: the
jitted function the trainer or sampler builds (the library's own builders, not copies), its abstract
arguments, and which arguments are parameters, optimizer state, KV cache or batch. A rollout engine
adds its programs with :func:`register_programs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import models, sampling, sharding, train
from jaxrl.models import state_shardings
from jaxrl.plan import _vision
from jaxrl.rl import RLConfig, make_learner_step, make_logprob_fn, make_logprob_program, pack_sequences, packed_layout


@dataclasses.dataclass
class Program:
  """One program to compile: ``fn.lower(*args, **kwargs)``; ``parts`` names argument groups."""

  name: str
  fn: Any
  args: tuple
  kwargs: dict[str, Any]
  parts: dict[str, Any]
  "Category (params, opt_state, kv_cache, batch) → the abstract arguments in it."
  outputs: Any = ()
  "Abstract outputs known from shapes (the prefill's KV cache): the pre-check counts them with the inputs."
  flops: float = 0.0
  "Model FLOPs per execution (ModelConfig.flops_per_token × tokens: 3× forward for a train step), an estimate."
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  step: int
  "First RL step of the stage."
  max_new: int
  n: int


@dataclasses.dataclass
class PlanContext:
  """Everything the builders share: the recipe, mesh, abstract model and abstract train state."""

  cfg: RLConfig
  mesh: Mesh
  rules: sharding.LogicalRules
  model_cfg: models.ModelConfig
  graphdef: Any
  params: Any  # abstract, sharded
  state: train.TrainState  # abstract, sharded
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  "The learning-rate schedule the train step logs."
  batch_sharding: NamedSharding
  "The trainer's packed-batch sharding (rows over the data-parallel axes)."
  data_parallel: int
  "Data-parallel devices (the packed rows per micro-batch must split evenly over them)."
  logprob_fn: Any
  "The policy's log-prob function (``make_logprob_fn``), as the trainer builds it."
  full_model_cfg: models.ModelConfig | None = None
  "The full-depth model when ``model_cfg`` has fewer layers (``--layers``); sizes the engine's pool."
  hbm_bytes: int | None = None
  "The target's memory per device (estimates a ``kv_cache_fraction`` budget)."

  @property
  def stages(self) -> list[Stage]:
    return recipe_stages(self.cfg)


def recipe_stages(cfg: RLConfig) -> list[Stage]:
  """The recipe's context stages (the first step of each, its response budget and group size)."""
  r = cfg.rollout
  steps = [1] + [s.start_step for s in r.context_schedule]
  return [Stage(i, st, *r.stage(st)[1:]) for i, st in enumerate(steps)]


def abstract(tree, shardings):
  """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a matching tree, or one sharding for all)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def device_bytes(tree) -> int:
  """Bytes one device holds of an abstract tree (each leaf's shard shape under its sharding)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if not hasattr(x, "shape"):
      continue
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize  # PRNG key dtypes report their key data's size
  return total


def abstract_train_state(params, optimizer, mesh) -> train.TrainState:
  """The abstract :class:`train.TrainState` of the abstract ``params`` under ``optimizer``: step and skip
  counter replicated, the optimizer state sharded like the parameters it tracks."""
  shape = jax.eval_shape(lambda p: train.init_train_state(p, optimizer), params)
  replicated = NamedSharding(mesh, PartitionSpec())
  return train.TrainState(
      step=abstract(shape.step, replicated), params=params,
      opt_state=abstract(shape.opt_state, _state_shardings(params, shape.opt_state, optimizer, mesh)),
      skipped=abstract(shape.skipped, replicated))


def _state_shardings(params, opt_state, optimizer, mesh):
  """Optimizer-state leaves that mirror a parameter get its sharding; the rest are replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  shard_of = jax.tree.map(lambda p: p.sharding, params)
  return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, shard_of,
                               transform_non_params=lambda _: replicated)


def build_context(cfg: RLConfig, devices, model_cfg: models.ModelConfig, *,
                  full_model_cfg: models.ModelConfig | None = None, hbm_bytes: int | None = None) -> PlanContext:
  mesh = sharding.make_mesh(cfg.mesh.shape, devices=devices)
  rules = cfg.mesh.logical_rules()
  if cfg.lora is not None:
    raise ValueError("plan: LoRA recipes are not planned yet (the adapters' programs differ); remove `lora:`")
  if model_cfg.vision is not None:
    _vision.check_images(cfg, model_cfg)
  model = models.abstract_model(model_cfg, mesh=mesh, rules=rules)
  graphdef, state = nnx.split(model)
  params = abstract(state, state_shardings(state, mesh, rules))
  algo = cfg.algorithm
  total_updates = cfg.steps * cfg.updates_per_step
  optimizer = train.make_optimizer(cfg.optim, total_updates)
  schedule = train.make_schedule(cfg.optim, total_updates)
  train_state = abstract_train_state(params, optimizer, mesh)
  rule_axes = rules.mesh_axes("batch")
  logprob_fn = make_logprob_fn(graphdef, temperature=cfg.rollout.temperature,
                               chunk_size=algo.logprob_chunk_size, lora=False)
  return PlanContext(cfg=cfg, mesh=mesh, rules=rules, model_cfg=model_cfg, graphdef=graphdef, params=params,
                     state=train_state, optimizer=optimizer, schedule=schedule,
                     batch_sharding=sharding.batch_sharding(mesh, rules),
                     data_parallel=math.prod(mesh.shape[a] for a in rule_axes), logprob_fn=logprob_fn,
                     full_model_cfg=full_model_cfg,
                     hbm_bytes=hbm_bytes)


def micro_batches(ctx: PlanContext, stage: Stage) -> tuple[int, int, int]:
  """``(row_len, rows, M)``: the stage's packed layout and its worst-case micro-batch count (every
  response at its full budget, so each sequence is ``prompt + max_new - 1`` tokens)."""
  cfg = ctx.cfg
  row_len, rows = packed_layout(cfg, stage.step, data_parallel=ctx.data_parallel)
  seq = cfg.data.max_prompt_tokens + stage.max_new - 1
  per_row = max(1, row_len // seq)
  samples = cfg.rollout.prompts_per_step // cfg.algorithm.mini_batches * stage.n
  m = -(-samples // (rows * per_row))
  if cfg.micro_batch.bucket == "pow2":
    m = 1 << (m - 1).bit_length()
  return row_len, rows, m


def train_batch(ctx: PlanContext, stage: Stage) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract device batch of one mini-batch, as ``RLTrainer.update`` hands it to its programs."""
  row_len, rows, m = micro_batches(ctx, stage)
  pb = pack_sequences([], row_len=row_len, rows=rows, bucket="exact")  # the trainer's keys and dtypes
  pb.arrays["mb_index"] = pb.arrays["mb_index"][..., None]
  out = {}
  for k, v in pb.interleaved().items():
    out[k] = jax.ShapeDtypeStruct((rows * m, *v.shape[1:]), v.dtype,
                                  sharding=sharding.batch_sharding(ctx.mesh, ctx.rules, ndim=v.ndim))
  f32 = jax.ShapeDtypeStruct((rows * m, row_len), jnp.float32, sharding=ctx.batch_sharding)
  out["old_logprobs"] = f32
  if ctx.cfg.algorithm.kl_coef > 0:
    out["ref_logprobs"] = f32
  if ctx.model_cfg.vision is not None:  # per-row images and M-RoPE positions (jaxrl/plan/_vision.py)
    out.update(_vision.vision_batch(ctx.model_cfg, rows=rows * m, row_len=row_len, num_patches=image_bucket(ctx, stage),
                                    mesh=ctx.mesh, rules=ctx.rules))
  return out


def image_bucket(ctx: PlanContext, stage: Stage) -> int:
  """Per-row patch bucket of ``stage``'s packed rows (``data.num_patches``, else the worst case)."""
  row_len, _, _ = micro_batches(ctx, stage)
  seq = ctx.cfg.data.max_prompt_tokens + stage.max_new - 1
  return _vision.vision_bucket(ctx.cfg, row_len=row_len, seq_len=seq)


def _images(ctx: PlanContext, stage: Stage, fn, args: tuple, flops: float, *, training: bool) -> tuple[float, str]:
  """``(flops, note suffix)`` of a trainer program: for a VLM, the tower's FLOPs when ``fn`` reads the images
  and a note saying which."""
  if ctx.model_cfg.vision is None:
    return flops, ""
  row_len, rows, m = micro_batches(ctx, stage)
  bucket = image_bucket(ctx, stage)
  read = _vision.runs_tower(fn, args, ctx.model_cfg.vision)
  if read:
    flops = _vision.tower_flops(ctx.model_cfg, ctx.cfg, row_len=row_len, num_patches=bucket,
                                training=training) * rows * m * row_len
  return flops, "; " + _vision.vision_note(ctx.model_cfg, ctx.cfg, num_patches=bucket, read=read)


ProgramBuilder = Callable[[PlanContext], list[Program]]
PROGRAMS: dict[str, ProgramBuilder] = {}
"""Name → builder of the rows ``jaxrl plan`` compiles for a recipe (in registration order)."""


def register_programs(name: str):
  """Decorator adding a builder to :data:`PROGRAMS` (e.g. a rollout engine's prefill/decode steps)."""
  def wrap(fn: ProgramBuilder) -> ProgramBuilder:
    PROGRAMS[name] = fn
    return fn
  return wrap


def _distinct(stages: list[Stage], key) -> list[tuple[Stage, str]]:
  """One ``(stage, tag)`` per distinct ``key``: the first such stage and a tag naming every stage
  with that key (``s1,s2``: the programs of stages 1 and 2 have the same shapes)."""
  groups: dict[Any, list[Stage]] = {}
  for s in stages:
    groups.setdefault(key(s), []).append(s)
  return [(g[0], ",".join(f"s{s.index}" for s in g)) for g in groups.values()]


@register_programs("train")
def train_programs(ctx: PlanContext) -> list[Program]:
  """The update step (``rl.make_learner_step``: remat, scanned micro-batches, optimizer) per stage."""
  cfg = ctx.cfg
  out = []
  for st, tag in _distinct(ctx.stages, lambda s: (micro_batches(ctx, s), s.max_new)):
    row_len, rows, m = micro_batches(ctx, st)
    max_len = cfg.algorithm.aggregation_max_len or st.max_new
    step = make_learner_step(cfg, ctx.graphdef, ctx.optimizer, num_micro=m, max_len=max_len, mesh=ctx.mesh,
                             rules=ctx.rules, schedule=ctx.schedule, train_dtype=ctx.model_cfg.dtype)
    batch = train_batch(ctx, st)
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(ctx.mesh, PartitionSpec()))
    state = ctx.state
    flops, images = _images(ctx, st, step, (state, batch, flag),
                            ctx.model_cfg.flops_per_token(row_len, training=True) * rows * m * row_len, training=True)
    out.append(Program(
        name=f"train_step[{tag}]", fn=step, args=(state, batch, flag), kwargs={},
        parts={"params": state.params, "opt_state": state.opt_state, "batch": (batch, flag, state.step, state.skipped)},
        flops=flops, note=f"{m} micro-batches x {rows} rows x {row_len} tokens" + images))
  return out


@register_programs("logprobs")
def logprob_programs(ctx: PlanContext) -> list[Program]:
  """π_old recompute (when the trainer recomputes it) and π_ref (when ``kl_coef > 0``) per stage."""
  algo = ctx.cfg.algorithm
  recompute = algo.old_logprobs == "recompute" and (algo.mini_batches > 1 or algo.ppo_epochs > 1)
  out = []
  for st, tag in _distinct(ctx.stages, lambda s: micro_batches(ctx, s)):
    row_len, rows, m = micro_batches(ctx, st)
    fn = make_logprob_program(ctx.logprob_fn, m, mesh=ctx.mesh, batch_sharding=ctx.batch_sharding)
    batch = train_batch(ctx, st)
    fwd, images = _images(ctx, st, fn, (ctx.params, batch),
                          ctx.model_cfg.flops_per_token(row_len, training=False) * rows * m * row_len, training=False)
    note = f"{m} micro-batches x {rows} rows x {row_len} tokens" + images
    if recompute:
      out.append(Program(name=f"logprobs_old[{tag}]", fn=fn, args=(ctx.params, batch), kwargs={},
                         parts={"params": ctx.params, "batch": batch}, flops=fwd, note=note))
    if algo.kl_coef > 0:
      ref = reference_params(ctx)
      out.append(Program(name=f"logprobs_ref[{tag}]", fn=fn, args=(ref, batch), kwargs={},
                         parts={"params": ref, "batch": batch}, flops=fwd,
                         note=note + "; compute-dtype reference copy"))
  return out


def reference_params(ctx: PlanContext):
  """The frozen KL reference: a compute-dtype copy of the parameters, same shardings."""
  shape = jax.eval_shape(lambda p: models.cast_params(p, ctx.model_cfg.dtype, copy=True), ctx.params)
  return abstract(shape, jax.tree.map(lambda p: p.sharding, ctx.params))


def rollout_params(ctx: PlanContext) -> tuple:
  """``(what the sampler or engine reads, the float32 master weights beside it)``: ``RLTrainer.sampling_model()``
  hands it a compute-dtype copy (cast on device) when the compute dtype differs from the master weights'
  dtype, else the master weights themselves (nothing beside them)."""
  dtype = jnp.dtype(ctx.model_cfg.dtype)
  if all(x.dtype == dtype for x in jax.tree.leaves(ctx.params) if jnp.issubdtype(x.dtype, jnp.floating)):
    return ctx.params, ()
  return reference_params(ctx), ctx.params


def _row_bucket(count: int, dp: int) -> int:
  b = 1 << (count - 1).bit_length()
  return -(-b // dp) * dp


@register_programs("sampler")
def sampler_programs(ctx: PlanContext) -> list[Program]:
  """``Sampler.generate``'s prefill and decode at the rollout shapes of each stage (one chunk of
  ``prompts_per_step / reward_overlap_chunks`` prompts, ``n`` samples each, the full length budget);
  none when the recipe rolls out on the engine (``rollout.engine``, see :mod:`jaxrl.plan._engine`)."""
  cfg = ctx.cfg
  if cfg.rollout.engine is not None:
    return []
  r = cfg.rollout
  mc = ctx.model_cfg
  programs = sampling.sampler_programs(ctx.graphdef, mc, ctx.mesh, ctx.rules, jnp.dtype(mc.dtype), r.decode_impl)
  dp = math.prod(ctx.mesh.shape[a] for a in ctx.rules.mesh_axes("cache_batch"))
  params, master = rollout_params(ctx)
  out = []
  for st, tag in _distinct(ctx.stages, lambda s: (s.max_new, s.n)):
    prompts = -(-r.prompts_per_step // r.reward_overlap_chunks)
    p_bucket = sampling.length_bucket(cfg.data.max_prompt_tokens)
    g_bucket = sampling.length_bucket(st.max_new)
    u, rows = _row_bucket(prompts, dp), _row_bucket(prompts * st.n, dp)
    row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype, sharding=programs.row_sharding(1))
    repl = NamedSharding(ctx.mesh, PartitionSpec())
    kwargs = dict(
        prompt=jax.ShapeDtypeStruct((u, p_bucket), jnp.int32, sharding=repl),
        prompt_len=jax.ShapeDtypeStruct((u,), jnp.int32, sharding=repl),
        src=row(jnp.int32), active=row(jnp.bool_), request=row(jnp.int32), sample=row(jnp.int32),
        temperature=row(jnp.float32), top_k=row(jnp.int32), top_p=row(jnp.float32), min_p=row(jnp.float32),
        max_new=row(jnp.int32), gen_len=g_bucket, k_top=0, want_entropy=False)
    seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=repl)
    shape = f"{u} prompts x {p_bucket} -> {rows} rows x {p_bucket + g_bucket} cache slots"
    prefill_flops = mc.flops_per_token(p_bucket, training=False) * u * p_bucket
    rows_abs = jax.eval_shape(lambda p, s, kw: programs.prefill(p, s, **kw, gen_len=g_bucket, k_top=0,
                                                                  want_entropy=False),
                              params, seed, {k: v for k, v in kwargs.items() if not isinstance(v, (int, bool))})
    rows_abs = _constrained_rows(programs, rows_abs)
    out.append(Program(name=f"sampler_prefill[{tag}]", fn=programs.prefill, args=(params, seed),
                       kwargs=kwargs, parts={"params": (params, master), "batch": (seed, kwargs)}, outputs=rows_abs.cache,
                       flops=prefill_flops, note=shape))
    stops = sampling.Stops(jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=repl),
                           jax.ShapeDtypeStruct((1,), jnp.int32, sharding=repl))
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)
    decode_flops = mc.flops_per_token(p_bucket + g_bucket, training=False) * rows * g_bucket
    out.append(Program(name=f"sampler_decode[{tag}]", fn=programs.decode,
                       args=(params, rows_abs, stops, scalar, scalar), kwargs={},
                       parts={"params": (params, master), "kv_cache": rows_abs.cache,
                              "batch": (rows_abs._replace(cache=None), stops, scalar, scalar)},
                       flops=decode_flops, note=shape + f"; {g_bucket} decode steps in one while loop"))
  return out


def _constrained_rows(programs, rows):
  """The prefill's output rows with the shardings its ``constrain_rows`` gives them."""
  cache_axes = models.KVCache.logical_axes()
  mesh, rules = programs.mesh, programs.rules
  cache = jax.tree.map(
      lambda x, names: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rules.sharding(names, mesh, x.shape)),
      rows.cache, cache_axes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))
  fields = {}
  for f in rows._fields:
    x = getattr(rows, f)
    if f == "cache" or x is None:
      continue
    s = programs.row_sharding(x.ndim) if f != "keys" else NamedSharding(mesh, PartitionSpec())
    fields[f] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return rows._replace(cache=cache, **fields)
