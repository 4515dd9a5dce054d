"""What the packed-batch trainers (``jaxrl sft``, ``jaxrl dpo``) share: the config fields, the set-up and the
step loop.

* :class:`TrainerConfig`: the config sections every such trainer has (model, optimizer, steps, checkpoints,
  guards, mesh, LoRA, output); a trainer's config subclasses it and adds its data, packing, loss and eval.
* :class:`PackedTrainer`: the set-up every such trainer runs (run directory, mesh, tokenizer, model, the
  trainable split under LoRA, optimizer and state, checkpointer) and :meth:`PackedTrainer.current_model`.
* :func:`run_steps`: the step loop (barrier, step, non-finite flags read one step late, the progress cadence,
  the checkpoint and the pre-emption poll); the trainer supplies the step, the progress row and the save.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, sharding
from jaxrl.models import ModelSource
from jaxrl.train._checkpoint import CheckpointConfig, Checkpointer
from jaxrl.train._guards import GuardConfig, SkipGuard
from jaxrl.train._logging import MetricsLogger
from jaxrl.train._loop import export_hf, process_logger, stop_preempted
from jaxrl.train._optim import OptimConfig, make_optimizer, make_schedule
from jaxrl.train._preempt import PreemptionGuard
from jaxrl.train._step import NONFINITE_KEY, init_train_state, place_on_mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """The sections every packed-batch trainer's config has; subclasses add data, packing, loss and eval."""

  model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(preset="tiny"))
  tokenizer: str | None = None
  "Tokenizer dir; default the model's hf_dir, else the built-in tiny tokenizer."
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  micro_batches: int = 1
  "Gradient-accumulation micro-batches per global batch."
  steps: int = 100
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  guards: GuardConfig = dataclasses.field(default_factory=GuardConfig)
  "Non-finite updates: skipped and counted; abort after guards.max_consecutive_skips in a row."
  mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
  lora: models.LoraConfig | None = None
  "Train LoRA adapters only (base frozen, no optimizer state for it); lr = optim.lr × lora.lr_multiplier."
  out_dir: str = "runs/train"
  export_hf: bool = True
  "Write an HF directory (out_dir/hf; with LoRA also the PEFT adapter, out_dir/adapter) at the end."
  log_every: int = 1
  tensorboard: bool = True

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalCadence:
  """The ``eval:`` section's cadence, shared by the trainers' eval sections."""

  every: int = 50
  "Steps between evaluations (and at the end); 0 disables."
  benchmarks: tuple[config_lib.Benchmark, ...] = ()
  "Benchmarks ``jaxrl eval --config`` runs (:class:`jaxrl.config.Benchmark`; docs/eval.md); training ignores them."


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLoss:
  """The ``loss:`` section's log-prob chunking, shared by the trainers' loss sections."""

  chunk_size: int = 256
  "Tokens per chunk of the chunked log-prob computation."


class PackedTrainer:
  """The set-up shared by the packed-batch trainers; a subclass's ``__init__`` calls the steps in order."""

  cfg: TrainerConfig

  def _setup_run(self, cfg: TrainerConfig) -> None:
    """``out_dir`` (created, ``config.json`` from process 0), the process index, the mesh and its rules."""
    self.cfg = cfg
    self.out_dir = Path(cfg.out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.pid = jax.process_index()
    if self.pid == 0:
      (self.out_dir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    self.mesh = cfg.mesh.build()
    self.rules = cfg.mesh.logical_rules()

  def _check_divisible(self, **sizes: int) -> None:
    """Each of ``sizes`` (a config key → its value) is a multiple of data-parallel devices × micro-batches."""
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    for what, n in sizes.items():
      if n % (dp * self.cfg.micro_batches):
        raise ValueError(f"{what}={n} must be a multiple of data-parallel devices ({dp}) × micro_batches "
                         f"({self.cfg.micro_batches})")

  def _build_model(self) -> None:
    """The tokenizer (``data.tokenizer_dir``) and the model on the mesh, checked against each other."""
    cfg = self.cfg
    self.tokenizer = models.load_tokenizer(data_lib.tokenizer_dir(cfg.tokenizer, cfg.model.hf_dir,
                                                                  vision=cfg.model.config().vision is not None))
    self.model = cfg.model.build(mesh=self.mesh, rules=self.rules)
    models.check_tokenizer(self.tokenizer, self.model.cfg)

  def _trainable(self):
    """``(params, optim_cfg, lr_scale)`` of the model; sets ``graphdef`` and ``frozen`` (the LoRA base, an
    input of every forward; ``()`` without LoRA)."""
    cfg = self.cfg
    self.frozen = ()
    if cfg.lora is None:
      self.graphdef, params = nnx.split(self.model)
      return params, cfg.optim, None
    models.apply_lora(self.model, cfg.lora, seed=cfg.model.seed, rules=self.rules)
    self.graphdef, params, base = models.split_lora(self.model)
    self.frozen = (base,)
    optim_cfg = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * cfg.lora.lr_multiplier)
    return params, optim_cfg, models.lr_scale_tree(params, cfg.lora.b_lr_ratio)

  def _init_state(self, params, optim_cfg: OptimConfig, lr_scale, *, name: str) -> None:
    """The optimizer, its schedule and the train state on the mesh (after a barrier ``{name}-init``)."""
    self.optimizer = make_optimizer(optim_cfg, self.cfg.steps, lr_scale=lr_scale)
    self.schedule = make_schedule(optim_cfg, self.cfg.steps)
    sharding.barrier(f"{name}-init")  # processes start their first collectives together
    self.state = place_on_mesh(init_train_state(params, self.optimizer), self.mesh)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)

  def _make_checkpointer(self) -> None:
    """``out_dir/checkpoints`` when ``checkpoint.every`` is set, else None."""
    ck = self.cfg.checkpoint
    self.checkpointer = None
    if ck.every:
      self.checkpointer = Checkpointer(self.out_dir / "checkpoints", every=ck.every, keep=ck.keep,
                                       keep_every=ck.keep_every, async_save=ck.async_save)

  def _begin_run(self, guard: SkipGuard, *, start_step: int, until: int | None, name: str,
                 show: tuple[str, ...]) -> tuple[MetricsLogger, dict[str, Any], int]:
    """``(logger, results, last step)`` of a run starting after ``start_step``: the process's logger (the
    guard notes to it), the evaluation before the first step (a fresh run with evaluation on), the results'
    ``start_step`` and ``eval_before``."""
    cfg = self.cfg
    logger = process_logger(self.out_dir, self.pid, total_steps=cfg.steps, desc=name, show=show,
                            tensorboard=cfg.tensorboard)
    guard.log = logger.note
    first_eval = self.evaluate() if start_step == 0 and cfg.eval.every else {}
    if first_eval:
      logger.log(0, first_eval)
    results: dict[str, Any] = {"start_step": start_step, "eval_before": first_eval}
    return logger, results, cfg.steps if until is None else min(until, cfg.steps)

  def evaluate(self) -> dict[str, float]:
    """The held-out metrics (a subclass's)."""
    raise NotImplementedError

  def _export(self, results: dict[str, Any]) -> None:
    """The HF directory (and the PEFT adapter under LoRA) of the trained model, under ``export_hf``."""
    if self.cfg.export_hf:
      export_hf(results, out_dir=self.out_dir, model=self.current_model(for_sampling=True),
                adapter=self.current_model() if self.cfg.lora is not None else None, tokenizer=self.tokenizer)

  def current_model(self, *, for_sampling: bool = False):
    """The model with the current parameters; with LoRA and ``for_sampling``, adapters merged in."""
    model = nnx.merge(self.graphdef, self.state.params, *self.frozen)
    if for_sampling and self.cfg.lora is not None:
      return models.merged_base(model)
    return model


def run_steps(*, start_step: int, last: int, total_steps: int, log_every: int, name: str,
              step: Callable[[int], dict[str, Any]], report: Callable[[int, dict[str, Any] | None, float], None],
              save: Callable[[int], None], checkpointer: Checkpointer | None, guard: SkipGuard,
              logger: MetricsLogger) -> None:
  """Steps ``start_step + 1 .. last`` of a run of ``total_steps``.

  Per step: a barrier ``{name}-step``; ``step(s)`` (the update, returning its device metrics); the previous
  step's non-finite flags read into ``guard`` (the step is done by then: no stall); ``report(s, host metrics
  or None, seconds per step)`` (metrics on the host every ``log_every`` steps and at ``total_steps``, else
  None); ``save(s)`` when the checkpointer is due, at ``last`` or on a pre-emption signal (flags read first),
  then :func:`stop_preempted` on a signal.
  """
  t_last = time.perf_counter()
  pending = None  # (step, skipped, non-finite micro-batches, loss) of the last step, read one step late
  with PreemptionGuard() as preempt:
    for s in range(start_step + 1, last + 1):
      sharding.barrier(f"{name}-step")
      metrics = step(s)
      if pending is not None:
        guard.observe(*sharding.to_host(pending))
      pending = (s, metrics["skipped"], metrics[NONFINITE_KEY], metrics["loss"])
      host, dt = None, 0.0
      if s % log_every == 0 or s == total_steps:
        host = sharding.to_host(metrics)
        now = time.perf_counter()
        dt = (now - t_last) / (log_every if s % log_every == 0 else 1)
        t_last = now
      report(s, host, dt)
      signum = preempt.requested()
      if checkpointer is not None and (checkpointer.due(s) or s == last or signum):
        guard.observe(*sharding.to_host(pending))
        pending = None
        save(s)
      if signum:
        stop_preempted(signum, s, checkpointer=checkpointer, logger=logger, title=name)
    if pending is not None:
      guard.observe(*sharding.to_host(pending))
