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
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models, sharding, train
from jaxrl.pref._data import Pair, PairStream, pair_batch, read_kto_units, read_pairs, write_builtin_pairs
from jaxrl.pref._rm import check_pooling, export_reward_model, reward_value_model, sequence_scores


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefData(data_lib.TaskData):
  """Where pairs come from: JSONL ``train`` files of ``{"prompt", "chosen", "rejected"}`` records (strings or
  chat-message lists), ``heldout`` for evaluation; without files, pairs derived from the built-in task."""

  shuffle_seed: int = 0
  "Seed of each epoch's pair order."


BRADLEY_TERRY = "bradley_terry"
"""``loss.name`` of reward-model training (module docstring)."""

KTO = "kto"
"""``loss.name`` of KTO on labelled singles (:func:`jaxrl.pref.read_kto_units`, :func:`jaxrl.losses.kto_loss`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefLoss(train.ChunkedLoss):
  name: str = "sigmoid"
  ("A name of jaxrl.losses.PREFERENCE_LOSSES: sigmoid (DPO), robust, ipo, hinge, simpo, orpo; kto: KTO on "
   "labelled singles (jaxrl.losses.kto_loss); or bradley_terry: train a reward model (trunk + scalar head, "
   "jaxrl.losses.bradley_terry_loss).")
  beta: float = 0.1
  "β of the DPO family (not used by bradley_terry)."
  label_smoothing: float = 0.0
  "Conservative/robust DPO's ε (losses that take it)."
  gamma: float = 0.0
  "SimPO's target margin."
  center_coef: float = 0.0
  "bradley_terry: λ of the centring term λ·(r_c + r_r)² (TRL's center_rewards_coefficient)."
  pooling: str = "last"
  ("bradley_terry: where a sequence's reward is read, last (the head at its last token, TRL's) or mean (the "
   "head's mean over the answer's positions); saved with the exported head (jaxrl.pref.sequence_scores).")
  logprob_feature: bool = False
  ("bradley_terry with pooling: mean: the reward model keeps its trunk's unembedding and adds α·log π(next "
   "token) to the head at each position, so a score is the head's mean plus α times the answer's "
   "length-normalised log-likelihood under the trunk (α learnt, starting at 1; jaxrl.pref.LogProbValueModel).")
  desirable_weight: float = 1.0
  "kto: λ_D, the weight of desirable completions' losses."
  undesirable_weight: float = 1.0
  "kto: λ_U, the weight of undesirable completions' losses."
  nll_coef: float = 0.0
  ("RPO's α (Pang et al. 2024, iterative reasoning preference optimisation): adds α times the chosen "
   "completion's per-token NLL, -log π(y_w) / |y_w|, to each pair's loss, so that DPO does not lower the "
   "likelihood of the answers it prefers; losses with a reference (sigmoid, robust, ipo, hinge) only.")

  def __post_init__(self):
    if self.name not in (BRADLEY_TERRY, KTO) and self.name not in losses.PREFERENCE_LOSSES:
      raise ValueError(f"loss.name must be one of {sorted(losses.PREFERENCE_LOSSES) + [BRADLEY_TERRY, KTO]}, "
                       f"got {self.name!r}")
    if (self.desirable_weight, self.undesirable_weight) != (1.0, 1.0) and self.name != KTO:
      raise ValueError("loss.desirable_weight / loss.undesirable_weight apply to loss.name: kto only, "
                       f"not {self.name!r}")
    if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
      raise ValueError(f"loss.desirable_weight and loss.undesirable_weight must be > 0, got "
                       f"{self.desirable_weight} and {self.undesirable_weight}")
    if self.name == KTO and (self.label_smoothing or self.gamma):
      raise ValueError("loss.label_smoothing and loss.gamma do not apply to loss.name: kto")
    if self.reward_model and (self.label_smoothing or self.gamma):
      raise ValueError("loss.label_smoothing and loss.gamma do not apply to loss.name: bradley_terry")
    if self.center_coef and not self.reward_model:
      raise ValueError(f"loss.center_coef applies to loss.name: bradley_terry only, not {self.name!r}")
    if self.center_coef < 0:
      raise ValueError(f"loss.center_coef must be >= 0, got {self.center_coef}")
    if self.nll_coef < 0:
      raise ValueError(f"loss.nll_coef must be >= 0, got {self.nll_coef}")
    if self.nll_coef and (self.reward_model or self.name in (KTO, "simpo", "orpo")):
      raise ValueError(f"loss.nll_coef applies to DPO-family losses with a reference, not {self.name!r} "
                       "(orpo has its own NLL term)")
    check_pooling(self.pooling, "loss.pooling")
    if self.pooling != "last" and not self.reward_model:
      raise ValueError(f"loss.pooling applies to loss.name: bradley_terry only, not {self.name!r}")
    if self.logprob_feature and (not self.reward_model or self.pooling != "mean"):
      raise ValueError("loss.logprob_feature applies to loss.name: bradley_terry with loss.pooling: mean "
                       f"(got {self.name!r}, pooling {self.pooling!r}): the log-prob of a position's next token "
                       "is read over the answer")

  @property
  def reward_model(self) -> bool:
    """Whether this trains a Bradley–Terry reward model (rather than the policy)."""
    return self.name == BRADLEY_TERRY

  @property
  def length_normalised(self) -> bool:
    """Whether the loss takes the completions' lengths (SimPO, ORPO)."""
    return (not self.reward_model and self.name != KTO
            and "chosen_lengths" in inspect.signature(losses.PREFERENCE_LOSSES[self.name]).parameters)


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
class PrefEval(train.EvalCadence):
  pairs: int = 0
  "Held-out pairs evaluated (the first ones); 0: all."


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(train.TrainerConfig):
  """``jaxrl dpo``: the shared trainer sections (:class:`jaxrl.train.TrainerConfig`) plus pairs, packing, loss,
  reference and eval."""

  data: PrefData = dataclasses.field(default_factory=PrefData)
  pairs: int = 8
  "Preference pairs per global batch."
  packing: PairPacking = dataclasses.field(default_factory=PairPacking)
  loss: PrefLoss = dataclasses.field(default_factory=PrefLoss)
  reference: Literal["model", "precompute", "none"] = "model"
  "Reference log-probs: recomputed each step (frozen copy; LoRA: the base), precomputed once, or none."
  micro_batches: int = 1
  "Gradient-accumulation micro-batches per global batch (each packs pairs / micro_batches pairs)."
  eval: PrefEval = dataclasses.field(default_factory=PrefEval)
  lora: models.LoraConfig | None = None
  "Train LoRA adapters only; the base with adapters off is then the reference."
  out_dir: str = "runs/dpo"
  plan: dict[str, Any] = dataclasses.field(default_factory=dict)
  ("What ``jaxrl plan`` checks this recipe against: ``targets``, ``preset``, ``overrides`` as in an RL recipe "
   "(docs/scaling.md); read and checked by ``jaxrl plan``, not by training.")

  def __post_init__(self):
    super().__post_init__()
    unknown = set(self.plan) - {"targets", "preset", "overrides"}
    if unknown:
      raise ValueError(f"plan: unknown key(s) {sorted(unknown)}; known: targets, preset, overrides")
    if self.pairs < 1:
      raise ValueError(f"pairs must be >= 1, got {self.pairs}")
    if self.micro_batches < 1 or self.pairs % self.micro_batches or self.packing.global_rows % self.micro_batches:
      raise ValueError(f"micro_batches={self.micro_batches} must divide pairs={self.pairs} and "
                       f"packing.global_rows={self.packing.global_rows}")
    if not self.data.train and self.data.builtin is None:
      raise ValueError("data: give data.train files or data.builtin")
    if self.loss.reward_model:
      if self.reference != "none":
        raise ValueError("loss.name: bradley_terry trains a reward model, which has no reference: set "
                         f"reference: none (got {self.reference!r})")
      if self.lora is not None:
        raise ValueError("loss.name: bradley_terry: LoRA is not supported for reward models yet; remove `lora:`")
      return
    if self.loss.name == KTO and not self.data.train:
      raise ValueError("loss.name: kto reads labelled singles: give data.train files of {prompt, completion, label} "
                       "records (there is no built-in KTO data)")
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
    if loss_cfg.name == KTO:
      per_pair, m = _kto(loss_cfg, batch, chosen, rejected, *ref)
      return jnp.sum(batch["pair_weight"] * per_pair), _metric_sums(batch["pair_valid"], per_pair, m)
    lengths = {}
    if loss_cfg.length_normalised:
      lengths = {"chosen_lengths": batch["chosen_lengths"], "rejected_lengths": batch["rejected_lengths"]}
    per_pair, m = losses.preference_loss(loss_cfg.name, chosen, rejected, *ref, beta=loss_cfg.beta,
                                         label_smoothing=loss_cfg.label_smoothing, gamma=loss_cfg.gamma,
                                         **lengths)  # [P]
    if loss_cfg.nll_coef:  # RPO: α·(-log π(y_w) / |y_w|) per pair
      per_pair = per_pair - loss_cfg.nll_coef * chosen / jnp.maximum(batch["chosen_lengths"], 1.0)
    return jnp.sum(batch["pair_weight"] * per_pair), _metric_sums(batch["pair_valid"], per_pair, m)
  return loss_fn


def _kto(loss_cfg: PrefLoss, batch, logps, kl_logps, ref_logps, kl_ref_logps):
  """KTO per unit ``[P]`` (:func:`jaxrl.losses.kto_loss`) with ``z0`` from the batch's KL sequences
  (:func:`jaxrl.losses.kto_kl_reference` over the valid units of this micro-batch), and the metrics
  :func:`_metric_sums` reads: accuracy (the implicit reward ``β r`` has the label's sign), margin (``β r``
  signed by the label), chosen / rejected reward (``β r`` of desirable / undesirable units, 0 on the others)."""
  valid, desirable = batch["pair_valid"], batch["desirable"]  # [P]
  z0 = losses.kto_kl_reference(kl_logps, kl_ref_logps, mask=valid)
  per_unit, m = losses.kto_loss(logps, ref_logps, desirable > 0, beta=loss_cfg.beta,
                                desirable_weight=loss_cfg.desirable_weight,
                                undesirable_weight=loss_cfg.undesirable_weight, kl_ref=z0)  # [P]
  r, sign = m["rewards"], 2.0 * desirable - 1.0
  return per_unit, {"accuracy": (sign * r > 0).astype(jnp.float32), "margins": sign * r,
                    "rewards_chosen": desirable * r, "rewards_rejected": (1.0 - desirable) * r}


def rm_loss_fn(graphdef, loss_cfg: PrefLoss):
  """``loss(params, batch) -> (Σ pair_weight·ℓ, metric sums)`` of a Bradley–Terry reward model
  (:class:`jaxrl.models.ValueModel`): each sequence's reward is the head at its last token or its mean over the
  answer (``loss.pooling``, :func:`jaxrl.pref.sequence_scores`), ``ℓ = -log σ(r_c - r_r - m) + λ·(r_c + r_r)²``
  per pair (:func:`jaxrl.losses.bradley_terry_loss`; ``m`` the batch's ``margins``, ``λ = loss.center_coef``)."""
  def loss_fn(params, batch):
    values = nnx.merge(graphdef, params)(batch["tokens"], positions=batch["positions"],
                                         segment_ids=batch["segment_ids"])  # [R, T]
    num_pairs = batch["pair_valid"].shape[0]
    scores = sequence_scores(values, batch["seq_ids"], 2 * num_pairs, pooling=loss_cfg.pooling,
                             answer_mask=batch["loss_mask"])  # [2P]
    per_pair, m = losses.bradley_terry_loss(scores[0::2], scores[1::2], margin=batch["margins"],
                                            center_coef=loss_cfg.center_coef)  # [P]
    return jnp.sum(batch["pair_weight"] * per_pair), _metric_sums(batch["pair_valid"], per_pair, m)
  return loss_fn


def _metric_sums(valid: jax.Array, per_pair: jax.Array, m: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Sums over the valid pairs of the loss, accuracy, margin and rewards (means: :func:`_summary`)."""
  return {"pairs": jnp.sum(valid), "loss_sum": jnp.sum(valid * per_pair),
          "accuracy_sum": jnp.sum(valid * m["accuracy"]), "margin_sum": jnp.sum(valid * m["margins"]),
          "chosen_reward_sum": jnp.sum(valid * m["rewards_chosen"]),
          "rejected_reward_sum": jnp.sum(valid * m["rewards_rejected"])}


def pref_prepare(batch):
  """Folds the global mean over valid pairs into per-pair weights (split-invariant over micro-batches)."""
  valid = batch["pair_valid"]
  return dict(batch, pair_weight=valid / jnp.maximum(jnp.sum(valid), 1.0))


def _summary(m: dict[str, Any], prefix: str = "") -> dict[str, float]:
  n = max(float(m["pairs"]), 1.0)
  return {f"{prefix}loss": float(m["loss_sum"]) / n, f"{prefix}accuracy": float(m["accuracy_sum"]) / n,
          f"{prefix}margin": float(m["margin_sum"]) / n, f"{prefix}chosen_reward": float(m["chosen_reward_sum"]) / n,
          f"{prefix}rejected_reward": float(m["rejected_reward_sum"]) / n}


class DPOTrainer(train.PackedTrainer):
  """Builds everything once; :meth:`run` trains, evaluates, checkpoints and exports."""

  def __init__(self, cfg: DPOConfig):
    self._setup_run(cfg)
    self._check_divisible(pairs=cfg.pairs, **{"packing.global_rows": cfg.packing.global_rows})
    self._rows = sharding.process_slice(cfg.packing.global_rows)  # this process's rows of each batch
    self._pairs = sharding.process_slice(cfg.pairs)  # and its pairs
    self._build_model()
    if cfg.loss.reward_model:  # the trunk with the critic's scalar head at zero (step 0: every reward 0, or the
      # trunk's length-normalised log-likelihood with the log-prob feature)
      self.model = models.place_value_model(reward_value_model(self.model, logprob_feature=cfg.loss.logprob_feature,
                                                               chunk_size=cfg.loss.chunk_size),
                                            mesh=self.mesh, rules=self.rules)
    self.skips = data_lib.SkipReport()
    self.train_pairs, self.heldout_pairs = self._load_pairs()
    self._build_state()
    self.ref_cache = None  # [n, 2] reference log-probs of train pairs; held-out: heldout_ref_cache
    if cfg.reference == "precompute":
      self.ref_cache, self.heldout_ref_cache = self._precompute()
    self._make_checkpointer()

  def _load_pairs(self) -> tuple[list[Pair], list[Pair]]:
    cfg = self.cfg
    train_paths, heldout_paths = cfg.data.train, cfg.data.heldout
    if not train_paths:
      out = self.out_dir / "data" if not self.pid else self.out_dir / "processes" / str(self.pid) / "data"
      train_path, heldout_path = write_builtin_pairs(out, cfg.data.builtin)
      train_paths, heldout_paths = (str(train_path),), (str(heldout_path),) if heldout_path else ()
    kept = []
    read = read_kto_units if cfg.loss.name == KTO else read_pairs
    for pairs in (read(train_paths, self.tokenizer), read(heldout_paths, self.tokenizer) if heldout_paths else []):
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
    params, optim_cfg, lr_scale = self._trainable()
    dtype = self.model_config.dtype
    lora = cfg.lora is not None
    self.ref_inputs = ()  # the frozen copy (reference: model, no LoRA), an input of every step
    mode = {"model": "lora" if lora else "copy", "precompute": "batch", "none": "none"}[cfg.reference]
    if mode == "copy":
      self.ref_inputs = (models.cast_params(params, dtype, copy=True),)
    # precompute: the reference is the initial weights (or the LoRA base), run once by _precompute
    self._ref_fn = jax.jit(reference_logps(self.graphdef, cfg.loss.chunk_size, lora=lora))
    self._ref_params = params if cfg.reference == "precompute" and not lora else None
    loss_fn = rm_loss_fn(self.graphdef, cfg.loss) if cfg.loss.reward_model else pref_loss_fn(self.graphdef,
                                                                                            cfg.loss, mode)
    if lora:
      loss_fn = models.lora_loss(loss_fn)
    self._init_state(params, optim_cfg, lr_scale, name="dpo")
    self.pair_sharding = sharding.logical_sharding(("batch",), self.mesh, self.rules)
    self.step_fn = train.make_train_step(
        loss_fn, self.optimizer, micro_batches=cfg.micro_batches, mesh=self.mesh, rules=self.rules,
        schedule=self.schedule, prepare=pref_prepare,
        compute_view=lambda p, dtype=dtype: models.compute_view(p, dtype))
    self._eval_fn = jax.jit(lambda p, b, *extra: loss_fn(p, pref_prepare(b), *extra)[1])

  @property
  def model_config(self) -> models.ModelConfig:
    """The decoder's config (a reward model's: its trunk's)."""
    return self.model.trunk.cfg if self.cfg.loss.reward_model else self.model.cfg

  def _export(self, results: dict[str, Any]) -> None:
    """A reward model: the trunk and the head's file in ``out_dir/hf`` (:func:`jaxrl.pref.export_reward_model`);
    a policy: the shared export."""
    if not self.cfg.loss.reward_model:
      return super()._export(results)
    if self.cfg.export_hf:
      results["reward_head"] = str(export_reward_model(self.current_model(), self.out_dir / "hf",
                                                       tokenizer=self.tokenizer, pooling=self.cfg.loss.pooling))
      results["hf_dir"] = str(self.out_dir / "hf")

  def _precompute(self) -> tuple[np.ndarray, np.ndarray]:
    """Reference log-probs ``[n, 2]`` (chosen, rejected) of every train and held-out pair, in batches shaped
    like the training batches."""
    cfg = self.cfg
    if cfg.lora is not None:
      params, frozen = self.state.params, self.frozen
    else:
      params, frozen = models.cast_params(self._ref_params, self.model_config.dtype, copy=True), ()
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

  def batch(self, indices: list[int]) -> dict[str, np.ndarray]:
    """The global batch (host arrays) of the train pairs ``indices``."""
    ref = self.ref_cache[indices] if self.ref_cache is not None else None
    return self._arrays([self.train_pairs[i] for i in indices], ref)

  def update(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """One optimizer step on a global batch of :meth:`batch`; returns the step's metrics (device arrays)."""
    self.state, metrics = self.step_fn(self.state, self._device_batch(arrays), *self.frozen, *self.ref_inputs)
    return metrics

  def _device_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A global batch → global device arrays, each process feeding its own rows and pairs."""
    return {k: sharding.global_batch(v[self._rows], self.batch_sharding) if v.ndim == 2
            else sharding.global_batch(v[self._pairs], self.pair_sharding) for k, v in arrays.items()}

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
    logger, results, last = self._begin_run(guard, start_step=start_step, until=until, name="dpo",
                                            show=("loss", "accuracy", "tok/s", "eval_accuracy", "eval_margin"))
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
    self._export(results)
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
    """Steps ``start_step + 1 .. last`` through :func:`jaxrl.train.run_steps`: the update, the progress line
    every ``log_every`` steps (:func:`jaxrl.train.finish_step`, with the evaluation cadence), the checkpoint
    and the pre-emption poll."""
    cfg = self.cfg
    last_arrays: list[dict[str, np.ndarray]] = []

    def step(s: int):
      arrays = self.batch(stream.take(cfg.pairs))
      last_arrays[:] = [arrays]
      return self.update(arrays)

    def report(s: int, m, dt: float) -> None:
      if m is not None:
        arrays = last_arrays[0]
        tokens = int(np.sum(arrays["segment_ids"] > 0))
        row = dict(_summary(m), objective=float(m["loss"]), grad_norm=float(m["grad_norm"]), lr=float(m["lr"]),
                   skipped=float(self.state.skipped), **{"tok/s": tokens / dt,
                                                         "padding": 1.0 - tokens / arrays["tokens"].size})
        train.finish_step(s, row, logger=logger, history=history, results=results,
                          evaluate=lambda _: self.evaluate(), eval_every=cfg.eval.every, total_steps=cfg.steps)
      elif cfg.eval.every and s % cfg.eval.every == 0:
        ev = self.evaluate()
        logger.log(s, ev)
        results["eval_after"] = ev

    def save(s: int) -> None:
      self.checkpointer.save(s, self.state, {"data": stream.get_state(), "step": s, "guards": guard.state(),
                                             "num_pairs": len(self.train_pairs)}, force=True)

    train.run_steps(start_step=start_step, last=last, total_steps=cfg.steps, log_every=cfg.log_every, name="dpo",
                    step=step, report=report, save=save, checkpointer=self.checkpointer, guard=guard, logger=logger)
