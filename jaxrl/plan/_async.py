"""``jaxrl plan`` for an ``asynchronous:`` recipe: the rollout and the trainer sub-mesh, each planned
against its own devices (docs/async.md, docs/scaling.md).

The asynchronous trainer (:mod:`jaxrl.rl._async`) splits the devices: the first
``asynchronous.rollout_devices`` (default 3/4) hold the continuous-batching engine on the
``asynchronous.rollout_mesh``, the rest the :class:`~jaxrl.rl.RLTrainer` on ``mesh:``. So the plan
splits the target's compile-only devices the same way (:func:`jaxrl.rl._async.split_devices`) and
compiles

* on the **rollout** sub-mesh the engine's programs (``engine``): compute-dtype weights (what
  ``AsyncRLTrainer.rollout_model`` puts there) and the paged KV pool, nothing else (no optimizer
  state, no KL reference: those live on the trainer devices);
* on the **trainer** sub-mesh the update and log-prob programs (``train``, ``logprobs``): float32
  master weights, optimizer state, the KL reference, the packed batch.

Rows are named ``rollout/…`` and ``trainer/…``; each row's peak is checked against the target's memory
per device, and its time estimate divides the FLOPs by its own sub-mesh's device count.
"""

from __future__ import annotations

import dataclasses
import types

from jaxrl.plan._engine import budgets
from jaxrl.plan._measure import Plan, build_mesh_shape, for_target_platform, measure_programs, model_config
from jaxrl.plan._measure import platform_attention, program_names, stage_programs
from jaxrl.plan._programs import build_context, device_bytes, reference_params
from jaxrl.plan._progress import QUIET
from jaxrl.rl import split_devices
from jaxrl.targets import GiB, get_target

ROLLOUT_PROGRAMS = ("engine", "sampler")
TRAINER_PROGRAMS = ("train", "logprobs")


def sub_configs(cfg):
  """``(rollout_cfg, trainer_cfg)``: the rollout side plans on ``asynchronous.rollout_mesh`` without the
  KL reference (it stays on the trainer devices); the trainer side is the recipe as written."""
  a = cfg.asynchronous
  mesh = dataclasses.replace(cfg.mesh, shape=dict(a.rollout_mesh))
  rollout = dataclasses.replace(cfg, mesh=mesh, algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.0))
  return rollout, cfg


def _rollout_context(ctx):
  """The rollout side holds compute-dtype weights (cast on the trainer, ``device_put`` onto the rollout
  shardings) and the engine's pool only: no optimizer state."""
  return dataclasses.replace(ctx, params=reference_params(ctx), state=types.SimpleNamespace(opt_state=()))


@for_target_platform
def plan_async(cfg, target_name: str, *, attention: str | None = None, layers: int | None = None,
               programs: tuple[str, ...] | None = None, stages: tuple[int, ...] | None = None,
               recipe: str = "", progress=None, compile: bool = True):
  """:func:`jaxrl.plan.plan_recipe` for a recipe with ``asynchronous:`` (one :class:`Plan`, rows of both
  sub-meshes)."""
  progress = progress or QUIET
  target = get_target(target_name)
  with progress.running(f"{target.name}: creating its compile-only {target.platform} devices"):
    devices = target.compile_devices()
  attention = attention or platform_attention(target)
  full = model_config(cfg, attention=attention, layers=None)
  names = program_names(programs)
  try:
    rollout_devices, trainer_devices = split_devices(cfg, devices)
  except ValueError as e:
    raise ValueError(f"{target.name}: {e}") from None
  rollout_cfg, trainer_cfg = sub_configs(cfg)
  sides = (("rollout", rollout_cfg, rollout_devices, [n for n in names if n in ROLLOUT_PROGRAMS]),
           ("trainer", trainer_cfg, trainer_devices, [n for n in names if n in TRAINER_PROGRAMS]))
  other = [n for n in names if n not in ROLLOUT_PROGRAMS + TRAINER_PROGRAMS]
  if other:  # a program group registered later: it runs where the trainer runs
    sides[1][3].extend(other)

  lines, rows, mesh, compiled = [], [], {}, (full.num_layers,)
  for side, scfg, devs, side_names in sides:
    try:
      side_mesh = build_mesh_shape(scfg, devs)
    except ValueError as e:
      key = "asynchronous.rollout_mesh" if side == "rollout" else "mesh.shape"
      raise ValueError(f"{key} on the {len(devs)} {side} devices of {target.name}: {e}") from None
    mesh.update({f"{side}.{a}": s for a, s in side_mesh.items()} or {f"{side}.devices": len(devs)})
    contexts = {}

    def programs_at(n_layers, scfg=scfg, devs=devs, side=side, side_names=side_names, contexts=contexts):
      mc = full if n_layers is None else dataclasses.replace(full, num_layers=n_layers)
      progress.say(f"{side} sub-mesh ({len(devs)} devices): building the abstract model and programs "
                   f"({', '.join(side_names) or 'none'}) at {mc.num_layers} of {full.num_layers} layers")
      ctx = build_context(scfg, devs, mc, full_model_cfg=full, hbm_bytes=target.hbm_bytes)
      if side == "rollout":
        ctx = _rollout_context(ctx)
      contexts[n_layers] = ctx
      out = stage_programs(ctx, side_names, stages)
      for prog in out:
        prog.name = f"{side}/{prog.name}"
        prog.note = _side_note(prog.note, side)
      return out

    side_rows, compiled = measure_programs(programs_at(None), programs_at, full.num_layers, layers, target,
                                           devices=len(devs), progress=progress, compile=compile)
    rows += side_rows
    ctx = contexts[None]
    head = (f"asynchronous {side} sub-mesh: {len(devs)} of {len(devices)} devices, mesh {side_mesh or {}}, "
            + ("engine programs; compute-dtype weights "
               f"{device_bytes(ctx.params) / GiB:.2f} GiB per device + the KV pool"
               if side == "rollout" else
               "update and log-prob programs; float32 master weights "
               f"{device_bytes(ctx.params) / GiB:.2f} GiB + optimizer state "
               f"{device_bytes(ctx.state.opt_state) / GiB:.2f} GiB per device"))
    lines.append(head)
    if side == "rollout" and "engine" in side_names:
      lines += [f"  {ln}" for tag, b in budgets(ctx) for ln in b.lines(f"rollout sub-mesh, stages {tag}")]
      lines.append(f"  weight transfer trainer -> rollout per RL step: {device_bytes(ctx.params) / GiB:.2f} GiB "
                   "arrives on each rollout device (jax.device_put of the compute-dtype copy) while the "
                   "engine still holds the previous version until it swaps")
  return Plan(recipe=recipe, target=target.name, mesh=mesh, attention=attention, layers=full.num_layers,
              compiled_layers=compiled, rows=rows, platform=target.platform, engine=lines,
              variant=dict(cfg.plan.overrides.get(target.name, {})))


def _side_note(note: str, side: str) -> str:
  """The engine's note names what is co-resident with it on a single mesh; on the rollout sub-mesh that is
  nothing but its weights and pool."""
  parts = [p for p in note.split("; ") if "co-resident" not in p]
  if side == "rollout" and len(parts) < len(note.split("; ")):
    parts.append("rollout sub-mesh: only the engine's compute-dtype weights and pool")
  return "; ".join(parts)

