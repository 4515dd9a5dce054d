"""Coconut training: the stage curriculum, its ablations and baselines, and latent-mode evaluation.

``method`` picks what the thought slots hold and how the curriculum runs (Hao et al. 2024, §5.1):

=================  ========  ===================  =======================================
method             markers   slots                stages
=================  ========  ===================  =======================================
coconut            yes       continuous thoughts  0, 1, ..., K (K = ``max_stage``)
no_curriculum      yes       continuous thoughts  K only (w/o curriculum)
no_thought         yes       none (0 slots)       0, 1, ..., K (w/o thought)
pause_as_thought   yes       ``<pause>`` tokens   0, 1, ..., K
cot                no        none                 0 only (full language chain)
no_cot             no        none                 all steps removed (question → answer)
=================  ========  ===================  =======================================

Stages ``0 .. K-1`` run ``stage_steps`` optimizer steps each and stage ``K`` the rest of ``steps``;
the optimizer state (Adam moments and the learning-rate schedule's step) is reset at every stage
switch; the schedule's horizon is the longest stage. Every stage uses one column layout (the widest),
so the train step is compiled once; with ``pack_length`` rows are packed (several examples per row) and
each stage gets its own packed layout (one compile per stage). ``eot_head > 0`` trains the ``<eot>``
classifier head jointly. Evaluation decodes greedily with ``c·K`` thoughts (pause tokens for
``pause_as_thought``), or, with ``eval.stop: classifier``, until the head fires.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models, sharding, train
from jaxrl.latent._data import (
    Chain,
    Layout,
    LatentTokens,
    PackedLayout,
    ThoughtKind,
    arithmetic_chains,
    latent_tokens,
    make_rows,
    pack_rows,
    padding_fraction,
    prompt_ids,
    read_chains,
    stage_example,
)
from jaxrl.latent._decode import latent_generate
from jaxrl.latent._eot import eot_logits, eot_loss, init_eot_head
from jaxrl.latent._forward import latent_hidden, packed_latent_hidden
from jaxrl.latent._prosqa import ProsQAConfig, prosqa_chains
from jaxrl.models import ModelSource
from jaxrl import config as config_lib

Method = Literal["coconut", "cot", "no_cot", "no_curriculum", "no_thought", "pause_as_thought"]
METHODS: dict[str, tuple[bool, ThoughtKind]] = {
    "coconut": (True, "latent"), "no_curriculum": (True, "latent"), "no_thought": (True, "none"),
    "pause_as_thought": (True, "pause"), "cot": (False, "none"), "no_cot": (False, "none")}
"""``method -> (markers, slot kind)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentData(data_lib.TaskData):
  """Where chains come from: JSONL files of {question, steps, answer} records (``heldout`` for accuracy); the
  built-in arithmetic task's steps are the reasoning steps."""

  prosqa: ProsQAConfig | None = None
  "The generated ProsQA-style graph-reachability task; used instead of `builtin` when set (and `train` is empty)."


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentEval:
  every: int = 0
  "Steps between held-out evaluations (0: only before and after training)."
  n: int = 64
  "Held-out chains decoded greedily for accuracy."
  max_new_tokens: int = 32
  stop: Literal["fixed", "classifier"] = "fixed"
  "How latent decoding ends thinking: after c·K thoughts, or when the <eot> head fires (needs eot_head > 0)."
  max_thoughts: int = 0
  "Most thoughts with stop=classifier (0: c·K)."
  before: bool = True
  "Also evaluate before training (results eval_before; false skips it and its decode compile)."
  benchmarks: tuple[config_lib.Benchmark, ...] = ()
  "Benchmarks ``jaxrl eval --config`` runs (:class:`jaxrl.config.Benchmark`; docs/eval.md); training ignores them."

  def __post_init__(self):
    if self.stop not in ("fixed", "classifier"):
      raise ValueError(f"eval.stop must be 'fixed' or 'classifier', got {self.stop!r}")
    if self.max_thoughts < 0 or self.n < 0 or self.max_new_tokens < 1:
      raise ValueError(f"eval: max_thoughts >= 0, n >= 0, max_new_tokens >= 1; got {self.max_thoughts}, {self.n}, "
                       f"{self.max_new_tokens}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoconutConfig:
  model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(preset="tiny"))
  tokenizer: str | None = None
  "Tokenizer dir; default the model's hf_dir, else the built-in tiny tokenizer."
  data: LatentData = dataclasses.field(default_factory=LatentData)
  method: Method = "coconut"
  "coconut, or an ablation/baseline: no_curriculum, no_thought, pause_as_thought, cot, no_cot."
  c: int = 1
  "Continuous thoughts per replaced reasoning step."
  max_stage: int = 2
  "Last curriculum stage K (stage k replaces the first k steps)."
  pad_thoughts: bool = False
  "Give every example k·c slots at stage k, even chains with fewer than k steps (matches the fixed count at decoding)."
  stage_steps: int = 100
  "Optimizer steps at each stage 0..K-1; the last stage gets the rest of `steps`."
  steps: int = 400
  "Total optimizer steps."
  batch_size: int = 32
  "Rows per step (one example per row unless `pack_length` packs several)."
  pack_length: int = 0
  "Columns per packed row (several examples per row, each its own segment); 0: one example per row."
  eot_head: float = 0.0
  "Loss weight of the <eot> classifier head trained jointly on <bot> and the thoughts (0: no head)."
  optim: train.OptimConfig = dataclasses.field(default_factory=train.OptimConfig)
  chunk_size: int = 256
  "Tokens per chunk of the log-prob computation."
  eval: LatentEval = dataclasses.field(default_factory=LatentEval)
  mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
  seed: int = 0
  "Seed of the batch draws."
  out_dir: str = "runs/coconut"
  log_every: int = 10
  tensorboard: bool = False

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {sorted(METHODS)}, got {self.method!r}")
    if self.c < 1:
      raise ValueError(f"c must be >= 1, got {self.c!r}")
    if self.max_stage < 1:
      raise ValueError(f"max_stage must be >= 1, got {self.max_stage!r}")
    if self.stage_steps < 1 or self.steps < 1 or self.batch_size < 1:
      raise ValueError(f"stage_steps, steps and batch_size must be >= 1, got {self.stage_steps}, {self.steps}, "
                       f"{self.batch_size}")
    if self.curriculum and self.steps <= self.max_stage * self.stage_steps:
      raise ValueError(f"steps={self.steps} must exceed max_stage × stage_steps = "
                       f"{self.max_stage * self.stage_steps} (the last stage needs steps)")
    if not self.data.train and self.data.builtin is None and self.data.prosqa is None:
      raise ValueError("data: give data.train files, data.builtin or data.prosqa")
    if self.pack_length < 0 or self.eot_head < 0:
      raise ValueError(f"pack_length and eot_head must be >= 0, got {self.pack_length}, {self.eot_head}")
    if self.eot_head and METHODS[self.method][1] != "latent":
      raise ValueError(f"eot_head={self.eot_head} needs continuous thoughts (method coconut or no_curriculum), "
                       f"got method={self.method!r}")
    if self.eval.stop == "classifier" and not self.eot_head:
      raise ValueError("eval.stop=classifier needs the <eot> head: set eot_head > 0")

  @property
  def curriculum(self) -> bool:
    return self.method in ("coconut", "no_thought", "pause_as_thought")

  @property
  def eval_thoughts(self) -> int:
    """Thought slots at decoding: ``c·K`` (none for the methods without slots)."""
    return 0 if METHODS[self.method][1] == "none" else self.c * self.max_stage


def stage_schedule(cfg: CoconutConfig, max_steps_in_data: int) -> list[tuple[int, int]]:
  """``[(stage, steps), ...]`` in training order."""
  if cfg.curriculum:
    return [(k, cfg.stage_steps) for k in range(cfg.max_stage)] + [
        (cfg.max_stage, cfg.steps - cfg.max_stage * cfg.stage_steps)]
  if cfg.method == "cot":
    return [(0, cfg.steps)]
  if cfg.method == "no_cot":
    return [(max(max_steps_in_data, cfg.max_stage), cfg.steps)]
  return [(cfg.max_stage, cfg.steps)]


def latent_loss_fn(graphdef, layout: Layout | PackedLayout, *, chunk_size: int = 256, eot_weight: float = 0.0):
  """``loss(params, batch) -> (Σ w·nll + eot_weight · Σ w_eot·bce, metrics)``; ``batch`` via :func:`token_mean_prepare`.

  Column-aligned rows (a :class:`Layout`) go through :func:`latent_hidden`, packed rows (a
  :class:`PackedLayout`) through :func:`packed_latent_hidden`. With ``eot_weight > 0`` ``params`` is
  ``{"model": model state, "eot_head": head}`` and the ``<eot>`` head's cross-entropy is added.
  """
  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params["model"] if eot_weight else params)
    if isinstance(layout, PackedLayout):
      hidden = packed_latent_hidden(model, batch, thoughts=layout.thoughts, examples=layout.examples)
    else:
      hidden = latent_hidden(model, batch["tokens"], batch["positions"], batch["segment_ids"], batch["thought_mask"],
                             prefix=layout.prefix, thoughts=layout.thoughts)  # [B, T, D]
    nll = -losses.token_logprobs(hidden, model.unembed_matrix(), batch["targets"], chunk_size=chunk_size)
    mask = batch["loss_mask"]
    loss = jnp.sum(batch["weights"] * nll)
    metrics = {"nll_sum": jnp.sum(mask * nll), "loss_tokens": jnp.sum(mask)}
    if eot_weight:
      bce = eot_loss(eot_logits(params["eot_head"], hidden), batch["eot_label"], batch["eot_weights"])
      loss = loss + eot_weight * bce
      metrics["eot_bce"] = bce
    return loss, metrics
  return loss_fn


def token_mean_prepare(batch):
  """``weights = loss_mask / Σ loss_mask`` over the global batch (the per-token mean), and likewise
  ``eot_weights`` from ``eot_mask`` (the ``<eot>`` head's mean over its decision columns)."""
  out = dict(batch, weights=batch["loss_mask"] / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0))
  if "eot_mask" in batch:
    out["eot_weights"] = batch["eot_mask"] / jnp.maximum(jnp.sum(batch["eot_mask"]), 1.0)
  return out


def load_chains(cfg: CoconutConfig) -> tuple[list[Chain], list[Chain]]:
  """Train and held-out chains from files or the built-in task."""
  if cfg.data.train:
    train_chains = [c for p in cfg.data.train for c in read_chains(p)]
    heldout = [c for p in cfg.data.heldout for c in read_chains(p)]
    return train_chains, heldout
  if cfg.data.prosqa is not None:
    return prosqa_chains(cfg.data.prosqa, "train"), prosqa_chains(cfg.data.prosqa, "heldout")
  b = cfg.data.builtin
  heldout = arithmetic_chains(b.n_heldout, seed=b.seed, split="heldout", difficulty=b.difficulty,
                              unique=True) if b.n_heldout else []
  return arithmetic_chains(b.n_train, seed=b.seed, difficulty=b.difficulty), heldout


class CoconutTrainer:
  """Builds the model, tokens and chains once; :meth:`run` trains every stage and evaluates."""

  def __init__(self, cfg: CoconutConfig):
    self.cfg = cfg
    self.out_dir = Path(cfg.out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    (self.out_dir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    self.mesh = cfg.mesh.build()
    self.rules = cfg.mesh.logical_rules()
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if cfg.batch_size % dp:
      raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the data-parallel devices ({dp})")
    self.tokenizer = models.load_tokenizer(data_lib.tokenizer_dir(cfg.tokenizer, cfg.model.hf_dir))
    self.model = cfg.model.build(mesh=self.mesh, rules=self.rules)
    self.tokens: LatentTokens = latent_tokens(self.tokenizer, self.model.cfg.vocab_size)
    self.train_chains, self.heldout_chains = load_chains(cfg)
    self.graphdef, self.params = nnx.split(self.model)
    self.eot_head = init_eot_head(self.model.cfg.hidden_size) if cfg.eot_head else None
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.markers, self.kind = METHODS[cfg.method]

  def examples(self, chains, stage: int):
    return [stage_example(ch, stage, c=self.cfg.c, tokenizer=self.tokenizer, tokens=self.tokens,
                          markers=self.markers, kind=self.kind, pad_thoughts=self.cfg.pad_thoughts) for ch in chains]

  def current_model(self):
    return nnx.merge(self.graphdef, self.params)

  def trainable(self):
    """The optimised pytree: the model state, with the ``<eot>`` head when it is trained."""
    return {"model": self.params, "eot_head": self.eot_head} if self.eot_head is not None else self.params

  def set_trainable(self, params) -> None:
    if self.eot_head is not None:
      self.params, self.eot_head = params["model"], params["eot_head"]
    else:
      self.params = params

  def layouts(self, stage_examples: dict[int, list]) -> dict[int, Layout | PackedLayout]:
    """One column-aligned layout for every stage (one compile), or a packed layout per stage."""
    if self.cfg.pack_length:
      return {stage: PackedLayout.fit(ex, self.cfg.pack_length) for stage, ex in stage_examples.items()}
    shared = Layout.fit(e for ex in stage_examples.values() for e in ex)
    return {stage: shared for stage in stage_examples}

  def make_step(self, layout: Layout | PackedLayout, optimizer):
    loss_fn = latent_loss_fn(self.graphdef, layout, chunk_size=self.cfg.chunk_size, eot_weight=self.cfg.eot_head)
    return train.make_train_step(loss_fn, optimizer, mesh=self.mesh, prepare=token_mean_prepare)

  def draw_rows(self, rng: np.random.Generator, examples: list, layout: Layout | PackedLayout) -> dict[str, np.ndarray]:
    """One step's ``batch_size`` rows: random examples, aligned one per row or packed in draw order."""
    b = self.cfg.batch_size
    if isinstance(layout, Layout):
      return make_rows([examples[i] for i in rng.integers(0, len(examples), size=b)], layout, self.tokens)
    # Enough draws to fill every row; the packer takes them in order and stops when the rows are full.
    per_row = max(1, layout.examples)
    rows, _ = pack_rows([examples[i] for i in rng.integers(0, len(examples), size=b * per_row)], layout,
                        self.tokens, num_rows=b)
    return rows

  def evaluate(self, n: int | None = None) -> dict[str, float]:
    """Held-out accuracy (greedy, ``c·K`` thoughts or the head's choice) and generated tokens per answer."""
    chains = self.heldout_chains[:self.cfg.eval.n if n is None else n]
    if not chains:
      return {}
    head = self.eot_head if self.cfg.eval.stop == "classifier" else None
    thoughts = self.cfg.eval_thoughts if head is None else (self.cfg.eval.max_thoughts or self.cfg.eval_thoughts)
    return evaluate_chains(self.current_model(), self.tokenizer, self.tokens, chains, markers=self.markers,
                           kind=self.kind, thoughts=thoughts, max_new_tokens=self.cfg.eval.max_new_tokens,
                           eot_head=head)

  def run(self) -> dict[str, Any]:
    cfg = self.cfg
    rng = np.random.default_rng(cfg.seed)
    max_steps = max(len(c.steps) for c in self.train_chains)
    schedule = stage_schedule(cfg, max_steps)
    logger = train.MetricsLogger(self.out_dir, total_steps=cfg.steps, desc=f"latent/{cfg.method}",
                                 show=("loss", "stage", "accuracy"), tensorboard=cfg.tensorboard)
    results: dict[str, Any] = {"method": cfg.method, "schedule": schedule,
                               "eval_before": self.evaluate() if cfg.eval.before else {}}
    global_step, stage_log = 0, []
    stage_examples = {stage: self.examples(self.train_chains, stage) for stage, _ in schedule}
    # Unpacked: one layout (so one compiled step) for every stage; rows of early stages have their prompt
    # run into the unused thought columns. Packed: a layout per stage. The optimizer is built once and
    # its state re-initialised per stage.
    layouts = self.layouts(stage_examples)
    optimizer = train.make_optimizer(cfg.optim, max(n for _, n in schedule))
    steps = {}
    t0 = time.perf_counter()
    for stage, n_steps in schedule:
      examples, layout = stage_examples[stage], layouts[stage]
      if layout not in steps:
        steps[layout] = self.make_step(layout, optimizer)
      step_fn = steps[layout]
      state = train.place_on_mesh(train.init_train_state(self.trainable(), optimizer), self.mesh)  # optimizer reset
      padding, examples_seen = [], 0
      for _ in range(n_steps):
        rows = self.draw_rows(rng, examples, layout)
        padding.append(padding_fraction(rows))
        examples_seen += int(sum(len(set(r[r > 0].tolist())) for r in rows["segment_ids"]))
        batch = {k: sharding.global_batch(v, self.batch_sharding) for k, v in rows.items()}
        state, metrics = step_fn(state, batch)
        global_step += 1
        if global_step % cfg.log_every == 0 or global_step == cfg.steps:
          m = jax.device_get(metrics)
          line = {"loss": float(m["nll_sum"]) / max(float(m["loss_tokens"]), 1.0),
                  "grad_norm": float(m["grad_norm"]), "stage": float(stage)}
          if "eot_bce" in m:
            line["eot_bce"] = float(m["eot_bce"])
          logger.log(global_step, line)
        if cfg.eval.every and global_step % cfg.eval.every == 0:
          self.set_trainable(state.params)
          logger.log(global_step, self.evaluate())
      self.set_trainable(state.params)
      stage_log.append({"stage": stage, "steps": n_steps, "layout": dataclasses.asdict(layout),
                        "layout_kind": type(layout).__name__, "padding": float(np.mean(padding)),
                        "examples_per_step": examples_seen / n_steps})
    results.update(stages=stage_log, train_seconds=time.perf_counter() - t0, eval_after=self.evaluate())
    logger.log(cfg.steps, results["eval_after"])
    logger.close(title=f"latent/{cfg.method}")
    train.write_results(results, self.out_dir)  # one process: written unconditionally, as before
    return results


_WORD_ANSWER = re.compile(r"Answer:\s*([^\s.<]+)")


def answer_match(completion: str, answer: str) -> bool:
  """Exact match of the answer after the last ``Answer:`` (integers as the built-in task reads them,
  any other answer as the word that follows, e.g. a ProsQA concept)."""
  if re.fullmatch(r"-?\d+", answer.strip()):
    return data_lib.exact_match(completion, answer)
  found = _WORD_ANSWER.findall(completion)
  return bool(found) and found[-1] == answer.strip()


def evaluate_chains(model, tokenizer, tokens: LatentTokens, chains: list[Chain], *, markers: bool,
                    kind: ThoughtKind, thoughts: int, max_new_tokens: int, batch_size: int = 64,
                    eot_head=None) -> dict[str, float]:
  """Greedy accuracy, mean generated language tokens per answer (end-of-turn included) and mean thoughts.

  ``eot_head``: stop thinking when the ``<eot>`` head fires (at most ``thoughts``); None: ``thoughts``.
  """
  hits, lengths, n_thoughts = [], [], []
  for i in range(0, len(chains), batch_size):
    part = chains[i:i + batch_size]
    prompts = []
    for ch in part:
      ids, n = prompt_ids(tokenizer, ch.question, tokens, markers=markers, kind=kind, n_thoughts=thoughts)
      prompts.append(np.concatenate([ids, np.full(n, tokens.pause, np.int32)]) if kind == "pause" else ids)
    out = latent_generate(model, prompts, thoughts=thoughts if kind == "latent" else 0,
                          eot=tokens.eot if markers else None, eos=tokens.eos, pad=tokens.pad,
                          max_new_tokens=max_new_tokens, eot_head=eot_head if kind == "latent" else None)
    for ch, row, n_gen, n_th in zip(part, out.tokens, out.lengths, out.n_thoughts):
      text = tokenizer.decode(row[:n_gen].tolist(), skip_special_tokens=False)
      hits.append(answer_match(text, ch.answer))
      lengths.append(int(n_gen))
      n_thoughts.append(int(n_th))
  return {"accuracy": float(np.mean(hits)), "tokens_per_answer": float(np.mean(lengths)),
          "thoughts_per_answer": float(np.mean(n_thoughts))}


def main(cfg: CoconutConfig) -> dict[str, Any]:
  """``jaxrl latent``: train, evaluate, print a summary line."""
  results = CoconutTrainer(cfg).run()
  before, after = results["eval_before"], results["eval_after"]
  print(f"latent/{cfg.method}: accuracy {before.get('accuracy', float('nan')):.3f} -> "
        f"{after.get('accuracy', float('nan')):.3f}, tokens/answer {after.get('tokens_per_answer', float('nan')):.1f}, "
        f"results in {cfg.out_dir}/results.json")
  return results
