"""Measuring a plan's programs: compile each one for the target's compile-only devices and read the
compiler's numbers into a :class:`Row` (memory, FLOPs, collectives), with the estimates derived from
shapes; the pieces both the single-mesh plan (:mod:`jaxrl.plan._plan`) and the asynchronous one
(:mod:`jaxrl.plan._async`) are built from.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from pathlib import Path
from typing import Any

from jaxrl import sharding
from jaxrl._compile_target import compiling_for
from jaxrl.plan._programs import PROGRAMS, device_bytes
from jaxrl.plan._progress import QUIET, Progress
from jaxrl.targets import GiB, Target, get_target

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


def for_target_platform(plan_fn):
  """``plan_fn(cfg, target_name, ...)`` run inside :func:`jaxrl._compile_target.compiling_for` the target's
  platform: every program it builds, traces and compiles takes the target's platform-dependent choices (the
  log-prob target logit, ``"auto"`` kernels, the engine's layer layout), not this CPU host's."""
  @functools.wraps(plan_fn)
  def run(cfg, target_name: str, *args, **kwargs):
    with compiling_for(get_target(target_name).platform):
      return plan_fn(cfg, target_name, *args, **kwargs)
  return run


def platform_attention(target: Target) -> str:
  """The attention kernel a plan compiles for ``target`` unless ``--attention`` names one: its platform's
  Pallas kernel, the XLA reference for the ``cpu`` target (Pallas kernels do not compile for CPU)."""
  return {"tpu": "pallas_tpu", "cuda": "pallas_triton"}.get(target.platform, "reference")


def model_config(cfg, *, attention: str, layers: int | None):
  """The recipe's model shapes (its HF config.json, else ``plan.preset``) with the plan's attention."""
  src = cfg.model
  if src.preset is None and cfg.plan.preset is not None:
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


OPT_IN_PROGRAMS = ("eval",)
"""Program groups compiled only when ``--programs`` names them (``eval``: ``jaxrl eval``'s engine, not training's)."""


def program_names(programs) -> list[str]:
  """The registered program groups ``programs`` names (for ``None`` all but :data:`OPT_IN_PROGRAMS`); an
  unknown one is an error."""
  names = [n for n in PROGRAMS if n not in OPT_IN_PROGRAMS] if programs is None else list(programs)
  unknown = set(names) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"--programs: unknown {sorted(unknown)}; known: {list(PROGRAMS)}")
  return names


def stage_programs(ctx, names: list[str], stages) -> list:
  """The programs of the groups ``names`` built on ``ctx``, those tagged with one of ``stages`` (all for None)."""
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
      progress.say(f"row {row.program}: {row.status}, peak {gib(row.peak)} of {gib(row.hbm)} GiB per device "
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
  mesh = sharding.make_mesh(cfg.mesh.shape, devices=devices)
  return {a: int(s) for a, s in mesh.shape.items() if s > 1}


def gib(b: float) -> str:
  return f"{b / GiB:.2f}"
