"""The programs ``jaxrl eval --config RECIPE`` runs: the rollout engine of each of the recipe's
``eval.benchmarks`` (docs/eval.md), opt-in with ``jaxrl plan --programs eval``.

``jaxrl eval`` builds its engine (``jaxrl.eval.make_sampler``) from the recipe's ``rollout.engine``
``num_slots``, ``block_size`` and ``kv_cache_bytes`` (else :data:`jaxrl.eval.ENGINE_DEFAULTS`), the other
engine settings at their defaults, for rows of ``max_prompt_tokens + max_new_tokens`` tokens; without
``kv_cache_bytes`` its pool is ``num_slots * (ceil(max_len / block_size) + 1)`` blocks. It holds the weights
in the compute dtype and nothing else: no master weights, optimizer state or reference copy.
"""

from __future__ import annotations

from jaxrl import eval as eval_lib
from jaxrl.plan._engine import EngineBudget, engine_budget, pool_programs
from jaxrl.plan._programs import PlanContext, Program, reference_params, register_programs
from jaxrl.rl import EngineConfig


def eval_engine_config(cfg, max_len: int) -> EngineConfig:
  """The engine settings ``jaxrl eval --config`` uses for rows of ``max_len`` tokens (``make_sampler``)."""
  eng = cfg.rollout.engine
  slots, block, kv_bytes = (eval_lib.ENGINE_DEFAULTS[k] if eng is None else getattr(eng, k)
                            for k in ("num_slots", "block_size", "kv_cache_bytes"))
  num_blocks = None if kv_bytes else slots * (-(-max_len // block) + 1)
  return EngineConfig(num_slots=slots, block_size=block, kv_cache_bytes=kv_bytes, num_blocks=num_blocks)


def eval_shapes(cfg) -> list[tuple[str, int, int]]:
  """``(tag, max_prompt_tokens, max_len)`` per distinct benchmark shape of ``cfg.eval.benchmarks``; the tag
  names every benchmark with that shape (``aime24,math500``)."""
  groups: dict[tuple[int, int], list[str]] = {}
  for b in cfg.eval.benchmarks:
    groups.setdefault((b.max_prompt_tokens, b.max_prompt_tokens + b.max_new_tokens), []).append(b.name)
  return [(",".join(names), p, m) for (p, m), names in groups.items()]


def eval_budgets(ctx: PlanContext) -> list[tuple[str, int, EngineConfig, EngineBudget]]:
  """``(tag, max_prompt_tokens, settings, pool)`` per distinct benchmark shape, the pool sized for the
  full-depth model as ``jaxrl eval`` allocates it on the plan's mesh."""
  mc = ctx.full_model_cfg or ctx.model_cfg
  out = []
  for tag, prompt, max_len in eval_shapes(ctx.cfg):
    eng = eval_engine_config(ctx.cfg, max_len)
    out.append((tag, prompt, eng, engine_budget(mc, ctx.mesh, ctx.rules, eng, max_len)))
  return out


@register_programs("eval")
def eval_programs(ctx: PlanContext) -> list[Program]:
  """``eval_prefill``, ``eval_recompute`` and ``eval_decode`` (and ``eval_embed`` for a VLM) per distinct
  benchmark shape, as the training engine's (:func:`jaxrl.plan.engine_programs`) but on ``jaxrl eval``'s pool
  with compute-dtype weights only; none for a recipe without ``eval.benchmarks``."""
  if not ctx.cfg.eval.benchmarks:
    return []
  params = reference_params(ctx)  # ``load_inference_model(dtype=...)``: the weights in the compute dtype
  resident = f"{ctx.model_cfg.dtype} weights only (jaxrl eval: no master weights or optimizer state)"
  out = []
  for tag, prompt, eng, b in eval_budgets(ctx):
    out += pool_programs(ctx, eng, tag, b, params, {"params": params}, resident, prompt, prefix="eval")
  return out
