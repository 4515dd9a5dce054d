"""``jaxrl plan``: AOT-compile a recipe's programs for a target and check that they fit.

Compiler-measured: whether a program compiles, ``memory_analysis()`` (arguments, outputs, aliased
bytes, temporaries, generated code), ``cost_analysis()`` FLOPs (TPU; the CUDA plugin reports none)
and the collectives in the optimized HLO. Derived from shapes: the split of the arguments into
parameters, optimizer state, KV cache and batch. Estimates: model FLOPs, the time from peak FLOP/s and
HBM bandwidth, and anything extrapolated with ``--layers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
from jax._src import xla_bridge

from jaxrl import config as config_lib
from jaxrl.plan._async import plan_async
from jaxrl.plan._engine import budgets
from jaxrl.plan._measure import Plan, Row, build_mesh_shape, for_target_platform, gib, measure_programs, model_config
from jaxrl.plan._measure import platform_attention, program_names, stage_programs
from jaxrl.plan._pref import is_pref_recipe, load_pref_recipe, plan_pref, plan_section
from jaxrl.plan._programs import build_context
from jaxrl.plan._progress import Progress
from jaxrl.pref import DPOConfig
from jaxrl.rl import RLConfig
from jaxrl.targets import TARGETS, TargetUnavailable, get_target


def load_recipe(path: str | None, overrides=(), *, target: str | None = None):
  """The recipe at ``path``; with ``target``, its ``plan.overrides[target]`` applied before ``overrides``
  (what ``jaxrl plan --target`` and ``jaxrl rl --target`` run). A preference recipe (a top-level ``pairs:``
  key) loads as :class:`jaxrl.pref.DPOConfig`."""
  if is_pref_recipe(path):
    return load_pref_recipe(path, overrides, target=target)
  cfg = config_lib.load(RLConfig, path, list(overrides))
  if target is not None and cfg.plan.overrides.get(target):
    cfg = config_lib.load(RLConfig, path, [*cfg.plan.for_target(target), *overrides])
  return cfg


@for_target_platform
def plan_recipe(cfg, target_name: str, *, attention: str | None = None, layers: int | None = None,
                programs: tuple[str, ...] | None = None, stages: tuple[int, ...] | None = None,
                recipe: str = "", verbose: bool = False, compile: bool = True,
                progress: Progress | None = None) -> Plan:
  """Compiles every registered program of ``cfg`` for ``target_name`` (see module docstring).

  ``compile=False`` (``--shapes-only``): no compile; each row's peak is its inputs from shapes (parameters,
  optimizer state, KV cache, batch), a lower bound of the compiled peak (temporaries and outputs are 0).
  ``verbose`` (or a ``progress``): progress lines on stderr for every phase and compile.
  """
  progress = progress or Progress(enabled=verbose)
  if isinstance(cfg, DPOConfig):  # a preference recipe: its pair step and reference programs
    return plan_pref(cfg, target_name, attention=attention, layers=layers, programs=programs, recipe=recipe,
                     progress=progress, compile=compile)
  if getattr(cfg, "asynchronous", None) is not None and program_names(programs) == ["eval"]:
    cfg = dataclasses.replace(cfg, asynchronous=None)  # ``jaxrl eval`` runs on ``mesh.shape``, every device
  if getattr(cfg, "asynchronous", None) is not None:  # two sub-meshes, each planned on its own devices
    return plan_async(cfg, target_name, attention=attention, layers=layers, programs=programs, stages=stages,
                      recipe=recipe, progress=progress, compile=compile)
  target = get_target(target_name)
  with progress.running(f"{target.name}: creating its compile-only {target.platform} devices"):
    devices = target.compile_devices()
  progress.say(f"{target.name}: {len(devices)} devices")
  attention = attention or platform_attention(target)
  full = model_config(cfg, attention=attention, layers=None)
  names = program_names(programs)

  contexts = {}

  def programs_at(n_layers: int | None) -> list:
    mc = full if n_layers is None else dataclasses.replace(full, num_layers=n_layers)
    depth = f"{mc.num_layers} of {full.num_layers} layers" if n_layers is not None else f"{full.num_layers} layers"
    with progress.running(f"building the abstract model, train state and programs ({', '.join(names)}) at {depth}"):
      ctx = contexts[n_layers] = build_context(cfg, devices, mc, full_model_cfg=full, hbm_bytes=target.hbm_bytes)
      return stage_programs(ctx, names, stages)

  full_programs = programs_at(None)
  engine = [line for tag, b in budgets(contexts[None]) for line in b.lines(f"stages {tag}")]
  if full.vision is not None and "sampler" in names and cfg.rollout.engine is None:
    engine.append("VLM: the sampler rows are planned on the TEXT path (prompts of image-token placeholders, no vision "
                  "tower, 1-D rotary positions); the rollout engine's rows carry the images")
  rows, compiled = measure_programs(full_programs, programs_at, full.num_layers, layers, target,
                                    devices=len(devices), progress=progress, compile=compile)
  mesh = dict(build_mesh_shape(cfg, devices))
  progress.say(f"plan of {len(rows)} programs done")
  return Plan(recipe=recipe, target=target.name, mesh=mesh, attention=attention, layers=full.num_layers,
              compiled_layers=compiled, rows=rows, platform=target.platform, engine=engine,
              variant=dict(cfg.plan.overrides.get(target.name, {})))


def plan_targets(cfg) -> tuple[str, ...]:
  """The recipe's ``plan.targets`` (an RL or a preference recipe)."""
  return plan_section(cfg).targets if isinstance(cfg, DPOConfig) else cfg.plan.targets


def format_plan(plan: Plan) -> str:
  """The plan as a Markdown table plus notes (what is measured, what is estimated, what failed)."""
  head = (f"plan: {plan.recipe or 'recipe'} on {plan.target} ({plan.platform}), mesh {plan.mesh}, "
          f"attention={plan.attention}, {plan.layers} layers")
  if not plan.compiled_layers:
    head += " (NOT COMPILED: inputs from shapes only; peak is a lower bound)"
  elif len(plan.compiled_layers) > 1:
    head += (f" (compiled {plan.compiled_layers[0]} and {plan.compiled_layers[1]} layers; bytes, FLOPs and "
             "collectives extrapolated linearly to all layers)")
  if plan.variant:
    head += f"; recipe variant plan.overrides[{plan.target}]: " + ", ".join(f"{k}={v}" for k, v in plan.variant.items())
  cols = ["program", "status", "params", "opt", "kv", "batch", "temp", "out", "peak", "HBM", "headroom",
          "compiler TFLOP", "model TFLOP", "collective GiB", "est. s"]
  lines = [head, *plan.engine, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in plan.rows:
    if r.status == "error" or (r.status == "oom" and not r.arguments):
      lines.append(f"| {r.program} | {r.status} | " + " | ".join(["-"] * (len(cols) - 2)) + " |")
      continue
    cf = "-" if r.compiler_flops is None else f"{r.compiler_flops / 1e12:.1f}"
    lines.append("| " + " | ".join([
        r.program, r.status, gib(r.params), gib(r.opt_state), gib(r.kv_cache), gib(r.batch),
        gib(r.temporaries), gib(r.outputs - r.aliased), gib(r.peak), gib(r.hbm), f"{100 * r.headroom:.0f}%",
        cf, f"{r.model_flops / 1e12:.1f}", gib(sum(r.collectives.values())), f"{r.est_seconds:.2f}"]) + " |")
  lines.append("")
  lines.append("GiB per device. Measured by the compiler: status, temp, out, peak, compiler TFLOP (per device), "
               "collective GiB (result bytes of all-reduce/all-gather/reduce-scatter/all-to-all/collective-permute "
               "in the optimized HLO, loop bodies counted once). From shapes: params, opt, kv, batch. Estimates: "
               "model TFLOP (all devices), est. s = max(model FLOPs / devices / peak, bytes / HBM bandwidth).")
  for r in plan.rows:
    lines.append(f"- {r.program}: {r.note}" + (f"; compile {r.compile_seconds:.0f} s" if r.compile_seconds else ""))
    if r.status != "ok":
      lines.append(f"  DOES NOT FIT OR COMPILE: {advice(r, plan)}")
  return "\n".join(lines)


def advice(r: Row, plan: Plan) -> str:
  """What failed and what to change, in one line."""
  if r.status == "error":
    return f"{r.program} failed to compile: {r.error[:600]}"
  what = r.largest or "unknown allocation"
  need = f"peak {gib(r.peak)} GiB > HBM {gib(r.hbm)} GiB" if r.peak else (r.error[:400] or "out of memory")
  program = r.program.rsplit("/", 1)[-1]  # an asynchronous recipe's rows are "rollout/…", "trainer/…"
  if program.startswith("engine"):
    fix = ("the engine's pool is rollout.engine.kv_cache_bytes per device (from shapes) and its decode holds "
           "num_slots rows: a smaller kv_cache_bytes, fewer num_slots or prefill_rows, or more devices")
  elif program.startswith("sampler"):
    fix = ("the fixed-shape sampler allocates a KV cache for every row at the full length: fewer rows per "
           "generate call (rollout.reward_overlap_chunks), a shorter max_new_tokens, more devices, or the "
           "paged rollout engine")
  else:
    fix = ("a smaller micro_batch.token_budget (fewer rows per micro-batch), remat: full, more fsdp devices "
           "(mesh.shape.fsdp) or tensor parallelism (mesh.shape.tensor) to shard weights and activations")
  return f"{r.program} on {plan.target}: {need}; largest allocation: {what}. Change: {fix}."


def _cpu_backend() -> None:
  """Plans run on the CPU backend (compile-only target devices need no accelerator). Unless the user
  chose ``JAX_PLATFORMS``, select it before JAX starts a backend: on a machine without CUDA the CUDA
  plugin's failed initialisation would otherwise also take away its compile-only topology."""
  if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def _no_persistent_cache() -> None:
  """Turns JAX's persistent compilation cache off for this process (``jaxrl`` turns it on): JAX cannot load
  a compile-only device's executable back from it (jax 0.10.2: "PjRtCompiler must be constructed with a
  Client to call DeserializeLoadedExecutable"), so every entry written (about 10 MB per real-shape train
  step) only fills the cache directory, and every later plan warns that it could not read it. Before the
  first compile: JAX decides once per process whether the cache is used."""
  jax.config.update("jax_enable_compilation_cache", False)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="jaxrl plan", description="AOT-compile a recipe's programs for target "
                              "hardware on this machine and check per-device memory (docs/scaling.md)")
  p.add_argument("--config", required=True, help="RL recipe YAML")
  p.add_argument("--target", default=None, help=f"one of {sorted(TARGETS)} (default: the recipe's plan.targets)")
  p.add_argument("--layers", type=int, default=None,
                 help="compile K and 2K scanned layers and extrapolate linearly to the model's layer count (a "
                      "rough estimate: XLA's memory is not linear in depth; without it the full depth compiles, "
                      "as fast with scanned layers)")
  p.add_argument("--attention", default=None, help="attention_impl (default: the target platform's Pallas kernel)")
  p.add_argument("--programs", default=None, help="comma-separated subset of the registered program groups")
  p.add_argument("--stages", default=None, help="comma-separated context-stage indices to plan (default: all)")
  p.add_argument("--json", default=None, help="write the table(s) as JSON here")
  p.add_argument("--shapes-only", action="store_true",
                 help="no compile: inputs from shapes only (a lower bound of each program's peak; seconds, not minutes)")
  p.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
  ns = p.parse_args(argv)
  _cpu_backend()
  try:
    cfg = load_recipe(ns.config, ns.overrides)
    targets = [ns.target] if ns.target else list(plan_targets(cfg))
    if not targets:
      raise ValueError(f"{ns.config}: give --target or set plan.targets in the recipe")
    if any(get_target(t).platform != "cpu" for t in targets):
      _no_persistent_cache()
    plans = []
    progress = Progress()
    for t in targets:
      progress.say(f"planning {ns.config} on {t}" + (" (shapes only)" if ns.shapes_only else ""))
      plans.append(plan_recipe(
          load_recipe(ns.config, ns.overrides, target=t), t, attention=ns.attention, layers=ns.layers,
          programs=tuple(ns.programs.split(",")) if ns.programs else None,
          stages=tuple(int(s) for s in ns.stages.split(",")) if ns.stages else None, recipe=ns.config,
          progress=progress, compile=not ns.shapes_only))
      print(format_plan(plans[-1]), flush=True)  # each target's table as soon as it is done
      print(flush=True)
  except (config_lib.ConfigError, ValueError, TargetUnavailable) as e:
    print(f"jaxrl plan: {e}", file=sys.stderr)
    return 2
  if ns.json:
    with open(ns.json, "w") as f:
      json.dump([pl.to_json() for pl in plans], f, indent=2)
  bad = [(pl, r) for pl in plans for r in pl.rows if r.status != "ok"]
  for pl, r in bad:
    print(f"jaxrl plan: {advice(r, pl)}", file=sys.stderr)
  return 1 if bad else 0
