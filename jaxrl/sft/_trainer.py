"""Supervised fine-tuning on packed sequences: config, loop, evaluation, checkpoints, export.

On several processes (``jax.distributed``, docs/multihost.md) every process reads the same global
stream of packed batches and feeds its own contiguous block of rows (``jaxrl.sharding.process_slice``):
the global batch, the iterator state in checkpoints and so the result do not depend on the process count.
Checkpoints hold every process's iterator state and data-file fingerprint (each restores its own); at each
checkpoint they must equal process 0's, so processes that read different data stop with an error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models, rewards, sharding, train
from jaxrl import sampling
from jaxrl.sft import _vl

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5": 459.0, "TPU v6 lite": 918.0}
"""Dense bf16 peak TFLOP/s per device kind, for the MFU estimate (none for CPU)."""


BuiltinData = data_lib.BuiltinTask
"""``data.builtin``: the built-in arithmetic task (written to ``out_dir/data`` as JSONL, then read like any file)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTData(data_lib.TaskData):
  """Where SFT records come from: JSONL/Parquet ``train`` files; ``heldout`` for eval loss and exact match."""

  max_bad_records: int = 0
  "Malformed records to skip (counted, reported) before failing."
  shuffle_seed: int = 0
  image_task: data_lib.BuiltinImageTask | None = None
  "Vision-language models: the built-in image task, used when `train` is empty (default settings if unset)."
  caption_task: data_lib.BuiltinCaptionTask | None = None
  ("Vision-language models: the built-in caption task (image + \"Describe the image.\" -> the scene's reference "
   "caption), used when `train` is empty: the captioning warm start of the tiny CapRL / RubiCap recipes.")
  caption_answer_task: rewards.CaptionAnswerTask | None = None
  ("Text models: CapRL's answerer prompt over the caption task's scenes -> an exact caption reader's reply (the "
   "asked-about words, the answer, the letter), used when `train` is empty: the answerer of the tiny CapRL recipe "
   "(configs/sft_caprl_answerer_tiny.yaml).")
  images: data_lib.ImageConfig = dataclasses.field(default_factory=data_lib.ImageConfig)
  "Vision-language models: how images become patches (min/max pixels; geometry must match the tower)."
  num_patches: int | None = None
  "Vision-language models: patches per row (a fixed bucket); None: the smallest min_patches·2^k holding each batch."
  min_patches: int = 64
  "Vision-language models: smallest per-row patch bucket when num_patches is None."
  zero_pixels: bool = False
  "Vision-language models: zero every image's pixel values in training and evaluation (the image-ablated control)."

  def __post_init__(self):
    if self.max_bad_records < 0:
      raise ValueError(f"data.max_bad_records must be >= 0, got {self.max_bad_records!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTLoss(train.ChunkedLoss):
  mode: Literal["token_sum", "global_token_mean", "row_mean", "sample_mean", "turn_mean"] = "global_token_mean"
  "Loss weighting (jaxrl.losses.sft_loss_weights); see docs/losses.md."
  divisor: Literal["default", "none", "gbs", "gbs_true"] = "default"
  gbs: float | None = None
  "Constant GBS for the `gbs` divisor; default: rows in the global batch."


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(train.EvalCadence):
  batches: int = 2
  "Held-out batches for the eval loss."
  exact_match: int = 32
  "Held-out prompts decoded greedily for exact match; 0 disables."
  max_new_tokens: int = 32


CheckpointConfig = train.CheckpointConfig
"""Re-exported from :mod:`jaxrl.train` (``from jaxrl.sft import CheckpointConfig`` keeps working)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(train.TrainerConfig):
  """``jaxrl sft``: the shared trainer sections (:class:`jaxrl.train.TrainerConfig`) plus data, packing, loss
  and eval."""

  data: SFTData = dataclasses.field(default_factory=SFTData)
  packing: data_lib.PackingConfig = dataclasses.field(default_factory=data_lib.PackingConfig)
  loss: SFTLoss = dataclasses.field(default_factory=SFTLoss)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  freeze_vision: bool = False
  "Vision-language models: keep the vision tower (patch embedding, blocks, merger) fixed and train the language "
  "model only (no gradient or optimizer state for the tower). Under LoRA the tower's base is frozen anyway (its "
  "adapters, with lora.vision_targets, train)."
  out_dir: str = "runs/sft"
  export_hf: bool = True
  "Write an HF directory (out_dir/hf) at the end."

  def __post_init__(self):
    super().__post_init__()
    if self.micro_batches < 1 or self.packing.global_rows % self.micro_batches:
      raise ValueError(f"micro_batches={self.micro_batches} must divide packing.global_rows="
                       f"{self.packing.global_rows}")
    if not self.data.train and self.data.builtin is None:
      raise ValueError("data: give data.train files or data.builtin")
    if self.data.image_task is not None and self.data.caption_task is not None:
      raise ValueError("data: give data.image_task or data.caption_task, not both")
    if self.freeze_vision and self.lora is not None and self.lora.vision_targets:
      raise ValueError(f"freeze_vision: true contradicts lora.vision_targets={list(self.lora.vision_targets)} (the "
                       "tower's adapters would train); drop one (under LoRA the tower's base weights are frozen anyway)")


def _resolve_data(cfg: SFTConfig, out_dir: Path, *, vision: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
  for key in ("image_task", "caption_task"):
    if getattr(cfg.data, key) is not None and not vision:
      raise ValueError(f"data.{key}: model {cfg.model.preset or cfg.model.hf_dir!r} has no vision tower")
  if cfg.data.caption_answer_task is not None and vision:
    raise ValueError("data.caption_answer_task: trains a text answerer; the model has a vision tower")
  if cfg.data.train:
    return cfg.data.train, cfg.data.heldout
  if vision:
    return _vl.write_image_task(cfg.data.caption_task or cfg.data.image_task or data_lib.BuiltinImageTask(), out_dir)
  b = cfg.data.builtin
  if jax.process_index():  # every process writes its own (identical) copy: no two writers share a file
    out_dir = out_dir / "processes" / str(jax.process_index())
  if cfg.data.caption_answer_task is not None:
    paths = cfg.data.caption_answer_task.write_splits(out_dir / "data")
    return (str(paths["train"]),), (str(paths["heldout"]),)
  paths = data_lib.write_arithmetic_splits(out_dir / "data", n_train=b.n_train, n_heldout=b.n_heldout,
                                           seed=b.seed, config=b.task)
  return (str(paths["train"]),), (str(paths["heldout"]),)


def sft_loss_fn(graphdef, loss_cfg: SFTLoss):
  """``loss(params, batch) -> (Σ w·nll, metrics)`` for batches that already carry ``weights``; a VL batch's
  ``rope_positions`` and per-row images (:meth:`jaxrl.models.VisionInputs.from_batch`) feed the forward."""
  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    hidden = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                   rope_positions=batch.get("rope_positions"), images=models.VisionInputs.from_batch(batch),
                   return_hidden=True)  # [B, T, D]
    logprobs = losses.token_logprobs(hidden, model.unembed_matrix(), batch["targets"],
                                     chunk_size=loss_cfg.chunk_size)  # [B, T]
    nll = -logprobs
    mask = batch["loss_mask"]
    return jnp.sum(batch["weights"] * nll), {"nll_sum": jnp.sum(mask * nll), "loss_tokens": jnp.sum(mask)}
  return loss_fn


def sft_prepare(loss_cfg: SFTLoss):
  """Folds the global normaliser of the configured mode into per-token ``weights``."""
  def prepare(batch):
    w = losses.sft_loss_weights(loss_cfg.mode, batch["loss_mask"], batch["sample_ids"], batch["turn_ids"],
                                divisor=loss_cfg.divisor, gbs=loss_cfg.gbs)
    return dict(batch, weights=w)
  return prepare


class SFTTrainer(train.PackedTrainer):
  """Builds everything once; :meth:`run` trains, evaluates, checkpoints and exports."""

  def __init__(self, cfg: SFTConfig):
    self._setup_run(cfg)
    self._check_divisible(**{"packing.global_rows": cfg.packing.global_rows})
    self._rows = sharding.process_slice(cfg.packing.global_rows)  # this process's rows of each batch
    self._build_model()
    self.vision = self.model.cfg.vision is not None
    if self.vision:
      _vl.check_image_config(cfg.data.images, self.model.cfg.vision)
    self.train_paths, self.heldout_paths = _resolve_data(cfg, self.out_dir, vision=self.vision)
    params, optim_cfg, lr_scale = self._trainable()
    loss_fn = sft_loss_fn(self.graphdef, cfg.loss)
    eval_loss = sft_loss_fn(self.graphdef, SFTLoss(chunk_size=cfg.loss.chunk_size))
    if self.frozen:  # the LoRA base or the frozen tower: an extra input that lora_loss merges back in
      loss_fn, eval_loss = models.lora_loss(loss_fn), models.lora_loss(eval_loss)
    self._init_state(params, optim_cfg, lr_scale, name="sft")
    self.step_fn = train.make_train_step(
        loss_fn, self.optimizer, micro_batches=cfg.micro_batches,
        mesh=self.mesh, rules=self.rules, schedule=self.schedule, prepare=sft_prepare(cfg.loss),
        compute_view=lambda p, dtype=self.model.cfg.dtype: models.compute_view(p, dtype))
    eval_prepare = sft_prepare(SFTLoss(mode="global_token_mean"))
    self._eval_fn = jax.jit(lambda p, b, *frozen: eval_loss(p, eval_prepare(b), *frozen))
    self._last_batch = None  # the last batch trained (its image skip counters, for the skip report)
    self._make_checkpointer()

  def _trainable(self):
    """:meth:`jaxrl.train.PackedTrainer._trainable`, or with ``freeze_vision`` the tower split off as a frozen
    input (as the base is under LoRA: no gradient, no optimizer state)."""
    if not self.cfg.freeze_vision or self.cfg.lora is not None:
      return super()._trainable()
    if not self.vision:
      raise ValueError("freeze_vision: the model has no vision tower")
    self.graphdef, tower, params = nnx.split(self.model, nnx.PathContains("visual"), ...)
    self.frozen = (tower,)
    return params, self.cfg.optim, None

  def _batches(self, paths, *, epochs):
    if self.vision:
      d = self.cfg.data
      ds = _vl.vl_batch_iter(paths, tokenizer=self.tokenizer, model_cfg=self.model.cfg, images=d.images,
                             packing=self.cfg.packing, num_patches=d.num_patches, min_patches=d.min_patches,
                             seed=d.shuffle_seed, epochs=epochs, max_bad_records=d.max_bad_records,
                             zero_pixels=d.zero_pixels)
      self._last_source = ds.source
      return iter(ds)
    dcfg = data_lib.DataConfig(paths=tuple(paths), seed=self.cfg.data.shuffle_seed, num_epochs=epochs,
                               max_bad_records=self.cfg.data.max_bad_records, shuffle=epochs != 1)
    # The global stream on every process (not sharded by process): see the module docstring.
    ds = data_lib.sft_batches(dcfg, self.cfg.packing, self.tokenizer, process_index=0, process_count=1)
    self._last_source = ds.source  # bad records and file fingerprints (skip report, resume check)
    return iter(ds)

  def _device_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A global batch's arrays → global device arrays, each process feeding its own rows (a VL batch's
    per-image ``grid_thw``/``image_rows`` stay on the host)."""
    return {k: sharding.global_batch(v[self._rows], self.batch_sharding)
            for k, v in _vl.device_arrays(arrays).items()}

  def evaluate(self) -> dict[str, float]:
    out = {}
    if not self.heldout_paths:
      return out
    params = self.state.params
    if self.cfg.eval.batches:
      it = self._batches(self.heldout_paths, epochs=1)
      nll = toks = 0.0
      for _ in range(self.cfg.eval.batches):
        try:
          batch = next(it)
        except StopIteration:
          break
        _, m = sharding.to_host(self._eval_fn(params, self._device_batch(batch.arrays), *self.frozen))
        nll += float(m["nll_sum"])
        toks += float(m["loss_tokens"])
      if toks:
        out["eval_loss"] = nll / toks
    if self.cfg.eval.exact_match and self.vision:
      out["eval_exact_match"] = _vl.image_heldout_accuracy(
          self.current_model(for_sampling=True), self.tokenizer, self.heldout_paths, n=self.cfg.eval.exact_match,
          max_new_tokens=self.cfg.eval.max_new_tokens, images=self.cfg.data.images, mesh=self.mesh,
          zero_pixels=self.cfg.data.zero_pixels)
    elif self.cfg.eval.exact_match:
      out["eval_exact_match"] = heldout_exact_match(
          self.current_model(for_sampling=True), self.tokenizer, self.heldout_paths,
          n=self.cfg.eval.exact_match, max_new_tokens=self.cfg.eval.max_new_tokens, mesh=self.mesh)
    return out

  def run(self, *, until: int | None = None) -> dict[str, Any]:
    """Trains to ``cfg.steps`` (or stops after step ``until``, as a pre-emption would)."""
    cfg = self.cfg
    it = self._batches(self.train_paths, epochs=None)
    source = self._last_source
    guard = train.SkipGuard(cfg.guards, log=print)
    start_step = self._resume(it, source, guard)
    logger, results, last = self._begin_run(guard, start_step=start_step, until=until, name="sft",
                                            show=("loss", "tok/s", "eval_loss", "eval_exact_match"))
    try:
      losses_seen, stats = self._train_steps(it, source, guard, logger, results, start_step, last)
    finally:
      if self.checkpointer is not None:
        self.checkpointer.close()  # an in-flight save commits even when the loop raised
    train.eval_if_resumed_at_end(results, start_step=start_step, last=last, total_steps=cfg.steps,
                                 eval_every=cfg.eval.every, evaluate=self.evaluate)
    plot = logger.close(title="sft")
    skips = sft_skip_report(source, stats, cfg.packing)
    _vl.vl_skips(skips, self._last_batch, source, cfg.packing.seq_len)
    skips.print(logger.console)
    results["skips"] = skips.as_dict()
    if last < cfg.steps:
      train.write_results(results, self.out_dir, pid=self.pid)
      return dict(results, losses=losses_seen, stopped_at=last)
    results.update(steps=cfg.steps, losses=losses_seen, plot=str(plot) if plot else None,
                   skipped=int(self.state.skipped), packing=dataclasses.asdict(stats) if stats is not None else None)
    self._export(results)
    train.write_results(results, self.out_dir, pid=self.pid)
    return results

  def _resume(self, it, source, guard: train.SkipGuard) -> int:
    """The step to start from: the latest checkpoint's under ``checkpoint.resume: auto`` (the state, the data
    iterator and the guards restored, the data files' fingerprint checked), else 0."""
    if not train.resumable(self.checkpointer, self.cfg.checkpoint.resume):
      return 0
    start_step, self.state, host = self.checkpointer.restore(self.state)
    # Each process's own entries (another process count: the entries agree, see _check_same_data).
    data_lib.check_fingerprint(train.own_process_state(host.get("data_files"), step=start_step,
                                                       what="the data files' fingerprint",
                                                       key=lambda files: list(files.values())),
                               source.fingerprint())
    it.set_state(train.own_process_state(host["data"], step=start_step, what="the data-iterator state"))
    guard.set_state(host.get("guards"))
    return start_step

  def _train_steps(self, it, source, guard: train.SkipGuard, logger: train.MetricsLogger, results: dict[str, Any],
                   start_step: int, last: int) -> tuple[list[float], Any]:
    """Steps ``start_step + 1 .. last`` through :func:`jaxrl.train.run_steps`: the update, the progress line
    every ``log_every`` steps, the evaluation cadence, the checkpoint, and the pre-emption poll (checkpoint,
    then :class:`jaxrl.train.Preempted`). Returns the losses logged and the packing statistics of the last
    batch (None when no step ran)."""
    cfg = self.cfg
    flops_per_token = self.model.cfg.flops_per_token(cfg.packing.seq_len) if hasattr(
        self.model.cfg, "flops_per_token") else None
    peak = _peak_tflops()
    losses_seen = []
    last_batch = [None]  # the batch of the last step trained in this process (none when resumed at the end)

    def step(s: int):
      last_batch[0] = self._last_batch = batch = next(it)
      self.state, metrics = self.step_fn(self.state, self._device_batch(batch.arrays), *self.frozen)
      return metrics

    def report(s: int, metrics, dt: float) -> None:
      stats = last_batch[0].stats
      if metrics is not None:
        real = stats.tokens
        row = {"loss": float(metrics["nll_sum"]) / max(float(metrics["loss_tokens"]), 1.0),
               "objective": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
               "lr": float(metrics["lr"]), "tok/s": real / dt, "padding": 1.0 - stats.efficiency,
               "skipped": float(self.state.skipped)}
        if flops_per_token and peak:
          row["mfu"] = flops_per_token * real / dt / (peak * 1e12 * jax.device_count())
        losses_seen.append(row["loss"])
        logger.log(s, row)
      if cfg.eval.every and (s % cfg.eval.every == 0 or s == cfg.steps):
        ev = self.evaluate()
        if ev:
          logger.log(s, ev)
          results["eval_after"] = ev

    train.run_steps(start_step=start_step, last=last, total_steps=cfg.steps, log_every=cfg.log_every, name="sft",
                    step=step, report=report, save=lambda s: self._save(s, it, source, guard),
                    checkpointer=self.checkpointer, guard=guard, logger=logger)
    return losses_seen, last_batch[0].stats if last_batch[0] is not None else None

  def _save(self, step: int, it, source, guard: train.SkipGuard) -> None:
    """Checkpoints ``step``: the state, every process's data-iterator state and data files' fingerprint (checked
    to agree), and the guards."""
    procs = train.gather_process_states({"data": it.get_state(), "files": source.fingerprint()})
    _check_same_data(procs, step)
    self.checkpointer.save(step, self.state, {"data": [p["data"] for p in procs], "step": step,
                                              "guards": guard.state(),
                                              "data_files": [p["files"] for p in procs]}, force=True)

def _check_same_data(procs: list[dict[str, Any]], step: int) -> None:
  """Every process reads the same global stream (module docstring), so at a checkpoint every process's
  data-iterator state and the contents of its data files (matched in order) must equal process 0's;
  otherwise the processes fed their rows from different batches. ``procs``: the gathered
  ``{"data": iterator state, "files": fingerprint}`` of each process."""
  want = procs[0]
  for k, got in enumerate(procs[1:], 1):
    if len(got["files"]) != len(want["files"]):
      raise data_lib.DataError(f"step {step}: process {k} reads {len(got['files'])} data file(s) "
                               f"({list(got['files'])}), process 0 reads {len(want['files'])} "
                               f"({list(want['files'])}); every process must read the same data",
                               reason="processes differ")
    for (path0, fp0), (path, fp) in zip(want["files"].items(), got["files"].items()):
      if list(fp) != list(fp0):
        raise data_lib.DataError(f"{path}: process {k}'s copy differs from process 0's {path0} ({fp[0]} bytes, "
                                 f"CRC-32 {fp[1]:08x}; process 0: {fp0[0]} bytes, CRC-32 {fp0[1]:08x}); every "
                                 "process must read identical data files", reason="processes differ")
    if got["data"] != want["data"]:
      raise data_lib.DataError(f"step {step}: process {k}'s data-iterator state differs from process 0's "
                               "(its data position or packing counters); every process must read the same "
                               "data stream", reason="processes differ")


def sft_skip_report(source, stats, packing: data_lib.PackingConfig) -> data_lib.SkipReport:
  """Bad records the source skipped (``data.max_bad_records``) and the samples packing truncated or
  dropped (cumulative over the samples read, repeats of an epoch included)."""
  report = data_lib.SkipReport()
  report.add_bad_records(source.bad_reasons)
  if stats is not None:
    report.add(f"over-long sample truncated to packing.seq_len={packing.seq_len}", count=stats.truncated,
               examples=map(source.where, stats.truncated_examples))
    report.add("over-long sample dropped (packing.overlong=drop) or no trained token left"
               if packing.overlong == "drop" else "sample with no trained token left after truncation",
               count=stats.dropped, examples=map(source.where, stats.dropped_examples))
  return report


def heldout_exact_match(model, tokenizer, paths, *, n: int, max_new_tokens: int, mesh=None) -> float:
  """Fraction of the first ``n`` held-out records whose greedy completion has the right answer."""
  records = []
  for p in paths:
    with open(p, encoding="utf-8") as f:
      records += [json.loads(line) for line in f if line.strip()]
  records = records[:n]
  if not records:
    return float("nan")
  real = len(records)
  procs = jax.process_count() if mesh is not None else 1
  if procs > 1:  # an equal share per process (the last record repeats to fill the last share)
    per = -(-real // procs)
    records = (records + records[-1:] * (per * procs - real))[jax.process_index() * per:(jax.process_index() + 1) * per]
  prompts = [data_lib.encode_prompt(tokenizer, r).tolist() for r in records]
  longest = max(map(len, prompts)) if procs == 1 else int(sharding.allgather_scalar(max(map(len, prompts))).max())
  sampler = sampling.Sampler(model, tokenizer, mesh=mesh, max_len=longest + max_new_tokens)
  out = sampler.generate(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
  hits = np.asarray([data_lib.exact_match(text, r["answer"]) for text, r in zip(out.texts, records)], np.float64)
  if procs > 1:
    hits = sharding.allgather_rows({"h": hits})[0]["h"][:real]
  return float(np.mean(hits))


def _peak_tflops() -> float | None:
  kind = jax.devices()[0].device_kind
  for name, tf in PEAK_TFLOPS.items():
    if name in kind:
      return tf
  return None

