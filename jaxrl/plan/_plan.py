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
import re
import sys
import time
from typing import Any

from jaxrl.plan._progress import QUIET, Progress
from jaxrl.plan._targets import GiB, TARGETS, Target, TargetUnavailable, get_target

_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of the results of each collective kind in an HLO module's text (per device; an op inside
  a loop body is counted once, not once per iteration)."""
  out: dict[str, int] = {}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    size = 0
    for dt, dims in _SHAPE.findall(m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _BYTES[dt]
    out[m.group(2)] = out.get(m.group(2), 0) + size
  return out


@dataclasses.dataclass
class Row:
  """One program's line of the plan (bytes per device)."""

  program: str
  status: str
  "``ok``, ``oom`` (does not fit), or ``error`` (the compiler refused; see ``error``)."
  error: str = ""
  params: int = 0
  opt_state: int = 0
  kv_cache: int = 0
  batch: int = 0
  arguments: int = 0
  outputs: int = 0
  aliased: int = 0
  temporaries: int = 0
  code: int = 0
  peak: int = 0
  "max(arguments, shape-derived inputs) + outputs - aliased + temporaries + code: resident while it runs."
  hbm: int = 0
  headroom: float = 0.0
  "1 - peak / hbm."
  compiler_flops: float | None = None
  model_flops: float = 0.0
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)
  est_seconds: float = 0.0
  largest: str = ""
  note: str = ""
  extrapolated: bool = False
  compile_seconds: float = 0.0


_LINEAR = ("params", "opt_state", "kv_cache", "batch", "arguments", "outputs", "aliased", "temporaries", "code",
           "model_flops")


def _measure(prog, target: Target, *, layers_note: str = "", progress: Progress = QUIET, label: str = "",
             precheck: bool = False) -> Row:
  """Compiles ``prog`` and reads the compiler's numbers; ``precheck``: only the input bytes from shapes
  (a row marked ``oom`` when they alone exceed HBM, else ``ok`` with nothing measured). ``label`` is the
  progress line said before the compile (what, which of how many, at how many layers)."""
  from jaxrl.plan._programs import device_bytes
  row = Row(program=prog.name, status="ok", note=prog.note + layers_note, hbm=target.hbm_bytes,
            model_flops=prog.flops)
  for part in ("params", "opt_state", "kv_cache", "batch"):
    setattr(row, part, device_bytes(prog.parts.get(part, ())))
  known_out = device_bytes(prog.outputs)
  resident = row.params + row.opt_state + row.kv_cache + row.batch + known_out
  if (precheck or not layers_note) and resident > target.hbm_bytes:  # inputs (+ known outputs) do not fit
    row.status, row.arguments, row.peak = "oom", resident - known_out, resident
    row.outputs = known_out
    row.headroom = 1.0 - resident / row.hbm
    parts = {"parameters": row.params, "optimizer state": row.opt_state, "KV cache": row.kv_cache + known_out,
             "batch inputs": row.batch}
    name, size = max(parts.items(), key=lambda kv: kv[1])
    row.largest = f"{name} {size / GiB:.2f} GiB (from shapes: {resident / GiB:.2f} GiB; not compiled)"
    return row
  if precheck:
    return row
  t0 = time.perf_counter()
  lowered = None
  try:
    with progress.running(label or f"compiling {prog.name}"):
      lowered = prog.fn.lower(*prog.args, **prog.kwargs)
      t_lower = time.perf_counter() - t0
      compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001  (the compiler's refusal is the result)
    msg = str(e)
    row.compile_seconds = time.perf_counter() - t0
    row.status = "oom" if ("RESOURCE_EXHAUSTED" in msg or "Ran out of memory" in msg) else "error"
    row.error = f"{type(e).__name__}: {_first_lines(msg, 12)}"
    row.largest = _largest_from_error(msg)
    stage = "compile" if lowered is not None else "lowering"
    progress.say(f"  {prog.name}: {row.status} ({stage} failed after {row.compile_seconds:.0f} s)")
    return row
  row.compile_seconds = time.perf_counter() - t0
  t1 = time.perf_counter()
  with progress.running(f"reading {prog.name}'s memory, FLOPs and HLO collectives", announce=False):
    mem = compiled.memory_analysis()
    if mem is not None:
      row.arguments = int(mem.argument_size_in_bytes)
      row.outputs = int(mem.output_size_in_bytes)
      row.aliased = int(mem.alias_size_in_bytes)
      row.temporaries = int(mem.temp_size_in_bytes)
      row.code = int(mem.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
      cost = cost[0] if cost else None
    if cost and "flops" in cost:
      row.compiler_flops = float(cost["flops"])
    try:
      row.collectives = collective_bytes(compiled.as_text())
    except Exception:  # noqa: BLE001  (some plugins do not print HLO; the row stays without it)
      row.collectives = {}
  progress.say(f"  compiled {prog.name} in {row.compile_seconds:.0f} s (traced and lowered in {t_lower:.0f} s; "
               f"memory, FLOPs and collectives read in {time.perf_counter() - t1:.0f} s)")
  return row


def _finish(row: Row, target: Target, devices: int) -> Row:
  if row.status != "ok":
    return row
  # Inputs a program never reads are dropped from its arguments but still sit in HBM: count them.
  inputs = row.params + row.opt_state + row.kv_cache + row.batch
  row.peak = max(row.arguments, inputs) + row.outputs - row.aliased + row.temporaries + row.code
  row.headroom = 1.0 - row.peak / row.hbm
  flops = row.model_flops / devices
  moved = row.arguments + row.outputs + 2 * row.temporaries
  row.est_seconds = max(flops / target.peak_flops, moved / target.hbm_bandwidth)
  parts = {"parameters": row.params, "optimizer state": row.opt_state, "KV cache": row.kv_cache,
           "batch inputs": row.batch, "temporaries": row.temporaries, "outputs": row.outputs - row.aliased}
  name, size = max(parts.items(), key=lambda kv: kv[1])
  row.largest = f"{name} {size / GiB:.2f} GiB"
  if row.peak > row.hbm:
    row.status = "oom"
  return row


def _first_lines(msg: str, n: int) -> str:
  lines = [ln for ln in msg.splitlines() if ln.strip()]
  return " | ".join(lines[:n])[:2000]


def _largest_from_error(msg: str) -> str:
  m = re.search(r"(HLO temporaries|Program hbm requirement|Largest program allocations)[^\n]*", msg)
  if m:
    return m.group(0)[:300]
  m = re.search(r"Ran out of memory[^\n]*", msg)
  return m.group(0)[:300] if m else ""


def _extrapolate(small: Row, big: Row, k: int, total: int, target: Target) -> Row:
  """Linear in the layer count from compiles at ``k`` and ``2k`` layers, to ``total`` layers."""
  if small.status == "error" or big.status == "error":
    return big if big.status == "error" else small
  if small.status == "oom" and not small.arguments:
    return small
  row = dataclasses.replace(big)
  for f in _LINEAR:
    a, b = getattr(small, f), getattr(big, f)
    value = type(a)(b + (b - a) * (total - 2 * k) / k)
    if b < a:  # shrinks with more layers: not linear (the compiler chose another schedule), not extrapolated
      value = a
      row.note += (f"; {f} fell from {a / GiB:.2f} to {b / GiB:.2f} GiB between {k} and {2 * k} layers, "
                   "not extrapolated (the larger measured value is shown)")
    setattr(row, f, value)
  if small.compiler_flops is not None and big.compiler_flops is not None:
    row.compiler_flops = big.compiler_flops + (big.compiler_flops - small.compiler_flops) * (total - 2 * k) / k
  row.collectives = {c: int(v + (v - small.collectives.get(c, 0)) * (total - 2 * k) / k)
                     for c, v in big.collectives.items()}
  row.extrapolated = True
  row.status = "ok"
  return row


@dataclasses.dataclass
class Plan:
  recipe: str
  target: str
  mesh: dict[str, int]
  attention: str
  layers: int
  compiled_layers: tuple[int, ...]
  rows: list[Row]
  platform: str
  engine: list[str] = dataclasses.field(default_factory=list)
  "The rollout engine's KV budget per device, one line per distinct ``max_len`` (empty without an engine)."
  variant: dict[str, Any] = dataclasses.field(default_factory=dict)
  "The recipe's ``plan.overrides`` for this target (``load_recipe(..., target=)`` applies them)."

  @property
  def ok(self) -> bool:
    return all(r.status == "ok" for r in self.rows)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def platform_attention(target: Target) -> str:
  return "pallas_tpu" if target.platform == "tpu" else "pallas_triton"


def load_recipe(path: str | None, overrides=(), *, target: str | None = None):
  """The recipe at ``path``; with ``target``, its ``plan.overrides[target]`` applied before ``overrides``
  (what ``jaxrl plan --target`` and ``jaxrl rl --target`` run)."""
  from jaxrl import config as config_lib
  from jaxrl.rl import RLConfig
  cfg = config_lib.load(RLConfig, path, list(overrides))
  if target is not None and cfg.plan.overrides.get(target):
    cfg = config_lib.load(RLConfig, path, [*cfg.plan.for_target(target), *overrides])
  return cfg


def model_config(cfg, *, attention: str, layers: int | None):
  """The recipe's model shapes (its HF config.json, else ``plan.preset``) with the plan's attention."""
  src = cfg.model
  if src.preset is None and cfg.plan.preset is not None:
    from pathlib import Path
    if not (Path(src.hf_dir) / "config.json").is_file():
      src = dataclasses.replace(src, preset=cfg.plan.preset, hf_dir=None)
  try:
    mc = src.config()
  except FileNotFoundError as e:
    raise ValueError(f"{e}; set plan.preset to plan without the checkpoint") from e
  overrides = {"attention_impl": attention}
  if layers is not None:
    overrides["num_layers"] = layers
  return dataclasses.replace(mc, **overrides)


def program_names(programs) -> list[str]:
  """The registered program groups ``programs`` names (all of them for ``None``); an unknown one is an error."""
  from jaxrl.plan._programs import PROGRAMS
  names = list(PROGRAMS) if programs is None else list(programs)
  unknown = set(names) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"--programs: unknown {sorted(unknown)}; known: {list(PROGRAMS)}")
  return names


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
  if getattr(cfg, "asynchronous", None) is not None:  # two sub-meshes, each planned on its own devices
    from jaxrl.plan._async import plan_async
    return plan_async(cfg, target_name, attention=attention, layers=layers, programs=programs, stages=stages,
                      recipe=recipe, progress=progress, compile=compile)
  from jaxrl.plan._programs import build_context
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
  from jaxrl.plan._engine import budgets
  engine = [line for tag, b in budgets(contexts[None]) for line in b.lines(f"stages {tag}")]
  rows, compiled = measure_programs(full_programs, programs_at, full.num_layers, layers, target,
                                    devices=len(devices), progress=progress, compile=compile)
  mesh = dict(build_mesh_shape(cfg, devices))
  progress.say(f"plan of {len(rows)} programs done")
  return Plan(recipe=recipe, target=target.name, mesh=mesh, attention=attention, layers=full.num_layers,
              compiled_layers=compiled, rows=rows, platform=target.platform, engine=engine,
              variant=dict(cfg.plan.overrides.get(target.name, {})))


def stage_programs(ctx, names: list[str], stages) -> list:
  """The programs of the groups ``names`` built on ``ctx``, those tagged with one of ``stages`` (all for None)."""
  from jaxrl.plan._programs import PROGRAMS
  out = []
  for name in names:
    for prog in PROGRAMS[name](ctx):
      tags = prog.name[prog.name.index("[") + 1:-1].split(",") if "[" in prog.name else []
      if stages is None or any(f"s{s}" in tags for s in stages):
        out.append(prog)
  return out


def measure_programs(full_programs: list, programs_at, full_layers: int, layers: int | None, target, *,
                     devices: int, progress: Progress = QUIET,
                     compile: bool = True) -> tuple[list, tuple[int, ...]]:
  """Finished rows for ``full_programs`` (``programs_at(None)``, on ``devices`` devices) and the layer
  counts compiled: every program at full depth, or at ``layers`` and ``2 * layers`` (``programs_at(k)``)
  extrapolated, with inputs that cannot fit at full depth reported from their shapes; ``compile=False``:
  the inputs from shapes only. Each program's two depths compile one after the other, and each row is
  reported (``progress``) as soon as it is complete."""
  def done(row: Row) -> Row:
    row = _finish(row, target, devices)
    if row.status == "error":
      progress.say(f"row {row.program}: error")
    else:
      progress.say(f"row {row.program}: {row.status}, peak {_gib(row.peak)} of {_gib(row.hbm)} GiB per device "
                   f"({100 * row.headroom:.0f}% headroom){' from shapes' if not compile else ''}")
    return row

  if not compile:
    rows = [_measure(p, target, precheck=True) for p in full_programs]
    for r in rows:
      r.note += "; from shapes only (not compiled: temporaries and outputs not counted, peak is a lower bound)"
    return [done(r) for r in rows], ()
  n = len(full_programs)
  if layers is None or layers * 2 >= full_layers:
    return [done(_measure(p, target, progress=progress,
                          label=f"compile {i + 1}/{n}: {p.name} at all {full_layers} layers"))
            for i, p in enumerate(full_programs)], (full_layers,)
  pre = [_measure(p, target, precheck=True) for p in full_programs]
  for r in pre:
    if r.status == "oom":
      progress.say(f"{r.program}: its inputs alone exceed HBM at {full_layers} layers ({r.largest}); not compiled")
  note = f"; extrapolated from {layers} and {2 * layers} of {full_layers} layers"
  depths = (layers, 2 * layers)
  at = [programs_at(k) for k in depths]
  total = 2 * sum(r.status != "oom" for r in pre)
  progress.say(f"--layers {layers}: {total} compiles, each program at {layers} and {2 * layers} of {full_layers} "
               "layers, extrapolated linearly")
  rows, count = [], 0
  for i, r in enumerate(pre):
    if r.status == "oom":
      rows.append(done(r))
      continue
    measured = []
    for k, progs in zip(depths, at):
      count += 1
      measured.append(_measure(progs[i], target, layers_note=note, progress=progress,
                               label=f"compile {count}/{total}: {progs[i].name} at {k} of {full_layers} layers"))
    rows.append(done(_extrapolate(*measured, layers, full_layers, target)))
  return rows, depths


def build_mesh_shape(cfg, devices) -> dict[str, int]:
  from jaxrl import sharding
  mesh = sharding.make_mesh(cfg.mesh.shape, devices=devices)
  return {a: int(s) for a, s in mesh.shape.items() if s > 1}


def _gib(b: float) -> str:
  return f"{b / GiB:.2f}"


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
        r.program, r.status, _gib(r.params), _gib(r.opt_state), _gib(r.kv_cache), _gib(r.batch),
        _gib(r.temporaries), _gib(r.outputs - r.aliased), _gib(r.peak), _gib(r.hbm), f"{100 * r.headroom:.0f}%",
        cf, f"{r.model_flops / 1e12:.1f}", _gib(sum(r.collectives.values())), f"{r.est_seconds:.2f}"]) + " |")
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
  need = f"peak {_gib(r.peak)} GiB > HBM {_gib(r.hbm)} GiB" if r.peak else (r.error[:400] or "out of memory")
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
  import os

  import jax
  from jax._src import xla_bridge
  if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def _no_persistent_cache() -> None:
  """Turns JAX's persistent compilation cache off for this process (``jaxrl`` turns it on): JAX cannot load
  a compile-only device's executable back from it (jax 0.10.2: "PjRtCompiler must be constructed with a
  Client to call DeserializeLoadedExecutable"), so every entry written (about 10 MB per real-shape train
  step) only fills the cache directory, and every later plan warns that it could not read it. Before the
  first compile: JAX decides once per process whether the cache is used."""
  import jax
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
  from jaxrl.config import ConfigError
  try:
    cfg = load_recipe(ns.config, ns.overrides)
    targets = [ns.target] if ns.target else list(cfg.plan.targets)
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
  except (ConfigError, ValueError, TargetUnavailable) as e:
    print(f"jaxrl plan: {e}", file=sys.stderr)
    return 2
  if ns.json:
    with open(ns.json, "w") as f:
      json.dump([pl.to_json() for pl in plans], f, indent=2)
  bad = [(pl, r) for pl in plans for r in pl.rows if r.status != "ok"]
  for pl, r in bad:
    print(f"jaxrl plan: {advice(r, pl)}", file=sys.stderr)
  return 1 if bad else 0
