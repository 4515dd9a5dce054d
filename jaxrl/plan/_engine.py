"""The rollout engine's KV budget and jitted programs, for ``jaxrl plan`` and ``jaxrl info``.

:func:`engine_budget` is the engine's own arithmetic (``jaxrl.sampling.Engine.__init__``: blocks per
data shard from the per-device budget) without allocating anything; ``tests/plan`` checks it against a
real :class:`~jaxrl.sampling.Engine`. The programs registered here are the engine's jitted
``prefill`` and ``decode`` (``jaxrl.sampling.engine_programs``, the objects the engine itself calls),
lowered on abstract inputs at the recipe's ``rollout.engine`` settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import models, sampling, sharding
from jaxrl.plan import _vision
from jaxrl.plan._programs import (PlanContext, Program, _distinct, abstract, device_bytes, recipe_stages, reference_params,
                                  register_programs, rollout_params)
from jaxrl.rl import rollout_max_len


@dataclasses.dataclass(frozen=True)
class EngineBudget:
  """The engine's paged KV cache for one ``max_len`` on one mesh (``tokens`` are cache slots)."""

  num_slots: int
  block_size: int
  max_len: int
  num_blocks: int
  "Blocks in the pool, all devices together (a multiple of ``shards``)."
  shards: int
  "Data shards of the pool (the ``cache_batch`` mesh axes); a slot only uses its shard's blocks."
  kv_split: int
  "Devices one block's kv heads are split over (the ``cache_kv_heads`` axes, when they divide the heads)."
  block_bytes: int
  "Bytes of one block, keys and values of every layer, before the head split."
  bytes_per_device: int
  cache_dtype: str
  budget: str
  "Where the budget came from (``kv_cache_bytes`` or an estimate from ``kv_cache_fraction``)."

  @property
  def blocks_per_shard(self) -> int:
    return self.num_blocks // self.shards

  @property
  def tokens_resident(self) -> int:
    """Most cached tokens held at once, all shards together."""
    return self.num_blocks * self.block_size

  @property
  def tokens_per_shard(self) -> int:
    return self.blocks_per_shard * self.block_size

  @property
  def full_rows_resident(self) -> int:
    """Rows of ``max_len`` tokens the pool holds at once (over all shards)."""
    return self.blocks_per_shard // -(-self.max_len // self.block_size) * self.shards

  def check(self) -> str | None:
    """The engine's refusal of this pool (:func:`jaxrl.sampling.check_pool`), or None."""
    bad = sampling.check_pool(self.num_slots, self.shards, self.num_blocks, self.max_len, self.block_size)
    return None if bad is None else f"rollout.engine: {bad}"

  def lines(self, where: str = "") -> list[str]:
    """Human-readable lines (``jaxrl info`` and ``jaxrl plan``); ``where`` qualifies the heading."""
    per_token = self.block_bytes // self.block_size // self.kv_split
    out = [f"engine KV budget ({where + ', ' if where else ''}max_len {self.max_len}): {self.num_slots} slots, "
           f"blocks of {self.block_size} tokens, {self.blocks_per_shard} blocks per data shard x {self.shards} "
           f"shards = {self.num_blocks} blocks; {_size(self.bytes_per_device)} per device ({self.cache_dtype}, "
           f"{_size(per_token)} per cached token per device; {self.budget}); at most {self.tokens_resident} tokens "
           f"resident ({self.tokens_per_shard} per shard), {self.full_rows_resident} rows of max_len at once"]
    bad = self.check()
    if bad:
      out.append(f"  DOES NOT FIT: {bad}")
    return out


def _size(n: int) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def engine_budget(model_cfg: models.ModelConfig, mesh: Mesh, rules: sharding.LogicalRules, engine_cfg, max_len: int,
                  *, free_bytes: int | None = None) -> EngineBudget:
  """The pool ``jaxrl.sampling.Engine`` allocates for ``engine_cfg`` (an ``rl.EngineConfig``) on ``mesh``.

  ``num_blocks`` is the pool over all devices (rounded down to a multiple of its shards, as the engine
  does); ``kv_cache_bytes`` is per device; ``kv_cache_fraction`` needs ``free_bytes`` (the free memory per
  device when the engine starts; the plan estimates it as HBM less the trainer's resident state).
  """
  dtype = jnp.dtype(model_cfg.dtype)
  shards, kv_split = sampling.cache_shards(model_cfg, mesh, rules)
  block_bytes = sampling.cache_block_bytes(model_cfg, engine_cfg.block_size, dtype)
  num_blocks = getattr(engine_cfg, "num_blocks", None)
  if num_blocks is not None:  # the engine rounds a block count down to a multiple of the pool's shards
    num_blocks, source = int(num_blocks) - int(num_blocks) % shards, "rollout.engine.num_blocks"
  elif engine_cfg.kv_cache_bytes is not None:
    per_device, source = int(engine_cfg.kv_cache_bytes), "rollout.engine.kv_cache_bytes"
  else:
    if free_bytes is None:
      raise ValueError("rollout.engine.kv_cache_fraction: the budget depends on free device memory; give "
                       "kv_cache_bytes to plan it")
    per_device = int(engine_cfg.kv_cache_fraction * free_bytes)
    source = f"estimate: kv_cache_fraction {engine_cfg.kv_cache_fraction} of {free_bytes / 2**30:.2f} GiB free"
  if num_blocks is None:
    num_blocks = sampling.budget_blocks(per_device, block_bytes, shards, kv_split)
  return EngineBudget(num_slots=engine_cfg.num_slots, block_size=engine_cfg.block_size, max_len=max_len,
                      num_blocks=num_blocks, shards=shards, kv_split=kv_split, block_bytes=block_bytes,
                      bytes_per_device=num_blocks // shards * (block_bytes // kv_split), cache_dtype=dtype.name,
                      budget=source)


def stage_max_len(cfg, step: int) -> int:
  """The engine's ``max_len`` at RL step ``step`` of recipe ``cfg``: the trainer's own rule,
  :func:`jaxrl.rl.rollout_max_len`; an asynchronous recipe's engine is built once for every stage to come
  (``last=steps``), so its stages share one budget."""
  return rollout_max_len(cfg, step, last=cfg.steps if getattr(cfg, "asynchronous", None) is not None else None)


def recipe_budgets(cfg, model_cfg: models.ModelConfig, mesh: Mesh, *, free_bytes: int | None = None,
                   ) -> list[tuple[str, EngineBudget]]:
  """``(stage tag, budget)`` per distinct engine ``max_len`` of an RL recipe's context stages."""
  eng = cfg.rollout.engine
  if eng is None:
    return []
  stages = recipe_stages(cfg)
  rules = cfg.mesh.logical_rules()
  return [(tag, engine_budget(model_cfg, mesh, rules, eng, stage_max_len(cfg, st.step), free_bytes=free_bytes))
          for st, tag in _distinct(stages, lambda s: stage_max_len(cfg, s.step))]


def _free_bytes(ctx: PlanContext) -> int | None:
  if ctx.hbm_bytes is None:
    return None
  return ctx.hbm_bytes - device_bytes(_resident(ctx))


def _resident(ctx: PlanContext) -> tuple:
  """What sits in HBM beside the engine's pool while it rolls out: its weights (a compute-dtype copy) and
  the float32 master weights, the optimizer state and, with KL, the reference copy."""
  ref = reference_params(ctx) if ctx.cfg.algorithm.kl_coef > 0 else ()
  return rollout_params(ctx), ctx.state.opt_state, ref


def budgets(ctx: PlanContext) -> list[tuple[str, EngineBudget]]:
  """:func:`recipe_budgets` on the plan's mesh, sized for the full-depth model (``ctx.full_model_cfg``)
  so that a plan compiled at fewer layers keeps the real block count."""
  return recipe_budgets(ctx.cfg, ctx.full_model_cfg or ctx.model_cfg, ctx.mesh, free_bytes=_free_bytes(ctx))


def _embed_program(ctx: PlanContext, progs, params, co: dict, tag: str, prefill_rows: int,
                   prefix: str = "engine") -> tuple[Program, Any]:
  """The engine's vision-tower program and the abstract features ``[prefill_rows, M, D]`` one prefill call takes.

  The engine embeds, in one call per patch bucket, every prompt it admits in a schedule step that has images
  and no features yet (a group's first sample; the others fork its blocks), rows rounded up to a power of two:
  at most ``min(num_slots, prompts_per_step)`` prompts, the rows planned here, at the recipe's largest bucket."""
  mc, cfg = ctx.model_cfg, ctx.cfg
  rows = 1 << (min(cfg.rollout.engine.num_slots, cfg.rollout.prompts_per_step) - 1).bit_length()
  bucket = _vision.engine_patch_bucket(cfg, mc)
  images = _vision.vision_inputs(mc, rows=rows, num_patches=bucket, sharding=NamedSharding(ctx.mesh, PartitionSpec()))
  feats = jax.eval_shape(progs.embed, params, images)
  feats = jax.ShapeDtypeStruct((prefill_rows, *feats.shape[1:]), feats.dtype, sharding=NamedSharding(ctx.mesh, PartitionSpec()))
  per_image = _vision.patches_per_image(cfg)
  flops = _vision.tower_flops_per_patch(mc, per_image) * rows * cfg.data.images_per_prompt * per_image
  note = (f"vision tower over {rows} prompts x {bucket} patches ({cfg.data.images_per_prompt} x {per_image}-patch "
          f"images at max_pixels={cfg.data.images.max_pixels}, the engine's power-of-two bucket), once per prompt: "
          f"every prompt admitted in one schedule step (at most min(num_slots, prompts_per_step)), in one call")
  return Program(name=f"{prefix}_embed[{tag}]", fn=progs.embed, args=(params, images), kwargs={},
                 parts={**co, "batch": images}, flops=flops, note=note), feats


@register_programs("engine")
def engine_programs(ctx: PlanContext) -> list[Program]:
  """The rollout engine's prefill (the longest prompt, ``prefill_rows`` prompts), recompute (a prefill of
  the longest sequence, after a preemption or a weight update) and decode (``num_slots`` rows, one call of
  up to ``steps_per_call`` steps) per distinct ``max_len``, when the recipe sets ``rollout.engine``."""
  cfg = ctx.cfg
  eng = cfg.rollout.engine
  if eng is None:
    return []
  params, master = rollout_params(ctx)  # ``RLTrainer.sampling_model()``: compute-dtype weights
  resident_params = (master, reference_params(ctx) if cfg.algorithm.kl_coef > 0 else ())
  co = {"params": (params, resident_params), "opt_state": ctx.state.opt_state}
  resident = ((f"{ctx.model_cfg.dtype} weights read, float32 master weights, " if master else "")
              + "optimizer state" + (" and KL reference" if cfg.algorithm.kl_coef > 0 else "") + " co-resident")
  out = []
  for tag, b in budgets(ctx):
    out += pool_programs(ctx, eng, tag, b, params, co, resident, cfg.data.max_prompt_tokens)
  return out


def pool_programs(ctx: PlanContext, eng, tag: str, b: EngineBudget, params, co: dict, resident: str,
                  max_prompt_tokens: int, prefix: str = "engine") -> list[Program]:
  """The engine's programs on one pool ``b`` (settings ``eng``, an ``rl.EngineConfig``): prefill of the
  longest prompt (``max_prompt_tokens``), recompute of the longest row and decode, with ``params`` read and
  ``co`` (``parts`` beside the pool) resident; ``resident`` says what ``co`` holds in the rows' notes.
  Rows are named ``{prefix}_prefill[tag]`` and so on."""
  bad = b.check()
  if bad:
    raise ValueError(f"engine[{tag}]: {bad}")
  mc, out = ctx.model_cfg, []
  repl = NamedSharding(ctx.mesh, PartitionSpec())
  max_blocks = sampling.blocks_for(b.max_len, b.block_size)
  impl = sampling.paged_impl_for(mc.attention_impl)
  progs = sampling.engine_programs(ctx.graphdef, mc, ctx.mesh, ctx.rules, jnp.dtype(b.cache_dtype), impl,
                                   b.num_slots, b.max_len, max_blocks, b.num_blocks, b.block_size, None)
  page_shape = (mc.num_layers, b.num_blocks, b.block_size, mc.num_kv_heads, mc.head_dim)
  page = jax.ShapeDtypeStruct(page_shape, jnp.dtype(b.cache_dtype), sharding=progs.page_sharding)
  pages = (page, page)
  co = {**co, "kv_cache": pages}
  budget_note = (f"pool {b.num_blocks} blocks x {b.block_size} = {b.tokens_resident} tokens "
                 f"({b.bytes_per_device / 2**30:.2f} GiB per device); " + resident)
  vl, feats = {}, None
  if mc.vision is not None:  # the tower once per prompt, its rows sliced into the prefill chunks
    embed, feats = _embed_program(ctx, progs, params, co, tag, sampling.prefill_batch_rows(eng.prefill_rows, b.shards),
                                  prefix)
    out.append(embed)
  prompt_bucket = sampling.context_bucket(max_prompt_tokens - 1, 8, b.block_size, max_blocks)
  longest = sampling.context_bucket(b.max_len - 2, 8, b.block_size, max_blocks)
  for name, p in ((f"{prefix}_prefill", prompt_bucket), (f"{prefix}_recompute", longest)):
    if name == f"{prefix}_recompute" and p == prompt_bucket:
      continue
    u = sampling.prefill_batch_rows(eng.prefill_rows, b.shards)  # the engine's rows per call (row-local)
    t = p if eng.prefill_chunk is None else min(eng.prefill_chunk, p)  # one chunk's queries over p slots
    args = (params, pages, jax.ShapeDtypeStruct((u, t), jnp.int32, sharding=repl),
            jax.ShapeDtypeStruct((u,), jnp.int32, sharding=repl),
            jax.ShapeDtypeStruct((u, p // b.block_size), jnp.int32, sharding=repl))
    if t < p:
      args += (jax.ShapeDtypeStruct((u,), jnp.int32, sharding=repl),)  # start: the chunk's first position
    if feats is not None:  # a chunk with image tokens: M-RoPE positions and the tower's rows
      vl = dict(rope=jax.ShapeDtypeStruct((u, t, 3), jnp.int32, sharding=repl), feats=feats,
                feat_idx=jax.ShapeDtypeStruct((u, t), jnp.int32, sharding=repl),
                feat_mask=jax.ShapeDtypeStruct((u, t), jnp.bool_, sharding=repl))
    out.append(Program(
        name=f"{name}[{tag}]", fn=progs.prefill, args=args, kwargs=vl, parts={**co, "batch": (args[2:], vl)},
        flops=mc.flops_per_token(p, training=False) * u * t,
        note=(f"{u} rows x {p} tokens" if t == p else f"{u} rows x one {t}-token chunk of {p}")
             + " into the paged pool; " + budget_note))
  slots = jax.eval_shape(progs.empty_slots)
  slots = abstract(slots, progs.slot_sharding) if progs.slot_sharding is not None else slots
  stops = sampling.Stops(jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=repl),
                         jax.ShapeDtypeStruct((1,), jnp.int32, sharding=repl))
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)
  early = jax.ShapeDtypeStruct((), jnp.bool_, sharding=repl)
  args = (params, pages, slots, stops, scalar, scalar, early)
  out.append(Program(
      name=f"{prefix}_decode[{tag}]", fn=progs.decode, args=args, kwargs={},
      parts={**co, "batch": (slots, stops, scalar, scalar, early)},
      flops=mc.flops_per_token(b.max_len, training=False) * b.num_slots * eng.steps_per_call,
      note=f"{b.num_slots} slots, one call of up to {eng.steps_per_call} steps (model TFLOP at full context); "
           + budget_note))
  return out
