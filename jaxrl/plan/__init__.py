"""AOT compile plans: a recipe's jitted programs compiled for target hardware, bytes per device.

``jaxrl plan --config RECIPE --target v5p-8`` (docs/scaling.md). TPU targets need ``libtpu`` and
NVIDIA targets the CUDA plugin (``pip install 'jaxrl[plan]'``); neither needs the hardware.

Layer (docs/design.md): may import ``envs``, ``rl`` and the layers below (``jaxrl.targets`` for the hardware);
not ``cli``.
"""

from jaxrl.plan._distill import teacher_programs
from jaxrl.plan._engine import EngineBudget, engine_budget, engine_programs, pool_programs, recipe_budgets
from jaxrl.plan._eval import eval_budgets, eval_engine_config, eval_programs, eval_shapes
from jaxrl.plan._measure import OPT_IN_PROGRAMS, Plan, Row, collective_bytes, measure_programs, program_names
from jaxrl.plan._plan import advice, format_plan, load_recipe, main, plan_recipe, plan_targets
from jaxrl.plan._pref import PREF_PROGRAMS, plan_pref
from jaxrl.plan._programs import (PROGRAMS, PlanContext, Program, build_context, device_bytes, image_bucket, micro_batches,
                                  register_programs, train_batch)
from jaxrl.plan._vision import patches_per_image, runs_tower, vision_batch, vision_bucket
from jaxrl.targets import TARGETS, Target, TargetUnavailable, get_target

__all__ = [
    "OPT_IN_PROGRAMS",
    "PREF_PROGRAMS",
    "PROGRAMS",
    "TARGETS",
    "Plan",
    "PlanContext",
    "Program",
    "Row",
    "Target",
    "TargetUnavailable",
    "EngineBudget",
    "advice",
    "build_context",
    "collective_bytes",
    "device_bytes",
    "engine_budget",
    "engine_programs",
    "eval_budgets",
    "eval_engine_config",
    "eval_programs",
    "eval_shapes",
    "format_plan",
    "get_target",
    "image_bucket",
    "load_recipe",
    "main",
    "micro_batches",
    "patches_per_image",
    "plan_pref",
    "pool_programs",
    "program_names",
    "plan_recipe",
    "plan_targets",
    "register_programs",
    "runs_tower",
    "teacher_programs",
    "train_batch",
    "vision_batch",
    "vision_bucket",
    "measure_programs",
    "recipe_budgets",
]
