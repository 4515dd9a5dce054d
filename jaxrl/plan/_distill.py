"""``jaxrl plan`` rows of an RL recipe's ``distill:`` section: the teacher's log-prob program on the trainer mesh.

Under ``distill.mode: reverse_kl`` the trainer runs the frozen teacher (:class:`jaxrl.rl.Teacher`: its weights
in the compute dtype, on the trainer's mesh) over every mini-batch's sampled tokens with the trainer's own
log-prob program (``rl.make_logprob_program`` over ``rl.make_logprob_fn``); ``logprobs_teacher[sK]`` is that
program at each stage's worst-case layout, its ``params`` the teacher's weights on one device. Under ``gkd`` the
teacher's forward runs inside the train step (no row of its own; not planned yet, see docs/scaling.md). A
``distill.server`` teacher runs outside the trainer's devices: no row.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxrl import models
from jaxrl.plan._programs import (PlanContext, Program, _distinct, abstract, device_bytes, micro_batches,
                                  register_programs, train_batch)
from jaxrl.rl import make_logprob_fn, make_logprob_program


def teacher_params(ctx: PlanContext):
  """``(graphdef, abstract compute-dtype params, model config)`` of the recipe's teacher on ``ctx.mesh``."""
  source = ctx.cfg.distill.teacher
  try:
    mc = source.config()
  except FileNotFoundError as e:
    raise ValueError(f"distill.teacher: {e}; plan with a teacher preset") from e
  mc = dataclasses.replace(mc, attention_impl=ctx.model_cfg.attention_impl)  # the plan's kernel, as the student's
  model = models.abstract_model(mc, mesh=ctx.mesh, rules=ctx.rules)
  graphdef, state = nnx.split(model)
  params = abstract(state, models.state_shardings(state, ctx.mesh, ctx.rules))
  shape = jax.eval_shape(lambda p: models.cast_params(p, mc.dtype), params)
  return graphdef, abstract(shape, jax.tree.map(lambda p: p.sharding, params)), mc


@register_programs("teacher")
def teacher_programs(ctx: PlanContext) -> list[Program]:
  """``logprobs_teacher[sK]`` per distinct micro-batch layout (module docstring); none without ``distill:`` or
  under ``distill.mode: gkd``."""
  cfg = ctx.cfg
  if cfg.distill is None or cfg.distill.mode != "reverse_kl" or cfg.distill.server is not None:
    return []
  graphdef, params, mc = teacher_params(ctx)
  fn_inner = make_logprob_fn(graphdef, temperature=cfg.rollout.temperature,
                             chunk_size=cfg.algorithm.logprob_chunk_size)
  out = []
  for st, tag in _distinct(ctx.stages, lambda s: micro_batches(ctx, s)):
    row_len, rows, m = micro_batches(ctx, st)
    fn = make_logprob_program(fn_inner, m, mesh=ctx.mesh, batch_sharding=ctx.batch_sharding)
    batch = train_batch(ctx, st)
    out.append(Program(
        name=f"logprobs_teacher[{tag}]", fn=fn, args=(params, batch), kwargs={},
        parts={"params": params, "batch": batch},
        flops=mc.flops_per_token(row_len, training=False) * rows * m * row_len,
        note=(f"{m} micro-batches x {rows} rows x {row_len} tokens; the teacher's {mc.dtype} weights "
              f"({device_bytes(params) / 2**30:.2f} GiB per device) stay resident beside the train step and the "
              "engine, whose rows do not count them")))
  return out
