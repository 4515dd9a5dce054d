"""The synchronous RL loop: sample → reward → advantage → token-budget micro-batches → updates.

One step (DESIGN.md, "One RL step, as data"):

1. ``prompts_per_step`` prompts from a seeded shuffled stream; ``Sampler.generate`` draws ``n``
   completions each, on the trainer's mesh with the trainer's current parameter arrays (the sampler
   is handed ``nnx.merge(graphdef, state.params)``: no copy).
2. The reward function scores them in a thread/process pool (``RewardRunner``); the DAPO overlong
   penalty is added; with dynamic sampling, groups whose rewards are all equal are dropped and more
   prompts are generated (up to ``max_rounds``) until the batch is full.
3. ``ADVANTAGES[name]`` over the whole batch; overlong filtering masks truncated responses.
4. The groups are split into ``mini_batches``; each is packed into micro-batches under a token
   budget (AReaL Algorithm 1); π_old comes from the sampler or a trainer forward pass (and π_ref from
   the frozen initial model when β > 0).
5. ``ppo_epochs`` × mini-batches of ``make_train_step`` updates with ``OBJECTIVES[name]``; the
   aggregation normaliser is computed once per mini-batch, so the packing does not change the result.
   Recomputed π_old / π_ref stay on device (one jitted scan over the micro-batches) until the update.

On several processes (``jax.distributed``, docs/multihost.md) every process draws the same global prompt
stream and generates, scores and packs its own contiguous share (``prompts_per_step / processes``
prompts, whole GRPO groups); advantages, dynamic-sampling decisions and metrics use explicitly
all-gathered per-sample scalars, so the result equals one process's; packed micro-batches become global
arrays from each process's rows (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, pref, sampling, sharding, train
from jaxrl import rewards as rewards_lib
from jaxrl.rewards import RewardRunner
from jaxrl.rl import _critic
from jaxrl.rl._config import RLConfig
from jaxrl.rl._distill import FixedCompletions, MixedRollout, Teacher, add_reverse_kl, describe_source
from jaxrl.rl._distill_server import ServerTeacher
from jaxrl.rl._engine_build import build_sampler, rollout_max_len
from jaxrl.rl._learner import make_learner_step, make_logprob_program, packed_layout, step_metrics, update_metrics
from jaxrl.rl._loss import make_logprob_fn
from jaxrl.rl._packing import (PackedBatch, agree_patch_bucket, loss_column_capacity, pack_sequences,
                                pad_micro_batches, with_loss_columns)
from jaxrl.rl._prm import load_implicit_prm, process_advantages, rollout_process_rewards
from jaxrl.rl._prompts import EncodedPrompts, PromptStream, load_prompt_sets, reward_fields, rm_prompt
from jaxrl.rl._rollout import Rollout, compute_advantages, loss_mask, sample_records, sequence_fields
from jaxrl.rl._source import EngineRollout, RolloutSource, monitor_metrics


SAMPLES_FILE = "samples.jsonl"
"""Where ``log_samples`` writes each step's first samples (:func:`jaxrl.rl._rollout.sample_records`), in ``out_dir``."""


class RLTrainer:
  """Builds model, optimizer, sampler, prompts and rewards once; :meth:`run` trains.

  Attributes after :meth:`run`: ``history`` (per-step metrics dicts) and ``update_history`` (per
  update: ratio min/max, log-prob difference, loss...).
  """

  def __init__(self, cfg: RLConfig, *, devices=None):
    # devices: the trainer's device set (default all); the async trainer passes its trainer sub-mesh.
    self.cfg = cfg
    self.out_dir = Path(cfg.out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.procs, self.pid = jax.process_count(), jax.process_index()
    if self.pid == 0:
      (self.out_dir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    if cfg.rollout.prompts_per_step % self.procs:
      raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the "
                       f"{self.procs} processes (each generates an equal share of whole prompt groups)")
    self.mesh = cfg.mesh.build(devices)
    self.rules = cfg.mesh.logical_rules()
    vl = cfg.model.config().vision is not None
    if cfg.data.zero_pixels and not vl:
      raise ValueError("data.zero_pixels: true needs a vision-language model (this model is text-only)")
    tok_dir = data_lib.tokenizer_dir(cfg.tokenizer, cfg.model.hf_dir, vision=vl)
    self.tokenizer = models.load_tokenizer(tok_dir)
    model = cfg.model.build(mesh=self.mesh, rules=self.rules)
    models.check_tokenizer(self.tokenizer, model.cfg)
    # On-policy distillation: the frozen teacher on the same mesh, or behind jaxrl serve (refused here if its
    # tokenizer differs)
    self.teacher: Teacher | ServerTeacher | None = None
    if cfg.distill is not None and cfg.distill.server is not None:
      self.teacher = ServerTeacher(cfg.distill.server, student_tokenizer=self.tokenizer,
                                   student=describe_source(cfg.model, tok_dir), temperature=cfg.rollout.temperature)
    elif cfg.distill is not None:
      self.teacher = Teacher(cfg, student_tokenizer=self.tokenizer, student_cfg=model.cfg,
                             student_tokenizer_dir=tok_dir, mesh=self.mesh, rules=self.rules)
    self.train_dtype = model.cfg.dtype  # the train step differentiates a view of the weights in this dtype
    algo = cfg.algorithm
    optim_cfg, lr_scale = cfg.optim, None
    self.frozen = ()  # extra (non-differentiated) inputs of every forward: the frozen base under LoRA
    if cfg.lora is not None:
      # Adapters are the trained state (gradients, optimizer state, checkpoints); the base is frozen
      # and, with adapters switched off, is also the KL reference (no copy of the weights).
      models.apply_lora(model, cfg.lora, seed=cfg.model.seed, rules=self.rules)
      self.graphdef, params, base = models.split_lora(model)
      self.frozen = (base,)
      optim_cfg = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * cfg.lora.lr_multiplier)
      lr_scale = models.lr_scale_tree(params, cfg.lora.b_lr_ratio)
    else:
      self.graphdef, params = nnx.split(model)
    self.vision = model.cfg.vision  # the packer lays out a VLM rollout's images per row with it
    # Without LoRA the reference is a copy of the initial weights; skipped entirely when β = 0 (loss and
    # the critic's KL reward).
    need_ref = algo.kl_coef > 0 or (cfg.critic is not None and cfg.critic.kl_reward_coef > 0)
    self.ref_params = (models.cast_params(params, model.cfg.dtype, copy=True)  # compute-dtype copy, on device
                       if need_ref and cfg.lora is None else None)
    self.ref_logprob_fn = None
    if need_ref and cfg.lora is not None:
      self.ref_logprob_fn = make_logprob_fn(self.graphdef, temperature=cfg.rollout.temperature,
                                            chunk_size=algo.logprob_chunk_size, lora=True, base_only=True)
    total_updates = cfg.steps * cfg.updates_per_step
    self.optimizer = train.make_optimizer(optim_cfg, total_updates, lr_scale=lr_scale)
    self.schedule = train.make_schedule(optim_cfg, total_updates)
    sharding.barrier("rl-init")  # processes start their first collectives together
    self.state = _on_mesh(train.init_train_state(params, self.optimizer), self.mesh)
    self.train_prompts, self.heldout_prompts = load_prompt_sets(cfg.data, self.tokenizer)
    self.stream = PromptStream(len(self.train_prompts), seed=cfg.data.shuffle_seed)
    self.reward_model = None  # reward.model: scores each chunk on this mesh, then the pool reads the scores
    if cfg.reward.model is not None:
      rm = cfg.reward.model
      self.reward_model = pref.RewardModel.load(rm.path, mesh=self.mesh, rules=self.rules, rows=rm.rows,
                                                seq_len=rm.seq_len)
    self.prm = None  # reward.implicit_prm: dense process rewards of the sampled token ids (process_rewards)
    if cfg.reward.implicit_prm is not None:
      self.prm = load_implicit_prm(cfg.reward.implicit_prm, mesh=self.mesh, rules=self.rules, tokenizer=self.tokenizer,
                                   tokenizer_dir=tok_dir, chunk_size=algo.logprob_chunk_size)
    self.last_prm: dict[str, Any] | None = None
    self.rewards = RewardRunner(pref.reward_model_score if self.reward_model else cfg.reward.fn,
                                config=cfg.reward.runner, reward_kwargs=cfg.reward.kwargs)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.critic = (_critic.Critic(cfg, mesh=self.mesh, rules=self.rules, batch_sharding=self.batch_sharding)
                   if cfg.critic is not None else None)  # PPO's value model (gae/egae)
    self.data_parallel = math.prod(self.mesh.shape[a] for a in self.rules.mesh_axes("batch"))
    # The head scores each row's loss columns only (rl.with_loss_columns), unless the rows' positions are split
    # over a sequence axis: gathering them would collect every shard's hidden states.
    self.gather_loss_columns = math.prod(self.mesh.shape.get(a, 1) for a in self.rules.mesh_axes("seq")) == 1
    for first in [1] + [s.start_step for s in cfg.rollout.context_schedule]:
      self.layout(first)  # every stage's micro-batch shape is checked up front
    self.logprob_fn = make_logprob_fn(self.graphdef, temperature=cfg.rollout.temperature,
                                      chunk_size=algo.logprob_chunk_size, lora=cfg.lora is not None)
    self._steps: dict[tuple[int, int], Any] = {}
    self._loss_widths: dict[int, int] = {}  # row length -> loss-column width (:meth:`_loss_width`)
    self._logprob_programs: dict[tuple[int, int], Any] = {}
    self.sampler: sampling.Sampler | sampling.Engine | None = None
    # Training rollouts come from the source; evaluation samples on the same backend (:meth:`_sampler_for`). A
    # subclass that sets a source of its own closes it in its close().
    self.source: RolloutSource = EngineRollout(cfg.rollout, seed=cfg.seed, backend=self._sampler_for,
                                               submit=self._submit, rewards=lambda: self.rewards,
                                               procs=self.procs, pid=self.pid)
    if cfg.distill is not None and cfg.distill.lmbda < 1:  # GKD's λ: some steps train on fixed completions
      r = cfg.rollout
      fixed = FixedCompletions(cfg.distill.data, self.tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                               max_new=min([r.max_new_tokens] + [s.max_new_tokens for s in r.context_schedule]),
                               seed=cfg.data.shuffle_seed)
      self.source = MixedRollout(self.source, fixed, rollout=r, lmbda=cfg.distill.lmbda, seed=cfg.seed,
                                 steps=cfg.steps, procs=self.procs, pid=self.pid)
    self._stage = 0
    self.history: list[dict[str, float]] = []
    self.update_history: list[dict[str, float]] = []
    self.last_rollout: Rollout | None = None
    self.checkpointer = None
    if cfg.checkpoint.every or cfg.rollout.context_schedule:
      self.checkpointer = train.Checkpointer(self.out_dir / "checkpoints", every=cfg.checkpoint.every or 10**9,
                                             keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every,
                                             async_save=cfg.checkpoint.async_save)
    self.guard = train.SkipGuard(cfg.guards, log=print)  # non-finite updates (docs/reliability.md)
    self.preemption = train.PreemptionGuard()  # SIGTERM/SIGINT: checkpoint after the step, then Preempted

  def layout(self, step: int) -> tuple[int, int]:
    """``(row_len, rows)`` of the packed micro-batches at ``step`` (:func:`packed_layout`)."""
    return packed_layout(self.cfg, step, data_parallel=self.data_parallel, processes=self.procs)

  # ------------------------------------------------------------------------------------------------
  # Sampling

  def current_model(self):
    """The policy with the current parameters (LoRA: base + unmerged adapters; arrays shared, not copied)."""
    return nnx.merge(self.graphdef, self.state.params, *self.frozen)

  def sampling_model(self):
    """The policy the sampler or rollout engine runs: compute-dtype copies of the float32 master weights,
    cast on device, so it neither holds nor reads float32 weights (the same arrays when they already are
    in the compute dtype; LoRA: :meth:`current_model`, adapters unmerged)."""
    model = self.current_model()
    return model if self.cfg.lora is not None else models.cast_params(model, model.cfg.dtype)

  def _eval_max_new(self, step: int) -> int:
    return self.cfg.eval.max_new_tokens or self.cfg.rollout.stage(step)[1]

  def _sampler_for(self, step: int) -> sampling.Sampler | sampling.Engine:
    """The sampler (or, with ``rollout.engine``, the engine) for ``step``'s stage, holding the current
    parameters (built by :func:`jaxrl.rl.build_sampler`; rebuilt when :func:`jaxrl.rl.rollout_max_len` grows)."""
    max_len = rollout_max_len(self.cfg, step)
    model = self.sampling_model()
    version = int(self.state.step)
    if self.sampler is None or self.sampler.max_len != max_len:
      self.sampler = build_sampler(self.cfg, model, self.tokenizer, max_len=max_len, mesh=self.mesh, rules=self.rules,
                                   version=version, entropy=self.engine_entropy)
    else:
      self.sampler.set_weights(model, version=version)
    return self.sampler

  engine_entropy = False
  """Build the rollout engine with per-token entropies (``sampling.Engine(entropy=True)``; ARPO's probe)."""

  reward_prefetch = None
  """None, or ``fn(texts, fields)`` called with each generated chunk's completions and their reward fields
  just before they are scored (Rubric-ARM batches its frozen judge's calls for the whole chunk here)."""

  def _submit(self, prompts: EncodedPrompts, idx: list[int], n: int, texts: list[str], *, offset: int) -> list[int]:
    """Schedules the rewards of completions ``texts`` (rows ``i·n + j`` of prompts ``idx``) in the
    pool under indices ``offset, offset + 1, ...`` and returns them (collect with ``rewards.collect``)."""
    rows = [i for i in idx for _ in range(n)]
    fields = [reward_fields(prompts.records[i]) for i in rows]
    if self.reward_prefetch is not None:
      self.reward_prefetch(list(texts), fields)
    if self.reward_model is not None:  # one batched forward on the mesh for the whole chunk
      scores = self.reward_model.score([rm_prompt(prompts.records[i]) for i in rows], list(texts))
      fields = [dict(f, rm_score=float(v)) for f, v in zip(fields, scores)]
    keys = sorted({k for f in fields for k in f})  # every sample gets every column (None where absent)
    return [self.rewards.submit(prompts.texts[i], text, index=offset + k, **{c: f.get(c) for c in keys})
            for k, (i, text, f) in enumerate(zip(rows, texts, fields))]

  def _score(self, prompts: EncodedPrompts, idx: list[int], n: int, out: sampling.SampleOutput):
    return self.rewards.collect(self._submit(prompts, idx, n, out.texts, offset=0))

  def collect(self, step: int) -> tuple[Rollout | None, dict[str, float]]:
    """The step's training batch from :attr:`source` (``None``: nothing to train on) and its metrics: reward,
    accuracy and length statistics over every process's drawn samples, then the source's own metrics (and
    ``tok_s/rollout`` from its ``time_generate``)."""
    batch = self.source.rollout(step, self.train_prompts, self.stream)
    everything = self.global_view(batch.drawn)
    metrics = self.rollout_metrics(everything)
    if batch.metrics.get("distill/on_policy") == 0.0:  # GKD's fixed completions (MixedRollout): not scored
      metrics = {k: v for k, v in metrics.items() if k.startswith("response/")}
    metrics.update(batch.metrics)
    if "time_generate" in batch.metrics:
      metrics["tok_s/rollout"] = float(everything.lengths.sum()) / max(batch.metrics["time_generate"], 1e-9)
    return batch.rollout, metrics

  def global_view(self, ro: Rollout) -> Rollout:
    """The per-sample scalars of every process's ``ro`` (process order; group ids made global) for
    statistics: advantages, masks, metrics. Prompts, texts and tokens are not gathered (zeros)."""
    if self.procs == 1:
      return ro
    got, counts = sharding.allgather_rows({
        "rewards": ro.rewards, "task_rewards": ro.task_rewards, "lengths": ro.lengths,
        "truncated": ro.truncated, "group_ids": ro.group_ids})
    groups = sharding.allgather_scalar(ro.num_groups)
    offsets = np.repeat(np.cumsum(groups) - groups, counts)
    total = int(counts.sum())
    return Rollout(prompt_ids=(np.zeros((0,), np.int32),) * total,
                   tokens=np.zeros((total, ro.tokens.shape[1]), np.int32),
                   logprobs=np.zeros((total, ro.tokens.shape[1]), np.float32), lengths=got["lengths"],
                   truncated=got["truncated"], group_ids=(got["group_ids"] + offsets).astype(np.int32),
                   rewards=got["rewards"], task_rewards=got["task_rewards"], texts=("",) * total)

  def rollout_metrics(self, ro: Rollout) -> dict[str, float]:
    """Reward, accuracy and response-length statistics of ``ro`` (a global view: the step's metrics)."""
    thr = self.cfg.reward.correct_threshold
    m = {
        "reward/mean": float(ro.rewards.mean()), "reward/std": float(ro.rewards.std()),
        "accuracy": float((ro.task_rewards > thr).mean()),
        "response/length_mean": float(ro.lengths.mean()), "response/length_max": float(ro.lengths.max()),
        "response/truncated_frac": float(ro.truncated.mean()),
    }
    if self.cfg.rollout.overlong_penalty is not None:
      m["reward/task_mean"] = float(ro.task_rewards.mean())
    return m

  # ------------------------------------------------------------------------------------------------
  # Updates

  def _step_fn(self, num_micro: int, max_len: int):
    key = (num_micro, max_len)
    if key not in self._steps:
      self._steps[key] = make_learner_step(self.cfg, self.graphdef, self.optimizer, num_micro=num_micro,
                                           max_len=max_len, mesh=self.mesh, rules=self.rules,
                                           schedule=self.schedule, train_dtype=self.train_dtype,
                                           extra_term=self.teacher.gkd_term if self._gkd else None)
    return self._steps[key]

  @property
  def _gkd(self) -> bool:
    return self.cfg.distill is not None and self.cfg.distill.mode == "gkd"

  def _distill(self, batches: list[dict[str, jax.Array]], packed: list[PackedBatch]) -> dict[str, float]:
    """The teacher's log-probs of every mini-batch's sampled tokens; under ``distill.mode: reverse_kl`` each
    token's advantage gains ``coef · (log π_teacher − log π_student)`` (both from the trainer's log-prob program at
    the rollout parameters; a ``distill.server`` teacher's came with the packed batch, ``teacher_logprobs``).
    Returns ``distill/reverse_kl``, the step's mean ``log π_student − log π_teacher`` over the loss tokens (the k1
    estimate of the reverse KL to the teacher), and the final ``advantage/abs_mean``."""
    coef = 0.0 if self._gkd else self.cfg.distill.coef
    sums = []
    for pb, batch in zip(packed, batches):
      m = pb.shape[0]
      student = batch.pop("student_logprobs", None)
      if student is None:
        student = self._forward(self.state.params, batch, m)
      teacher = batch.pop("teacher_logprobs", None)  # distill.server: read from the server by pack()
      if teacher is None:
        teacher = self._logprob_program(self.teacher.logprob_fn, m)(self.teacher.params, batch)
      batch["advantages"], got = add_reverse_kl(batch["advantages"], student, teacher, batch["loss_mask"],
                                                np.float32(coef))
      sums.append(got)
    kl, adv, count = np.sum(np.asarray(sharding.to_host(sums), np.float64), axis=0)
    return {"distill/reverse_kl": kl / max(count, 1.0), "advantage/abs_mean": adv / max(count, 1.0)}

  def _device(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows → global arrays (process ``p``'s rows form the ``p``-th block)."""
    return {k: sharding.global_batch(v, self.batch_sharding) for k, v in arrays.items()}

  def _logprob_program(self, fn, num_micro: int):
    """:func:`make_logprob_program` for ``fn``, built once per (``fn``, micro-batches)."""
    key = (id(fn), num_micro)
    if key not in self._logprob_programs:
      self._logprob_programs[key] = make_logprob_program(fn, num_micro, mesh=self.mesh,
                                                         batch_sharding=self.batch_sharding)
    return self._logprob_programs[key]

  def _forward(self, params, batch: dict[str, jax.Array], num_micro: int, *, fn=None) -> jax.Array:  # [R·M, T]
    return self._logprob_program(fn or self.logprob_fn, num_micro)(params, batch, *self.frozen)

  def process_rewards(self, rollout: Rollout) -> tuple[np.ndarray, dict[str, float]]:
    """``reward.implicit_prm``'s dense rewards ``[N, L]`` of ``rollout`` (before ``coef``) and their metrics
    (:func:`jaxrl.rl._prm.rollout_process_rewards`); the per-sample token and step rewards are kept in
    :attr:`last_prm` (with ``dense``). Several processes: a collective call, each scoring its own samples;
    ``dense`` is this process's rows, the metrics are means over every process's samples."""
    dense, metrics, self.last_prm = rollout_process_rewards(self.prm, rollout,
                                                            delimiter=self.cfg.reward.implicit_prm.step_delimiter)
    self.last_prm["dense"] = dense
    if self.procs > 1:  # per-process means → the mean over every process's samples
      counts = sharding.allgather_scalar(rollout.num_samples).astype(np.float64)
      metrics = {k: float((sharding.allgather_scalar(np.float64(v)) * counts).sum() / max(counts.sum(), 1.0))
                 for k, v in metrics.items()}
    return dense, metrics

  def _all_rows(self, dense: np.ndarray, width: int) -> np.ndarray:  # [N_all, width]
    """Every process's rows of the per-token ``dense`` ``[N, L]`` (process order), ``width`` columns."""
    if self.procs == 1:
      return dense
    most = int(sharding.allgather_scalar(dense.shape[1]).max())
    padded = np.zeros((dense.shape[0], max(most, width)), dense.dtype)
    padded[:, :dense.shape[1]] = dense
    return sharding.allgather_rows({"d": padded})[0]["d"][:, :width]

  def _loss_width(self, pb: PackedBatch, row_len: int) -> int:
    """The loss-column width ``K`` of ``row_len``-token rows (:func:`with_loss_columns`), the same on every process.

    A row's loss tokens are its responses' tokens. A sequence of ``P + n − 1`` positions scores its ``n ≤ C``
    response tokens (``C``: the largest ``max_new_tokens``), so with ``p`` the shortest training prompt a row of
    ``k`` sequences holds at most ``min(k·C, row_len − k·(p − 1))`` of them. The largest over ``k``, rounded up to
    a multiple of 8, is the width: fixed between steps (no recompiles). A row over it (a source whose prompts or
    responses break those bounds) widens it for the rest of the run (:func:`loss_column_capacity` of the largest
    count over processes)."""
    width = self._loss_widths.get(row_len)
    if width is None:
      shortest = min((len(x) for x in self.train_prompts.ids), default=1)
      most = self.cfg.rollout.max_max_new_tokens
      bound = max(min(k * most, row_len - k * (shortest - 1)) for k in range(1, row_len + 1))
      width = min(row_len, -(-bound // 8) * 8)
      width = self._loss_widths[row_len] = int(sharding.allgather_scalar(width).max())
    most = int((pb.arrays["loss_mask"] > 0).sum(-1).max(initial=0))
    most = int(sharding.allgather_scalar(most).max())
    if most > width:
      width = self._loss_widths[row_len] = loss_column_capacity(most, row_len)
    return width

  def pack(self, rollout: Rollout, step: int, *,
           process_rewards: np.ndarray | None = None) -> tuple[list[PackedBatch], dict[str, float]]:
    """Advantages, masks and this process's packed mini-batches of one step.

    Advantages and masks are computed over every process's samples (gathered scalars), the groups are
    split into mini-batches globally, and each process packs its own groups of each mini-batch into
    ``rows / processes`` rows per micro-batch; all processes pad to the same micro-batch count.

    Under ``reward.implicit_prm`` without a critic, ``coef`` × PRIME's process advantage of ``process_rewards``
    (:meth:`process_rewards`, computed here when not given; :func:`jaxrl.losses.prime_process_advantages`) is
    added to the estimator's outcome advantage (with a critic they enter GAE in :meth:`update`).
    """
    cfg, algo = self.cfg, self.cfg.algorithm
    row_len, rows = self.layout(step)
    groups = sharding.allgather_scalar(rollout.num_groups)
    samples = sharding.allgather_scalar(rollout.num_samples)
    g0, r0 = int(groups[:self.pid].sum()), int(samples[:self.pid].sum())
    everything = self.global_view(rollout)
    mask_all = loss_mask(everything, overlong_filter=cfg.rollout.overlong_filter)
    if self.cfg.distill is not None and self.cfg.distill.reward_coef == 0:  # pure distillation: the teacher's term
      adv_all, metrics = np.zeros_like(mask_all), {}
    elif self.critic is None:
      adv_all, metrics = compute_advantages(everything, name=algo.advantage, options=algo.advantage_kwargs)
      if self.cfg.distill is not None:
        adv_all = adv_all * np.float32(self.cfg.distill.reward_coef)
      if self.prm is not None:  # process_rewards: this process's rows; the advantage needs every process's
        if process_rewards is None:
          process_rewards, prm_metrics = self.process_rewards(rollout)
          metrics.update(prm_metrics)
        adv_all = adv_all + process_advantages(self._all_rows(process_rewards, everything.tokens.shape[1]),
                                               everything, coef=self.cfg.reward.implicit_prm.coef)
    else:  # GAE needs the critic's values of the packed batches: filled in by update() (Critic.fill)
      adv_all, metrics = np.zeros_like(mask_all), {}
    mine = slice(r0, r0 + rollout.num_samples)
    local = dataclasses.replace(rollout, group_ids=(rollout.group_ids + g0).astype(np.int32))
    remote = getattr(self.teacher, "remote", False)  # distill.server: the teacher's log-probs travel with the batch
    seqs = sequence_fields(local, adv_all[mine], mask_all[mine],
                           teacher_logprobs=self.teacher.logprobs(local) if remote else None)
    order = np.random.default_rng([cfg.seed, step]).permutation(int(groups.sum()))
    packed = []
    for chunk in np.array_split(order, algo.mini_batches):
      if not len(chunk):
        continue
      own = [g for g in chunk if g0 <= g < g0 + rollout.num_groups]
      idx = np.concatenate([np.flatnonzero(local.group_ids == g) for g in own]) if own else []
      pb = pack_sequences([seqs[i] for i in idx], row_len=row_len, rows=rows // self.procs,
                          bucket=cfg.micro_batch.bucket, vision=self.vision)
      pb = pad_micro_batches(pb, int(sharding.allgather_scalar(pb.shape[0]).max()))
      pb = agree_patch_bucket(pb, self.vision)  # one per-row patch bucket on every process
      if self.gather_loss_columns:  # the log-prob head on each row's loss tokens only
        width = self._loss_width(pb, row_len)
        if width < row_len:
          pb = with_loss_columns(pb, width)
      if remote and "teacher_logprobs" not in pb.arrays:  # no sample of this process in the mini-batch
        pb.arrays["teacher_logprobs"] = np.zeros_like(pb.arrays["loss_mask"])
      pb.arrays["mb_index"] = pb.arrays["mb_index"][..., None]
      packed.append(pb)
      if self.critic is not None:
        self.critic.note(pb, idx, local)
    tokens = sharding.allgather_rows({"t": np.asarray([p.tokens for p in packed], np.int64)})[0]["t"]
    tokens = tokens.reshape(self.procs, len(packed)).sum(0)  # [mini-batches] global real tokens
    metrics["advantage/abs_mean"] = float(np.abs(adv_all).sum() / max(mask_all.sum(), 1.0))
    if remote:
      metrics["distill/server_retries"] = float(self.teacher.retries)  # this process's, since the start
    metrics["train/micro_batches"] = float(np.mean([p.shape[0] for p in packed]))
    metrics["train/pack_efficiency"] = float(np.mean([t / (p.shape[0] * rows * row_len)
                                                      for t, p in zip(tokens, packed)]))
    metrics["train/tokens"] = float(tokens.sum() * algo.ppo_epochs)
    return packed, metrics

  def update(self, rollout: Rollout, step: int) -> dict[str, float]:
    """``ppo_epochs`` × mini-batches of updates on ``rollout``; returns the step's train metrics."""
    cfg, algo = self.cfg, self.cfg.algorithm
    if isinstance(self.sampler, sampling.Sampler):
      # Its weights are stale from here on and :meth:`_sampler_for` gives it new ones: freed now, the
      # sampler's own copy (on CPU the unstacked block weights, a model's worth of layers) is not live
      # next to the update's gradients and temporaries.
      self.sampler.release_weights()
    dense, prm_metrics = self.process_rewards(rollout) if self.prm is not None else (None, {})
    packed, metrics = self.pack(rollout, step, process_rewards=dense)
    metrics.update(prm_metrics)
    recompute = algo.old_logprobs == "recompute" and (len(packed) > 1 or algo.ppo_epochs > 1)
    batches = []
    for pb in packed:  # π_old and π_ref of every mini-batch at the rollout parameters, before any update
      batch = self._device(pb.interleaved())
      m = pb.shape[0]
      batch["old_logprobs"] = self._forward(self.state.params, batch, m) if recompute else batch["sampler_logprobs"]
      if recompute and self.teacher is not None:
        batch["student_logprobs"] = batch["old_logprobs"]  # the same program: reused by _distill
      if self.ref_params is not None:
        batch["ref_logprobs"] = self._forward(self.ref_params, batch, m)
      elif self.ref_logprob_fn is not None:  # LoRA: the base with adapters off
        batch["ref_logprobs"] = self._forward(self.state.params, batch, m, fn=self.ref_logprob_fn)
      batches.append(batch)
    if self.critic is not None:  # values → GAE advantages, returns and old values of every mini-batch
      dense = None if dense is None else self.cfg.reward.implicit_prm.coef * dense
      metrics.update(self.critic.fill(rollout, packed, batches, lambda a: self._device({"x": a})["x"],
                                      token_rewards=dense))
    if self.teacher is not None:
      metrics.update(self._distill(batches, packed))
    extra = (self.teacher.params,) if self._gkd else ()
    max_len = algo.aggregation_max_len or cfg.rollout.stage(step)[1]
    raw = []
    for epoch in range(algo.ppo_epochs):
      for k, (pb, batch) in enumerate(zip(packed, batches)):
        current_as_old = epoch == 0 and k == 0 and algo.old_logprobs == "recompute"
        step_fn = self._step_fn(pb.shape[0], max_len)
        self.state, out = step_fn(self.state, batch, *self.frozen, np.asarray(current_as_old), *extra)
        raw.append(out)
        if self.critic is not None:
          self.critic.train(batch, pb.shape[0], max_len)
    raw = sharding.to_host(raw)
    for out in raw:
      self.guard.observe(step, out["skipped"], out[train.NONFINITE_KEY], out["loss"])
    updates = [update_metrics(u) for u in raw]
    self.update_history.extend(dict(u, step=float(step)) for u in updates)
    metrics.update(step_metrics(updates))
    if self.critic is not None:
      metrics.update(self.critic.metrics())
    return metrics

  # ------------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, loop

  def eval_completions(self, step: int, *, temperature: float | None = None, samples: int | None = None):
    """``(prompt indices, SampleOutput, eval config)`` for the first ``eval.prompts`` held-out prompts;
    ``temperature`` / ``samples`` override the ``eval:`` section. ``None`` without held-out prompts."""
    ev = self.cfg.eval
    if self.heldout_prompts is None or not ev.prompts:
      return None
    if temperature is not None or samples is not None:
      ev = dataclasses.replace(ev, temperature=ev.temperature if temperature is None else temperature,
                               samples=ev.samples if samples is None else samples)
    idx = list(range(min(ev.prompts, len(self.heldout_prompts))))
    if self.procs > 1:  # an equal share per process: the last prompt repeats to fill the last share
      per = -(-len(idx) // self.procs)
      idx = (idx + idx[-1:] * (per * self.procs - len(idx)))[self.pid * per:(self.pid + 1) * per]
    prompts = self.heldout_prompts
    images = [prompts.images(i) for i in idx] if prompts.has_images else None  # a VLM's held-out images
    out = self._sampler_for(step).generate(
        [prompts.ids[i].tolist() for i in idx], n=ev.samples, max_new_tokens=self._eval_max_new(step),
        temperature=ev.temperature, top_p=self.cfg.rollout.top_p if ev.temperature else 1.0, seed=self.cfg.seed + 1,
        stop_strings=self.cfg.rollout.stop_strings, **({"images": images} if images else {}))
    return idx, out, ev

  def evaluate(self, step: int, *, temperature: float | None = None, samples: int | None = None,
               prefix: str = "eval") -> dict[str, float]:
    """:meth:`eval_completions` scored by the reward; metric names start with ``prefix`` (e.g. a
    greedy check next to a sampled pass@1). ``{prefix}/monitor/<key>``: the mean of each ``info["monitor"]``
    value over every process's samples that report it (the filler prompts of the last share left out)."""
    got = self.eval_completions(step, temperature=temperature, samples=samples)
    if got is None:
      return {}
    idx, out, ev = got
    scored = self._score(self.heldout_prompts, idx, ev.samples, out)
    rewards = scored.rewards.reshape(len(idx), ev.samples)
    lengths = out.lengths.reshape(len(idx), ev.samples)
    # jaxrl eval's per-problem metrics, computed where the answers are (only numbers cross processes)
    names = [f"avg@{ev.samples}"] + ([f"pass@{ev.samples}"] if ev.samples > 1 else [])
    names += [m for m in (rewards_lib.parse_metrics(ev.metrics, ev.samples) if ev.metrics else []) if m not in names]
    answers = [[info.get("extracted") for info in scored.infos[p * ev.samples:(p + 1) * ev.samples]]
               for p in range(len(idx))]
    per = np.asarray([[row[m] for m in names] for row in (
        rewards_lib.problem_metrics(c, a, names) for c, a in zip(rewards > self.cfg.reward.correct_threshold, answers))],
        np.float64).reshape(len(idx), len(names))  # [P, M]
    real = min(ev.prompts, len(self.heldout_prompts))
    first = self.pid * len(idx)  # this share's first prompt position; positions >= real are fillers
    metrics = monitor_metrics(scored.infos[:max(min(real - first, len(idx)), 0) * ev.samples], prefix)
    if self.procs > 1:  # every process's share, without the repeated filler prompts
      got, _ = sharding.allgather_rows({"r": rewards, "l": lengths, "m": per})
      rewards, lengths, per = got["r"][:real], got["l"][:real], got["m"][:real]
    metrics |= {f"{prefix}/reward_mean": float(rewards.mean()), f"{prefix}/length_mean": float(lengths.mean())}
    metrics.update({f"{prefix}/{m}": float(per[:, j].mean()) for j, m in enumerate(names)})
    metrics[f"{prefix}/accuracy"] = metrics.pop(f"{prefix}/avg@{ev.samples}")  # avg@n: the share of correct samples
    return metrics

  def save(self, step: int, *, force: bool = False) -> None:
    """Checkpoints ``step`` (parameters, optimizer, critic, prompt stream, guards) when checkpointing is on; the
    checkpointer's cadence decides unless ``force``."""
    if self.checkpointer is not None:
      self.checkpointer.save(step, _critic.checkpoint_state(self.state, self.critic),
                             {"prompts": self.stream.get_state(), "step": step, "guards": self.guard.state()},
                             force=force)

  def _restore(self, step: int | None = None) -> int:
    got, state, host = self.checkpointer.restore(_critic.checkpoint_state(self.state, self.critic), step)
    self.state = _critic.restore_state(state, self.critic)  # the critic's state is set in place
    self.stream.set_state(host["prompts"])
    self.guard.set_state(host.get("guards"))
    return got

  def resume(self) -> int:
    """The step to start from: the latest checkpoint's (restored) under ``checkpoint.resume: auto``, else 0."""
    return self._restore() if train.resumable(self.checkpointer, self.cfg.checkpoint.resume) else 0

  def _begin_stage(self, step: int, logger: train.MetricsLogger) -> None:
    """Iterative context lengthening: the new stage restarts from the checkpoint of ``step - 1``."""
    if self.checkpointer.latest_step() != step - 1:
      self.save(step - 1, force=True)
    self.checkpointer.wait()
    self._restore(step - 1)
    idx, max_new, n = self.cfg.rollout.stage(step)
    self._stage = idx
    logger.note(f"stage {idx}: step {step}, max_new_tokens={max_new}, n={n} (from checkpoint {step - 1})")

  def run(self, *, until: int | None = None) -> dict[str, Any]:
    """Trains to ``cfg.steps`` (or stops after step ``until``, as a pre-emption would)."""
    cfg = self.cfg
    start_step = self.resume()
    self._stage = cfg.rollout.stage(max(start_step, 1))[0]
    logger = train.process_logger(self.out_dir, self.pid, total_steps=cfg.steps, desc="rl",
                                  show=("reward/mean", "accuracy", "eval/accuracy", "response/length_mean",
                                        "tok_s/rollout", "tok_s/train"),
                                  tensorboard=cfg.tensorboard)
    results: dict[str, Any] = {"start_step": start_step}
    eval_every = cfg.eval.every
    if start_step == 0 and eval_every:
      results["eval_before"] = self.evaluate(1)
      logger.log(0, results["eval_before"])
    last = cfg.steps if until is None else min(until, cfg.steps)
    self.guard.log = logger.note
    preempt = self.preemption.install()  # SIGTERM/SIGINT: checkpoint after the current step, then Preempted
    for step in range(start_step + 1, last + 1):
      if cfg.rollout.stage(step)[0] != self._stage:
        self._begin_stage(step, logger)
      sharding.barrier("rl-step")
      t0 = time.perf_counter()
      rollout, metrics = self.collect(step)
      self.last_rollout = rollout
      if rollout is None:
        logger.note(f"step {step}: no informative group after {metrics.get('dynamic/rounds', 1):.0f} rounds; "
                    "no update")
      else:
        sharding.barrier("rl-update")
        t1 = time.perf_counter()
        metrics.update(self.update(rollout, step))
        metrics["time_train"] = time.perf_counter() - t1
        metrics["tok_s/train"] = metrics["train/tokens"] / max(metrics["time_train"], 1e-9)
      metrics["time_step"] = time.perf_counter() - t0
      signum = self.end_step(step, last, metrics, logger=logger, results=results)
      if signum is not None:
        self.stop(signum, step, logger)
    preempt.uninstall()
    if self.checkpointer is not None:
      self.checkpointer.close()
    train.eval_if_resumed_at_end(results, start_step=start_step, last=last, total_steps=cfg.steps,
                                 eval_every=eval_every, evaluate=lambda: self.evaluate(last))
    return self.finish(results, logger, last, title="rl", skip_report=True)

  def end_step(self, step: int, last: int, metrics: dict[str, float], *, logger: train.MetricsLogger,
               results: dict[str, Any]) -> int | None:
    """The step-loop tail: evaluation cadence, history row, progress line, then this step's checkpoint (forced
    at ``last`` or on a pre-emption signal). Returns the pre-emption signal that asks the run to stop, or None."""
    if self.cfg.log_samples and self.pid == 0 and self.last_rollout is not None:
      rows = sample_records(self.last_rollout, self.tokenizer, step=step, limit=self.cfg.log_samples)
      with open(self.out_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    train.finish_step(step, metrics, logger=logger, history=self.history, results=results, evaluate=self.evaluate,
                      eval_every=self.cfg.eval.every, total_steps=self.cfg.steps)
    signum = self.preemption.requested()  # once per step, collective: every process gets the same answer
    self.save(step, force=step == last or signum is not None)
    return signum

  def finish(self, results: dict[str, Any], logger: train.MetricsLogger, last: int, *, title: str,
             skip_report: bool = False) -> dict[str, Any]:
    """The end of a run: closes the logger (its plot), records the run's summary in ``results`` (with
    ``skip_report`` the over-long prompts too), exports to Hugging Face format when the run reached
    ``cfg.steps`` under ``export_hf``, and writes ``results.json``."""
    cfg = self.cfg
    plot = logger.close(title=title)
    if skip_report:
      skips = self.train_prompts.skip_report()  # over-long prompts (docs/reliability.md)
      skips.print(logger.console)
      results["skips"] = skips.as_dict()
    results.update(steps=last, plot=str(plot) if plot else None, skipped=int(self.state.skipped),
                   rewards=[h.get("reward/mean") for h in self.history],  # None: a step of GKD's fixed completions
                   accuracy=[h.get("accuracy") for h in self.history])
    if last == cfg.steps and cfg.export_hf:
      model = self.current_model()
      lora = cfg.lora is not None
      train.export_hf(results, out_dir=self.out_dir, model=models.merged_base(model) if lora else model,
                      adapter=model if lora else None, tokenizer=self.tokenizer)
    train.write_results(results, self.out_dir, pid=self.pid)
    return results

  def set_train_prompts(self, records: list[dict[str, Any]]) -> None:
    """Trains on ``records`` from now on (prompt records as in ``data.train``; e.g. prompts built from
    another policy's outputs, as Rubric-ARM does); the shuffled prompt stream restarts over them."""
    self.train_prompts = EncodedPrompts(records, self.tokenizer, max_tokens=self.cfg.data.max_prompt_tokens)
    self.stream = PromptStream(len(self.train_prompts), seed=self.cfg.data.shuffle_seed)

  def set_reward(self, fn) -> None:
    """Scores with ``fn`` (a callable, e.g. one closing over another model) instead of ``reward.fn``;
    ``reward.kwargs`` and ``reward.runner`` still apply (use ``executor: thread`` for a closure)."""
    self.rewards.close()
    self.rewards = RewardRunner(fn, config=self.cfg.reward.runner, reward_kwargs=self.cfg.reward.kwargs)

  def stop(self, signum: int, step: int, logger: train.MetricsLogger) -> None:
    """Pre-emption: the checkpoint of ``step`` commits, then :class:`jaxrl.train.Preempted` is raised."""
    self.preemption.uninstall()
    train.stop_preempted(signum, step, checkpointer=self.checkpointer, logger=logger, title="rl")

  def close(self) -> None:
    self.preemption.uninstall()  # a run that raised leaves the handlers installed until here
    self.rewards.close()
    rewards_lib.close_judges()  # judge servers this process launched (`judge.launch`)
    if isinstance(self.teacher, ServerTeacher):
      self.teacher.close()


def _on_mesh(tree, mesh):
  """Every leaf on ``mesh``: sharded leaves keep their sharding, the rest (step counters, optimizer
  scalars) are replicated, so a restored checkpoint lands on the same devices as the parameters."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  place = lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated
  return jax.device_put(tree, jax.tree.map(place, tree))
