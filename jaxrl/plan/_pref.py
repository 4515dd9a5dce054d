"""``jaxrl plan`` for a preference recipe (``jaxrl dpo``, :class:`jaxrl.pref.DPOConfig`): its two programs.

* ``train_step``: the pair step :class:`jaxrl.pref.DPOTrainer` builds (``train.make_train_step`` over
  :func:`jaxrl.pref.pref_loss_fn`, ``micro_batches`` scanned micro-batches, the optimizer), with the
  reference's forward inside it when ``reference: model`` (its frozen compute-dtype copy an input);
* ``reference_logps``: the reference's log-prob program (:func:`jaxrl.pref.reference_logps`) on one global
  batch, what ``reference: precompute`` runs over every pair before training.

A reward-model recipe (``loss.name: bradley_terry``) plans its ``train_step`` over
:func:`jaxrl.pref.rm_loss_fn` on the trunk with the scalar head (:func:`jaxrl.pref.reward_value_model`, with the
unembedding under ``loss.logprob_feature``); it has no reference.

A preference recipe is a YAML with a top-level ``pairs:`` key; its ``plan:`` section (targets, preset,
per-target overrides) is read as the RL recipes' (:class:`jaxrl.rl.PlanSection`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import models, pref, sharding, train
from jaxrl.plan._measure import Plan, build_mesh_shape, for_target_platform, measure_programs, platform_attention
from jaxrl.plan._programs import Program, abstract, abstract_train_state
from jaxrl.plan._progress import Progress
from jaxrl.rl import PlanSection
from jaxrl.targets import get_target

PREF_PROGRAMS = ("train", "reference")
"""``--programs`` groups of a preference recipe."""


def is_pref_recipe(path: str | None) -> bool:
  """Whether the YAML at ``path`` is a preference recipe (a top-level ``pairs:`` key)."""
  if path is None:
    return False
  with open(path, encoding="utf-8") as f:
    data = yaml.safe_load(f)
  return isinstance(data, dict) and "pairs" in data


def plan_section(cfg: pref.DPOConfig) -> PlanSection:
  """The recipe's ``plan:`` mapping as a checked :class:`jaxrl.rl.PlanSection`."""
  try:
    return config_lib.from_dict(PlanSection, dict(cfg.plan))
  except (config_lib.ConfigError, ValueError, TypeError) as e:
    raise ValueError(f"plan: {e}") from None


def load_pref_recipe(path: str, overrides=(), *, target: str | None = None) -> pref.DPOConfig:
  """The preference recipe at ``path``; with ``target``, its ``plan.overrides[target]`` applied first."""
  cfg = config_lib.load(pref.DPOConfig, path, list(overrides))
  section = plan_section(cfg)
  if target is not None and section.overrides.get(target):
    cfg = config_lib.load(pref.DPOConfig, path, [*section.for_target(target), *overrides])
  return cfg


def _model_config(cfg: pref.DPOConfig, attention: str, layers: int | None) -> models.ModelConfig:
  src, preset = cfg.model, plan_section(cfg).preset
  if src.preset is None and preset is not None and not (Path(src.hf_dir or "") / "config.json").is_file():
    src = dataclasses.replace(src, preset=preset, hf_dir=None)
  try:
    mc = src.config()
  except FileNotFoundError as e:
    raise ValueError(f"{e}; set plan.preset to plan without the checkpoint") from e
  return dataclasses.replace(mc, attention_impl=attention, **({} if layers is None else {"num_layers": layers}))


def pref_programs(cfg: pref.DPOConfig, devices, mc: models.ModelConfig, names: tuple[str, ...]) -> list[Program]:
  """The abstract train state, batch and reference copy of ``cfg`` on ``devices``, and its programs."""
  if cfg.lora is not None:
    raise ValueError("plan: LoRA preference recipes are not planned yet; remove `lora:`")
  mesh = sharding.make_mesh(cfg.mesh.shape, devices=devices)
  rules = cfg.mesh.logical_rules()
  model = models.abstract_model(mc, mesh=mesh, rules=rules)
  if cfg.loss.reward_model:  # the trunk and the scalar head (and, with the log-prob feature, the unembedding)
    model = pref.reward_value_model(model, logprob_feature=cfg.loss.logprob_feature, chunk_size=cfg.loss.chunk_size)
  graphdef, state = nnx.split(model)
  params = abstract(state, models.state_shardings(state, mesh, rules))
  optimizer = train.make_optimizer(cfg.optim, cfg.steps)
  train_state = abstract_train_state(params, optimizer, mesh)
  batch = _pair_batch(cfg, mesh, rules)
  reference = {"model": "copy", "precompute": "batch", "none": "none"}[cfg.reference]
  ref_copy = _reference_copy(params, mc.dtype) if reference != "none" else None
  ref_inputs = (ref_copy,) if reference == "copy" else ()
  tokens = cfg.packing.global_rows * cfg.packing.seq_len
  fwd = mc.flops_per_token(cfg.packing.seq_len, training=False) * tokens
  layout = (f"{cfg.pairs} pairs in {cfg.micro_batches} micro-batches x {cfg.packing.global_rows // cfg.micro_batches} "
            f"rows x {cfg.packing.seq_len} tokens")
  out = []
  if "train" in names:
    loss_fn = (pref.rm_loss_fn(graphdef, cfg.loss) if cfg.loss.reward_model
               else pref.pref_loss_fn(graphdef, cfg.loss, reference))
    step = train.make_train_step(loss_fn, optimizer,
                                 micro_batches=cfg.micro_batches, mesh=mesh, rules=rules,
                                 schedule=train.make_schedule(cfg.optim, cfg.steps), prepare=pref.pref_prepare,
                                 compute_view=lambda p: models.compute_view(p, mc.dtype))
    flops = mc.flops_per_token(cfg.packing.seq_len, training=True) * tokens + (fwd if reference == "copy" else 0)
    if cfg.loss.reward_model and not cfg.loss.logprob_feature:  # no output projection: the scalar head instead
      flops -= 6.0 * mc.vocab_size * mc.hidden_size * tokens
    out.append(Program(name="train_step", fn=step, args=(train_state, batch, *ref_inputs), kwargs={},
                       parts={"params": (train_state.params, ref_inputs), "opt_state": train_state.opt_state,
                              "batch": (batch, train_state.step, train_state.skipped)}, flops=flops,
                       note=layout + {"copy": "; the reference's forward inside (a frozen compute-dtype copy)",
                                      "batch": "; reference log-probs precomputed (batch inputs)",
                                      "none": "; no reference"}[reference] + _reward_model_note(cfg.loss)))
  if "reference" in names and ref_copy is not None:
    fn = jax.jit(pref.reference_logps(graphdef, cfg.loss.chunk_size, lora=False))
    out.append(Program(name="reference_logps", fn=fn, args=(ref_copy, batch), kwargs={},
                       parts={"params": ref_copy, "batch": batch}, flops=fwd,
                       note=f"one global batch ({layout}) through the frozen compute-dtype copy"))
  return out


def _reward_model_note(loss: pref.PrefLoss) -> str:
  """What a reward-model recipe's train step holds besides a policy's ("" for a policy)."""
  if not loss.reward_model:
    return ""
  return "; a reward model (trunk + scalar head" + (" + the log-prob feature's unembedding)"
                                                    if loss.logprob_feature else ")")


def _reference_copy(params, dtype):
  """The frozen reference ``DPOTrainer`` keeps: a compute-dtype copy of the parameters, same shardings."""
  shape = jax.eval_shape(lambda p: models.cast_params(p, dtype, copy=True), params)
  return abstract(shape, jax.tree.map(lambda p: p.sharding, params))


def _pair_batch(cfg: pref.DPOConfig, mesh, rules) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract global batch ``DPOTrainer`` feeds: the ``[global_rows, seq_len]`` rows over the batch axes,
  the ``[pairs]`` per-pair arrays likewise (keys and dtypes from :func:`jaxrl.pref.pair_batch` itself)."""
  host = pref.pair_batch([None] * cfg.pairs, micro_batches=cfg.micro_batches, rows=cfg.packing.global_rows,
                         seq_len=cfg.packing.seq_len, method=cfg.packing.method)
  if cfg.reference == "precompute":
    host["ref_chosen"] = host["ref_rejected"] = host["pair_valid"]
  rows, pairs = sharding.batch_sharding(mesh, rules), sharding.logical_sharding(("batch",), mesh, rules)
  return {k: jax.ShapeDtypeStruct(v.shape, jnp.dtype(v.dtype), sharding=rows if v.ndim == 2 else pairs)
          for k, v in host.items()}


@for_target_platform
def plan_pref(cfg: pref.DPOConfig, target_name: str, *, attention: str | None = None, layers: int | None = None,
              programs: tuple[str, ...] | None = None, recipe: str = "", progress: Progress | None = None,
              compile: bool = True) -> Plan:
  """Compiles the preference recipe's programs (module docstring) for ``target_name``: :func:`plan_recipe`
  for a ``jaxrl dpo`` recipe."""
  progress = progress or Progress(enabled=False)
  names = PREF_PROGRAMS if programs is None else tuple(programs)
  unknown = set(names) - set(PREF_PROGRAMS)
  if unknown:
    raise ValueError(f"--programs: unknown {sorted(unknown)} for a preference recipe; known: {list(PREF_PROGRAMS)}")
  target = get_target(target_name)
  with progress.running(f"{target.name}: creating its compile-only {target.platform} devices"):
    devices = target.compile_devices()
  attention = attention or platform_attention(target)
  full = _model_config(cfg, attention, None)

  def programs_at(n_layers: int | None) -> list[Program]:
    mc = full if n_layers is None else dataclasses.replace(full, num_layers=n_layers)
    with progress.running(f"building the abstract model, train state and programs at {mc.num_layers} layers"):
      return pref_programs(cfg, devices, mc, names)

  rows, compiled = measure_programs(programs_at(None), programs_at, full.num_layers, layers, target,
                                    devices=len(devices), progress=progress, compile=compile)
  return Plan(recipe=recipe, target=target.name, mesh=dict(build_mesh_shape(cfg, devices)), attention=attention,
              layers=full.num_layers, compiled_layers=compiled, rows=rows, platform=target.platform, engine=[],
              variant=dict(plan_section(cfg).overrides.get(target.name, {})))
