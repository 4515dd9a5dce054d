"""Preference optimisation (DPO and its family) on packed pairs: config, loop, evaluation, checkpoints, export.

Every step draws ``pairs`` preference pairs, packs their ``2·pairs`` sequences into ``packing.global_rows``
rows (:mod:`jaxrl.pref._data`), scores each sequence with the policy (and the reference), and minimises the
mean over pairs of :func:`jaxrl.losses.preference_loss`. The reference log-probs come from (``reference``):

* ``model``: recomputed each step, from a frozen copy of the initial weights, or under LoRA from the same
  weights with the adapters switched off (:func:`jaxrl.models.lora_disabled`: no second copy);
* ``precompute``: that same reference, run once over every train and held-out pair before training and
  cached per pair (the copy is dropped afterwards);
* ``none``: reference-free losses (``simpo``, ``orpo``).

Every process reads every pair and feeds its own rows and pairs of each global batch; the pair stream's state
(pairs drawn so far) is the whole data state of a checkpoint, so a resumed run draws what an uninterrupted
one would.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import losses, models, sharding, train
from jaxrl.models import ModelSource
from jaxrl.pref._data import Pair, PairStream, pair_batch, read_pairs, write_builtin_pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefData(data_lib.TaskData):
  """Where pairs come from: JSONL ``train`` files of ``{"prompt", "chosen", "rejected"}`` records (strings or
  chat-message lists), ``heldout`` for evaluation; without files, pairs derived from the built-in task."""

  shuffle_seed: int = 0
  "Seed of each epoch's pair order."


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefLoss:
  name: str = "sigmoid"
  "A name of jaxrl.losses.PREFERENCE_LOSSES: sigmoid (DPO), robust, ipo, hinge, simpo, orpo."
  beta: float = 0.1
  label_smoothing: float = 0.0
  "Conservative/robust DPO's ε (losses that take it)."
  gamma: float = 0.0
  "SimPO's target margin."
  chunk_size: int = 256
  "Tokens per chunk of the chunked log-prob computation."

  def __post_init__(self):
    if self.name not in losses.PREFERENCE_LOSSES:
      raise ValueError(f"loss.name must be one of {sorted(losses.PREFERENCE_LOSSES)}, got {self.name!r}")

  @property
  def length_normalised(self) -> bool:
    """Whether the loss takes the completions' lengths (SimPO, ORPO)."""
    return "chosen_lengths" in inspect.signature(losses.PREFERENCE_LOSSES[self.name]).parameters


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairPacking:
  """How a batch's ``2·pairs`` sequences become ``[global_rows, seq_len]`` arrays."""

  seq_len: int = 512
  "Tokens per row; a pair with a longer sequence is dropped (counted in the skip report)."
  global_rows: int = 8
  "Rows per global batch; a batch whose sequences do not fit is an error naming the rows it needs."
  method: Literal["best_fit", "first_fit_decreasing", "none"] = "best_fit"
  "Bin packing of the sequences (jaxrl.data.assign_rows); the loss does not depend on it."


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefEval:
  every: int = 50
  "Steps between evaluations (and at the end); 0 disables."
  pairs: int = 0
  "Held-out pairs evaluated (the first ones); 0: all."


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
  model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(preset="tiny"))
  tokenizer: str | None = None
  "Tokenizer dir; default the model's hf_dir, else the built-in tiny tokenizer."
  data: PrefData = dataclasses.field(default_factory=PrefData)
  pairs: int = 8
  "Preference pairs per global batch."
  packing: PairPacking = dataclasses.field(default_factory=PairPacking)
  loss: PrefLoss = dataclasses.field(default_factory=PrefLoss)
  reference: Literal["model", "precompute", "none"] = "model"
  "Reference log-probs: recomputed each step (frozen copy; LoRA: the base), precomputed once, or none."
  optim: train.OptimConfig = dataclasses.field(default_factory=train.OptimConfig)
  micro_batches: int = 1
  "Gradient-accumulation micro-batches per global batch (each packs pairs / micro_batches pairs)."
  steps: int = 100
  eval: PrefEval = dataclasses.field(default_factory=PrefEval)
  checkpoint: train.CheckpointConfig = dataclasses.field(default_factory=train.CheckpointConfig)
  guards: train.GuardConfig = dataclasses.field(default_factory=train.GuardConfig)
  mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
  lora: models.LoraConfig | None = None
  "Train LoRA adapters only; the base with adapters off is then the reference."
  out_dir: str = "runs/dpo"
  export_hf: bool = True
  "Write an HF directory (out_dir/hf; with LoRA also the PEFT adapter, out_dir/adapter) at the end."
  log_every: int = 1
  tensorboard: bool = True

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")
    if self.pairs < 1:
      raise ValueError(f"pairs must be >= 1, got {self.pairs}")
    if self.micro_batches < 1 or self.pairs % self.micro_batches or self.packing.global_rows % self.micro_batches:
      raise ValueError(f"micro_batches={self.micro_batches} must divide pairs={self.pairs} and "
                       f"packing.global_rows={self.packing.global_rows}")
    if not self.data.train and self.data.builtin is None:
      raise ValueError("data: give data.train files or data.builtin")
    needs_ref = self.loss.name not in ("simpo", "orpo")
    if needs_ref and self.reference == "none":
      raise ValueError(f"loss {self.loss.name!r} needs a reference: reference must be 'model' or 'precompute'")


def pair_logps(model, batch: dict[str, jax.Array], chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """Summed log-probs of each pair's chosen and rejected completion, ``[P]`` each (module docstring of
  :mod:`jaxrl.pref._data` for the layout)."""
  hidden = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                 rope_positions=batch.get("rope_positions"), images=models.VisionInputs.from_batch(batch),
                 return_hidden=True)  # [R, T, D]
  token_lp = losses.token_logprobs(hidden, model.unembed_matrix(), batch["targets"], chunk_size=chunk_size)  # [R, T]
  num_pairs = batch["pair_valid"].shape[0]
  seq = losses.sequence_logps(token_lp, batch["seq_ids"], batch["loss_mask"], 2 * num_pairs)  # [2P]
  return seq[0::2], seq[1::2]


def reference_logps(graphdef, chunk_size: int, *, lora: bool):
  """``ref(params, batch, *frozen) -> (chosen [P], rejected [P])``: the reference's log-probs, gradient
  stopped. ``params`` is the frozen copy, or under ``lora`` the adapters with ``frozen = (base,)`` (run with
  the adapters off)."""
  def ref(params, batch, *frozen):
    params = jax.tree.map(lambda x: x, params)  # fresh Variables at this trace level (nnx refuses outer ones)
    if lora:
      model = nnx.merge(graphdef, params, *jax.tree.map(lambda x: x, frozen))
      with models.lora_disabled(model):
        out = pair_logps(model, batch, chunk_size)
    else:
      out = pair_logps(nnx.merge(graphdef, params), batch, chunk_size)
    return jax.tree.map(jax.lax.stop_gradient, out)
  return ref


def pref_loss_fn(graphdef, loss_cfg: PrefLoss, reference: str):
  """``loss(params, batch, *ref) -> (Σ pair_weight·ℓ, metric sums)``; ``reference``: ``copy`` (``ref`` = the
  frozen copy's params), ``lora`` (the adapters switched off), ``batch`` (``ref_chosen``/``ref_rejected`` in
  the batch) or ``none``."""
  copy_ref = reference_logps(graphdef, loss_cfg.chunk_size, lora=False)

  def loss_fn(params, batch, *ref_params):
    model = nnx.merge(graphdef, params)
    chosen, rejected = pair_logps(model, batch, loss_cfg.chunk_size)  # [P] each
    ref = (None, None)
    if reference == "copy":
      ref = copy_ref(ref_params[0], batch)
    elif reference == "lora":
      with models.lora_disabled(model):
        ref = jax.tree.map(jax.lax.stop_gradient, pair_logps(model, batch, loss_cfg.chunk_size))
    elif reference == "batch":
      ref = (batch["ref_chosen"], batch["ref_rejected"])
    lengths = {}
    if loss_cfg.length_normalised:
      lengths = {"chosen_lengths": batch["chosen_lengths"], "rejected_lengths": batch["rejected_lengths"]}
    per_pair, m = losses.preference_loss(loss_cfg.name, chosen, rejected, *ref, beta=loss_cfg.beta,
                                         label_smoothing=loss_cfg.label_smoothing, gamma=loss_cfg.gamma,
                                         **lengths)  # [P]
    valid = batch["pair_valid"]
    metrics = {"pairs": jnp.sum(valid), "loss_sum": jnp.sum(valid * per_pair),
               "accuracy_sum": jnp.sum(valid * m["accuracy"]), "margin_sum": jnp.sum(valid * m["margins"]),
               "chosen_reward_sum": jnp.sum(valid * m["rewards_chosen"]),
               "rejected_reward_sum": jnp.sum(valid * m["rewards_rejected"])}
    return jnp.sum(batch["pair_weight"] * per_pair), metrics
  return loss_fn


def pref_prepare(batch):
  """Folds the global mean over valid pairs into per-pair weights (split-invariant over micro-batches)."""
  valid = batch["pair_valid"]
  return dict(batch, pair_weight=valid / jnp.maximum(jnp.sum(valid), 1.0))


def _summary(m: dict[str, Any], prefix: str = "") -> dict[str, float]:
  n = max(float(m["pairs"]), 1.0)
  return {f"{prefix}loss": float(m["loss_sum"]) / n, f"{prefix}accuracy": float(m["accuracy_sum"]) / n,
          f"{prefix}margin": float(m["margin_sum"]) / n, f"{prefix}chosen_reward": float(m["chosen_reward_sum"]) / n,
          f"{prefix}rejected_reward": float(m["rejected_reward_sum"]) / n}


class DPOTrainer:
  """Builds everything once; :meth:`run` trains, evaluates, checkpoints and exports."""

  def __init__(self, cfg: DPOConfig):
    self.cfg = cfg
    self.out_dir = Path(cfg.out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.pid = jax.process_index()
    if self.pid == 0:
      (self.out_dir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    self.mesh = cfg.mesh.build()
    self.rules = cfg.mesh.logical_rules()
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    for what, n in (("pairs", cfg.pairs), ("packing.global_rows", cfg.packing.global_rows)):
      if n % (dp * cfg.micro_batches):
        raise ValueError(f"{what}={n} must be a multiple of data-parallel devices ({dp}) × micro_batches "
                         f"({cfg.micro_batches})")
    self._rows = sharding.process_slice(cfg.packing.global_rows)  # this process's rows of each batch
    self._pairs = sharding.process_slice(cfg.pairs)  # and its pairs
    self.tokenizer = models.load_tokenizer(data_lib.tokenizer_dir(cfg.tokenizer, cfg.model.hf_dir))
    self.model = cfg.model.build(mesh=self.mesh, rules=self.rules)
    models.check_tokenizer(self.tokenizer, self.model.cfg)
    self.skips = data_lib.SkipReport()
    self.train_pairs, self.heldout_pairs = self._load_pairs()
    self._build_state()
    self.ref_cache = None  # [n, 2] reference log-probs of train pairs; held-out: heldout_ref_cache
    if cfg.reference == "precompute":
      self.ref_cache, self.heldout_ref_cache = self._precompute()
    self.checkpointer = None
    if cfg.checkpoint.every:
      self.checkpointer = train.Checkpointer(self.out_dir / "checkpoints", every=cfg.checkpoint.every,
                                             keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every,
                                             async_save=cfg.checkpoint.async_save)

  def _load_pairs(self) -> tuple[list[Pair], list[Pair]]:
    cfg = self.cfg
    train_paths, heldout_paths = cfg.data.train, cfg.data.heldout
    if not train_paths:
      out = self.out_dir / "data" if not self.pid else self.out_dir / "processes" / str(self.pid) / "data"
      train_path, heldout_path = write_builtin_pairs(out, cfg.data.builtin)
      train_paths, heldout_paths = (str(train_path),), (str(heldout_path),) if heldout_path else ()
    kept = []
    for pairs in (read_pairs(train_paths, self.tokenizer), read_pairs(heldout_paths, self.tokenizer)):
      fits = [p for p in pairs if max(len(p.chosen["tokens"]), len(p.rejected["tokens"])) <= cfg.packing.seq_len]
      long = [p.where for p in pairs if max(len(p.chosen["tokens"]), len(p.rejected["tokens"])) > cfg.packing.seq_len]
      self.skips.add(f"pair longer than packing.seq_len={cfg.packing.seq_len} dropped", count=len(long),
                     examples=long)
      kept.append(fits)
    if not kept[0]:
      raise data_lib.DataError(f"no usable train pair in {list(train_paths)}", reason="no data")
    if cfg.eval.pairs:
      kept[1] = kept[1][:cfg.eval.pairs]
    return kept[0], kept[1]

  def _build_state(self) -> None:
    """The trained state, the step, the evaluation function and the reference inputs."""
    cfg = self.cfg
    optim_cfg, lr_scale = cfg.optim, None
    self.frozen = ()  # the frozen base under LoRA (an input of every forward)
    if cfg.lora is not None:
      models.apply_lora(self.model, cfg.lora, seed=cfg.model.seed, rules=self.rules)
      self.graphdef, params, base = models.split_lora(self.model)
      self.frozen = (base,)
      optim_cfg = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * cfg.lora.lr_multiplier)
      lr_scale = models.lr_scale_tree(params, cfg.lora.b_lr_ratio)
    else:
      self.graphdef, params = nnx.split(self.model)
    dtype = self.model.cfg.dtype
    lora = cfg.lora is not None
    self.ref_inputs = ()  # the frozen copy (reference: model, no LoRA), an input of every step
    mode = {"model": "lora" if lora else "copy", "precompute": "batch", "none": "none"}[cfg.reference]
    if mode == "copy":
      self.ref_inputs = (models.cast_params(params, dtype, copy=True),)
    # precompute: the reference is the initial weights (or the LoRA base), run once by _precompute
    self._ref_fn = jax.jit(reference_logps(self.graphdef, cfg.loss.chunk_size, lora=lora))
    self._ref_params = params if cfg.reference == "precompute" and not lora else None
    loss_fn = pref_loss_fn(self.graphdef, cfg.loss, mode)
    if lora:
      loss_fn = models.lora_loss(loss_fn)
    self.optimizer = train.make_optimizer(optim_cfg, cfg.steps, lr_scale=lr_scale)
    self.schedule = train.make_schedule(optim_cfg, cfg.steps)
    sharding.barrier("dpo-init")  # processes start their first collectives together
    self.state = train.place_on_mesh(train.init_train_state(params, self.optimizer), self.mesh)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.pair_sharding = sharding.logical_sharding(("batch",), self.mesh, self.rules)
    self.step_fn = train.make_train_step(
        loss_fn, self.optimizer, micro_batches=cfg.micro_batches, mesh=self.mesh, rules=self.rules,
        schedule=self.schedule, prepare=pref_prepare,
        compute_view=lambda p, dtype=dtype: models.compute_view(p, dtype))
    self._eval_fn = jax.jit(lambda p, b, *extra: loss_fn(p, pref_prepare(b), *extra)[1])

  def _precompute(self) -> tuple[np.ndarray, np.ndarray]:
    """Reference log-probs ``[n, 2]`` (chosen, rejected) of every train and held-out pair, in batches shaped
    like the training batches."""
    cfg = self.cfg
    if cfg.lora is not None:
      params, frozen = self.state.params, self.frozen
    else:
      params, frozen = models.cast_params(self._ref_params, self.model.cfg.dtype, copy=True), ()
    out = []
    for pairs in (self.train_pairs, self.heldout_pairs):
      cache = np.zeros((len(pairs), 2), np.float32)
      for lo in range(0, len(pairs), cfg.pairs):
        idx = list(range(lo, min(lo + cfg.pairs, len(pairs))))
        batch = self._arrays([pairs[i] for i in idx] + [None] * (cfg.pairs - len(idx)))
        c, r = sharding.to_host(self._ref_fn(params, self._device_batch(batch), *frozen))
        cache[idx, 0], cache[idx, 1] = c[:len(idx)], r[:len(idx)]
      out.append(cache)
    self._ref_params = None  # the copy is not kept
    return out[0], out[1]

  def _arrays(self, pairs: list[Pair | None], ref: np.ndarray | None = None) -> dict[str, np.ndarray]:
    cfg = self.cfg
    arrays = pair_batch(pairs, micro_batches=cfg.micro_batches, rows=cfg.packing.global_rows,
                        seq_len=cfg.packing.seq_len, method=cfg.packing.method,
                        pad_id=self.tokenizer.pad_token_id or 0)
    if cfg.reference == "precompute":
      ref = np.zeros((len(pairs), 2), np.float32) if ref is None else ref
      arrays["ref_chosen"], arrays["ref_rejected"] = ref[:, 0].copy(), ref[:, 1].copy()
    return arrays

  def _batch(self, indices: list[int]) -> dict[str, np.ndarray]:
    """The global batch of the train pairs ``indices``."""
    ref = self.ref_cache[indices] if self.ref_cache is not None else None
    return self._arrays([self.train_pairs[i] for i in indices], ref)

  def _device_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A global batch → global device arrays, each process feeding its own rows and pairs."""
    return {k: sharding.global_batch(v[self._rows], self.batch_sharding) if v.ndim == 2
            else sharding.global_batch(v[self._pairs], self.pair_sharding) for k, v in arrays.items()}

  def current_model(self, *, for_sampling: bool = False):
    """The model with the current parameters; with LoRA and ``for_sampling``, adapters merged in."""
    model = nnx.merge(self.graphdef, self.state.params, *self.frozen)
    if for_sampling and self.cfg.lora is not None:
      return models.merged_base(model)
    return model

  def evaluate(self) -> dict[str, float]:
    """Loss, reward accuracy, margin and implicit rewards over the held-out pairs (means over pairs)."""
    pairs, cfg = self.heldout_pairs, self.cfg
    if not pairs:
      return {}
    total: dict[str, float] = {}
    for lo in range(0, len(pairs), cfg.pairs):
      chunk = pairs[lo:lo + cfg.pairs]
      ref = None
      if self.ref_cache is not None:
        ref = np.concatenate([self.heldout_ref_cache[lo:lo + len(chunk)],
                              np.zeros((cfg.pairs - len(chunk), 2), np.float32)])
      batch = self._device_batch(self._arrays(chunk + [None] * (cfg.pairs - len(chunk)), ref))
      m = sharding.to_host(self._eval_fn(self.state.params, batch, *self.frozen, *self.ref_inputs))
      for k, v in m.items():
        total[k] = total.get(k, 0.0) + float(v)
    return _summary(total, "eval_")

  def run(self, *, until: int | None = None) -> dict[str, Any]:
    """Trains to ``cfg.steps`` (or stops after step ``until``, as a pre-emption would)."""
    cfg = self.cfg
    stream = PairStream(len(self.train_pairs), seed=cfg.data.shuffle_seed)
    guard = train.SkipGuard(cfg.guards, log=print)
    start_step = self._resume(stream, guard)
    logger = train.process_logger(self.out_dir, self.pid, total_steps=cfg.steps, desc="dpo",
                                  show=("loss", "accuracy", "tok/s", "eval_accuracy", "eval_margin"),
                                  tensorboard=cfg.tensorboard)
    guard.log = logger.note
    first_eval = self.evaluate() if start_step == 0 and cfg.eval.every else {}
    if first_eval:
      logger.log(0, first_eval)
    results: dict[str, Any] = {"start_step": start_step, "eval_before": first_eval}
    last = cfg.steps if until is None else min(until, cfg.steps)
    history: list[dict[str, float]] = []
    try:
      self._train_steps(stream, guard, logger, results, history, start_step, last)
    finally:
      if self.checkpointer is not None:
        self.checkpointer.close()  # an in-flight save commits even when the loop raised
    train.eval_if_resumed_at_end(results, start_step=start_step, last=last, total_steps=cfg.steps,
                                 eval_every=cfg.eval.every, evaluate=self.evaluate)
    plot = logger.close(title="dpo")
    self.skips.print(logger.console)
    results["skips"] = self.skips.as_dict()
    losses_seen = [row["loss"] for row in history if "loss" in row]
    if last < cfg.steps:
      train.write_results(results, self.out_dir, pid=self.pid)
      return dict(results, losses=losses_seen, history=history, stopped_at=last)
    results.update(steps=cfg.steps, losses=losses_seen, plot=str(plot) if plot else None,
                   skipped=int(self.state.skipped), reference=cfg.reference)
    if cfg.export_hf:
      train.export_hf(results, out_dir=self.out_dir, model=self.current_model(for_sampling=True),
                      adapter=self.current_model() if cfg.lora is not None else None, tokenizer=self.tokenizer)
    train.write_results(results, self.out_dir, pid=self.pid)
    return dict(results, history=history)

  def _resume(self, stream: PairStream, guard: train.SkipGuard) -> int:
    """The step to start from: the latest checkpoint's under ``checkpoint.resume: auto`` (the state, the pair
    stream and the guards restored; the number of train pairs checked), else 0."""
    if not train.resumable(self.checkpointer, self.cfg.checkpoint.resume):
      return 0
    start_step, self.state, host = self.checkpointer.restore(self.state)
    if int(host["num_pairs"]) != len(self.train_pairs):
      raise train.CheckpointError(f"the checkpoint of step {start_step} was written with {host['num_pairs']} "
                                  f"train pairs, this run has {len(self.train_pairs)}; resume on the same data")
    stream.set_state(host["data"])
    guard.set_state(host.get("guards"))
    return start_step

  def _train_steps(self, stream: PairStream, guard: train.SkipGuard, logger: train.MetricsLogger,
                   results: dict[str, Any], history: list[dict[str, float]], start_step: int, last: int) -> None:
    """Steps ``start_step + 1 .. last``: the update, the progress line every ``log_every`` steps
    (:func:`jaxrl.train.finish_step`, with the evaluation cadence), the checkpoint and the pre-emption poll."""
    cfg = self.cfg
    t_last = time.perf_counter()
    pending = None  # (step, skipped, non-finite micro-batches, loss) of the last step, read one step late
    with train.PreemptionGuard() as preempt:
      for step in range(start_step + 1, last + 1):
        sharding.barrier("dpo-step")
        arrays = self._batch(stream.take(cfg.pairs))
        tokens = int(np.sum(arrays["segment_ids"] > 0))
        self.state, metrics = self.step_fn(self.state, self._device_batch(arrays), *self.frozen, *self.ref_inputs)
        if pending is not None:  # the previous step is done by now: reading its flags does not stall
          guard.observe(*sharding.to_host(pending))
        pending = (step, metrics["skipped"], metrics[train.NONFINITE_KEY], metrics["loss"])
        if step % cfg.log_every == 0 or step == cfg.steps:
          m = sharding.to_host(metrics)
          now = time.perf_counter()
          dt = (now - t_last) / (cfg.log_every if step % cfg.log_every == 0 else 1)
          t_last = now
          row = dict(_summary(m), objective=float(m["loss"]), grad_norm=float(m["grad_norm"]), lr=float(m["lr"]),
                     skipped=float(self.state.skipped), **{"tok/s": tokens / dt, "padding": 1.0 - tokens / arrays[
                         "tokens"].size})
          train.finish_step(step, row, logger=logger, history=history, results=results,
                            evaluate=lambda _: self.evaluate(), eval_every=cfg.eval.every, total_steps=cfg.steps)
        elif cfg.eval.every and step % cfg.eval.every == 0:
          ev = self.evaluate()
          logger.log(step, ev)
          results["eval_after"] = ev
        signum = preempt.requested()
        if self.checkpointer is not None and (self.checkpointer.due(step) or step == last or signum):
          guard.observe(*sharding.to_host(pending))
          pending = None
          self.checkpointer.save(step, self.state, {"data": stream.get_state(), "step": step,
                                                    "guards": guard.state(), "num_pairs": len(self.train_pairs)},
                                 force=True)
        if signum:
          train.stop_preempted(signum, step, checkpointer=self.checkpointer, logger=logger, title="dpo")
      if pending is not None:
        guard.observe(*sharding.to_host(pending))
