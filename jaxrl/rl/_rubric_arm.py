"""Rubric-ARM: alternating GRPO of a rubric generator and a judge on preference pairs.

``shared/seeds/004`` (Rubric-ARM, Stage II): two policies, each an ordinary `RLTrainer`, take turns;
while one trains the other is frozen.

* **Judge phase** (first in every round, as in the notes: the judge is stabilised before the generator
  explores): the frozen generator writes one rubric per preference pair drawn for the phase (cached for
  the phase), each pair is shown in a random order, and the judge trainer runs ``judge.steps`` GRPO steps
  on those judge prompts with `rubric_arm_judge_reward` (``R_acc + w_fmt · R_fmt``).
* **Generator phase**: the generator trainer runs ``generator.steps`` GRPO steps on rubric prompts with
  `rubric_arm_generator_reward`, whose ``judge_fn`` closes over the frozen judge's sampler (the judge
  trainer's current parameters; the judge prompt is encoded exactly as in the judge's own phase). The
  judge calls are batched: every generated chunk's judge prompts (both orders of every rubric) go to the
  frozen judge in one ``generate`` call (the trainer's ``reward_prefetch`` hook) before the per-sample
  rewards read their verdicts (``judge_generate_calls`` counts the calls).

Pairs are JSONL records ``{"prompt", "chosen", "rejected"}`` (``prompt``: text), or, without files, the
built-in arithmetic task: ``chosen`` is the worked answer, ``rejected`` the same with a wrong result.
Both trainers log to ``out_dir/{judge,generator}/`` (``metrics.jsonl``, TensorBoard); ``phases.jsonl``
has one line per phase (role, steps, mean reward and accuracy of the phase), ``results.json`` all of it.

Stage I (``generator_sft`` / ``judge_sft``): an SFT warm-up of a role from JSONL with the repo's
`jaxrl.sft.SFTTrainer`, exported to ``out_dir/sft/ROLE/hf``, where that role's RL starts.

Not here: Rubric-ARM as a reward for a third policy, checkpoint/resume of the RL phases and several processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import train
from jaxrl.rewards import RUBRIC_ARM_JUDGE_TEMPLATE, rubric_arm_generator_reward, rubric_arm_judge_prompts
from jaxrl.rl._config import BuiltinPrompts, PromptData, RewardSection, RLConfig, RLEvalConfig
from jaxrl.rl._prompts import PromptStream, read_records
from jaxrl.rl._trainer import RLTrainer
from jaxrl.sft import SFTConfig, SFTTrainer

__all__ = ["PairData", "RubricARM", "RubricARMConfig", "arithmetic_pairs"]

JUDGE_REWARD = "jaxrl.rewards._rubric_arm:rubric_arm_judge_reward"
GENERATOR_REWARD = "jaxrl.rewards._rubric_arm:rubric_arm_generator_reward"
RUBRIC_TEMPLATE = "Write a short grading rubric (a list of criteria) for responses to this prompt:\n{question}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairData:
  """Preference pairs: JSONL ``{"prompt", "chosen", "rejected"}`` records, else the built-in task."""

  train: tuple[str, ...] = ()
  "JSONL files of pairs. Empty: `builtin`."
  builtin: data_lib.BuiltinTask | None = dataclasses.field(
      default_factory=lambda: data_lib.BuiltinTask(n_train=256, difficulty=0))
  "Arithmetic pairs (`arithmetic_pairs`), used when `train` is empty."

  def __post_init__(self):
    if not self.train and self.builtin is None:
      raise ValueError("pairs: give pairs.train files or pairs.builtin")


def arithmetic_pairs(task: data_lib.BuiltinTask, *, seed: int = 0) -> list[dict[str, str]]:
  """Pairs from the built-in arithmetic task: ``chosen`` is the worked answer (``8+6=14. Answer: 14``),
  ``rejected`` the same with the result replaced by a wrong one (``8+6=17. Answer: 17``)."""
  rng = np.random.default_rng(seed)
  pairs = []
  for rec in task.records("train"):
    question, chosen, answer = rec["messages"][0]["content"], rec["messages"][-1]["content"], str(rec["answer"])
    wrong = str(int(answer) + int(rng.choice([d for d in range(-9, 10) if d])))
    head, sep, _ = chosen.rpartition(f"Answer: {answer}")
    rejected = re.sub(rf"={re.escape(answer)}(?=\D|$)", f"={wrong}", head) + (f"Answer: {wrong}" if sep else "")
    if not sep or not data_lib.exact_match(chosen, answer) or data_lib.exact_match(rejected, answer):
      raise data_lib.DataError(f"arithmetic_pairs: cannot make a wrong answer from {chosen!r}")
    pairs.append({"prompt": question, "chosen": chosen, "rejected": rejected})
  return pairs


def _load_pairs(cfg: PairData, seed: int) -> list[dict[str, str]]:
  if not cfg.train:
    return arithmetic_pairs(cfg.builtin, seed=seed)
  pairs = read_records(cfg.train)
  for rec in pairs:
    for key in ("prompt", "chosen", "rejected"):
      if not isinstance(rec.get(key), str):
        raise data_lib.DataError(f"{rec.get('_where', 'pairs')}: a pair needs a text {key!r}")
  return pairs


def _role_default() -> RLConfig:
  return RLConfig(eval=RLEvalConfig(every=0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RubricARMConfig:
  """``jaxrl rubric-arm --config FILE``: Rubric-ARM's alternating RL (see the module docstring).

  ``generator`` and ``judge`` are full RL configs (model, rollout, algorithm, optim, micro_batch, mesh,
  ``data.max_prompt_tokens``) except that ``steps`` counts GRPO steps *per phase*, their prompts come
  from the pairs, their rewards are Rubric-ARM's (leave ``reward.fn``/``reward.kwargs`` unset) and
  held-out evaluation is off.
  """

  pairs: PairData = dataclasses.field(default_factory=PairData)
  generator: RLConfig = dataclasses.field(default_factory=_role_default)
  "The rubric generator π_r(rubric | prompt); its ``steps`` are GRPO steps per generator phase."
  judge: RLConfig = dataclasses.field(default_factory=_role_default)
  "The judge π_j(verdict | prompt, rubric, A, B); its ``steps`` are GRPO steps per judge phase."
  generator_sft: SFTConfig | None = None
  ("Stage I warm-up of the generator: an SFT run (``jaxrl sft``'s config: ``data.train`` JSONL, ``steps``, "
   "``optim``, ``packing`` ...) from ``generator.model`` before the alternation, exported to "
   "``out_dir/sft/generator/hf``, where the generator's RL then starts. ``model``/``out_dir`` are set here.")
  judge_sft: SFTConfig | None = None
  "Stage I warm-up of the judge (as ``generator_sft``; exported to ``out_dir/sft/judge/hf``)."
  rounds: int = 1
  "Alternations; each is a judge phase then a generator phase."
  rubric_template: str = RUBRIC_TEMPLATE
  "The generator's prompt, formatted with ``question`` (the pair's prompt)."
  judge_template: str = RUBRIC_ARM_JUDGE_TEMPLATE
  "The judge's prompt, formatted with ``rubric``, ``question``, ``a`` and ``b``."
  format_weight: float = 0.5
  "w_fmt in R_jud = R_acc + w_fmt · R_fmt (in [0, 1): a correct verdict always outranks format alone)."
  generator_orders: Literal["both", "chosen_first"] = "both"
  "How the frozen judge sees the pair when rewarding a rubric (both: mean over the two orders)."
  judge_temperature: float = 0.0
  "Sampling temperature of the frozen judge in the generator phase (0 = greedy)."
  rubric_temperature: float = 0.0
  "Sampling temperature of the frozen generator writing the judge phase's rubrics (0 = greedy)."
  out_dir: str = "runs/rubric_arm"
  seed: int = 0
  "Seed of the pair order, the A/B positions and the built-in pairs' wrong answers."
  tensorboard: bool = True

  def __post_init__(self):
    if self.rounds < 1:
      raise ValueError(f"rounds must be >= 1, got {self.rounds!r}")
    if not 0 <= self.format_weight < 1:
      raise ValueError(f"format_weight must be in [0, 1), got {self.format_weight!r}")
    if self.judge_temperature < 0 or self.rubric_temperature < 0:
      raise ValueError("judge_temperature and rubric_temperature must be >= 0")
    for key, fields in (("rubric_template", ("question",)), ("judge_template", ("rubric", "question", "a", "b"))):
      try:
        getattr(self, key).format(**{f: "" for f in fields})
      except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{key}: uses a field other than {{{', '.join(fields)}}}: {e!r}") from None
    default = RewardSection()
    for role in ("generator", "judge"):
      r = getattr(self, role).reward
      if r.fn != default.fn or r.kwargs:
        raise ValueError(f"{role}.reward.fn/kwargs: set by Rubric-ARM; leave them unset")
      if r.runner.executor != "thread":
        raise ValueError(f"{role}.reward.runner.executor: must be 'thread' (the rewards close over a model)")
      if getattr(self, role).checkpoint.every:
        raise ValueError(f"{role}.checkpoint.every: Rubric-ARM does not checkpoint or resume yet; set 0")
      sft = getattr(self, f"{role}_sft")
      if sft is not None:
        for key in ("model", "out_dir"):
          if getattr(sft, key) != getattr(SFTConfig(), key):
            raise ValueError(f"{role}_sft.{key}: set by Rubric-ARM (the role's model, out_dir/sft/{role}); "
                             "leave it unset")


def _role_config(cfg: RubricARMConfig, role: str) -> RLConfig:
  """The role's RLConfig for its trainer: every phase's steps in one schedule, Rubric-ARM's reward."""
  rc: RLConfig = getattr(cfg, role)
  if role == "judge":  # accuracy = R_acc: a correct verdict scores ≥ 1, a wrong one ≤ w_fmt
    reward = dataclasses.replace(rc.reward, fn=JUDGE_REWARD, kwargs={"format_weight": cfg.format_weight},
                                 correct_threshold=(1 + cfg.format_weight) / 2)
  else:  # accuracy = right in every order the judge saw
    reward = dataclasses.replace(rc.reward, fn=GENERATOR_REWARD, correct_threshold=0.75)
  data = PromptData(builtin=BuiltinPrompts(n_train=1, n_heldout=0), max_prompt_tokens=rc.data.max_prompt_tokens,
                    shuffle_seed=rc.data.shuffle_seed)  # placeholder prompts: replaced by the pairs' prompts
  return dataclasses.replace(rc, steps=rc.steps * cfg.rounds, reward=reward, data=data, eval=RLEvalConfig(every=0),
                             out_dir=str(Path(cfg.out_dir) / role), tensorboard=cfg.tensorboard)


class RubricARM:
  """Builds both trainers once; :meth:`run` alternates judge and generator phases.

  Attributes: ``generator`` and ``judge`` (the `RLTrainer` of each role), ``pairs`` (the pairs whose
  rubric prompt fits ``generator.data.max_prompt_tokens``), ``phases`` (one summary dict per phase).
  """

  def __init__(self, cfg: RubricARMConfig):
    import jax
    if jax.process_count() > 1:  # the frozen judge is called per sample, which is not a collective program
      raise ValueError("Rubric-ARM runs on one process (jax.process_count() is "
                       f"{jax.process_count()}); multi-process alternation is not built")
    self.cfg = cfg
    self.out_dir = Path(cfg.out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    (self.out_dir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    pairs = _load_pairs(cfg.pairs, cfg.seed)
    self.warmup: dict[str, dict[str, Any]] = {}
    "Each warmed-up role's SFT results (``hf_dir``, ``losses`` ...)."
    roles = {role: _role_config(cfg, role) for role in ("generator", "judge")}
    for role, rc in roles.items():
      if getattr(cfg, f"{role}_sft") is not None:
        roles[role] = dataclasses.replace(rc, model=self._warm_up(role, getattr(cfg, f"{role}_sft"), rc))
    self.generator = RLTrainer(roles["generator"])
    self.judge = RLTrainer(roles["judge"])
    self.generator.set_train_prompts([
        {"prompt": cfg.rubric_template.format(question=p["prompt"]), "question": p["prompt"], "chosen": p["chosen"],
         "rejected": p["rejected"]} for p in pairs])
    self.pairs = self.generator.train_prompts.records  # the ones that fit
    self.generator.set_reward(functools.partial(rubric_arm_generator_reward, judge_fn=self._judge_prefetched,
                                                template=cfg.judge_template, orders=cfg.generator_orders))
    # Every generated chunk's judge prompts go to the frozen judge in one batched generate call before the
    # per-sample rewards run; the rewards then read their verdicts from `_judged`.
    self.generator.reward_prefetch = self._prefetch_judgements
    self._judged: dict[str, list[str]] = {}
    self.judge_generate_calls = 0
    "Frozen-judge ``generate`` calls so far (one per generated chunk when prefetched)."
    self._pair_stream = PromptStream(len(self.pairs), seed=cfg.seed)
    self._judge_lock = threading.Lock()
    self._judge_sampler = None
    self._judge_calls = 0
    self.steps = {"generator": 0, "judge": 0}
    self.phases: list[dict[str, Any]] = []

  # ------------------------------------------------------------------------------------------------

  def _warm_up(self, role: str, sft: SFTConfig, rc: RLConfig):
    """Stage I: SFT of ``role`` from its configured model; returns the model source of the export. A
    finished warm-up (``out_dir/sft/ROLE/hf`` present) is reused, so a rerun does not train it again."""
    out = self.out_dir / "sft" / role
    if not (out / "hf" / "config.json").is_file():
      trainer = SFTTrainer(dataclasses.replace(sft, model=rc.model, tokenizer=sft.tokenizer or rc.tokenizer,
                                               out_dir=str(out), export_hf=True, tensorboard=self.cfg.tensorboard))
      self.warmup[role] = trainer.run()
    else:
      self.warmup[role] = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    print(f"rubric-arm: {role} warmed up by SFT ({out / 'hf'})", file=sys.stderr)
    return dataclasses.replace(rc.model, preset=None, hf_dir=str(out / "hf"))

  def frozen_judge(self, prompts: list[str]) -> list[str]:
    """The judge's completions of judge prompts with its parameters as of the current generator phase
    (one call at a time; a prompt over ``judge.data.max_prompt_tokens`` gets an empty completion)."""
    j = self.judge
    ids = [data_lib.encode_prompt(j.tokenizer, {"prompt": p}) for p in prompts]
    fits = [k for k, x in enumerate(ids) if len(x) <= j.cfg.data.max_prompt_tokens]
    out = [""] * len(prompts)
    if not fits:
      return out
    with self._judge_lock:
      if self._judge_sampler is None:
        raise RuntimeError("RubricARM.frozen_judge: called outside a generator phase")
      start, self._judge_calls = self._judge_calls, self._judge_calls + len(fits)
      self.judge_generate_calls += 1
      got = self._judge_sampler.generate(
          [ids[k].tolist() for k in fits], n=1, max_new_tokens=j.cfg.rollout.max_new_tokens,
          temperature=self.cfg.judge_temperature, top_p=j.cfg.rollout.top_p if self.cfg.judge_temperature else 1.0,
          seed=self.cfg.seed, request_ids=list(range(start, start + len(fits))),
          stop_strings=j.cfg.rollout.stop_strings)
    for k, text in zip(fits, got.texts):
      out[k] = text
    return out

  def _prefetch_judgements(self, texts: list[str], fields: list[dict[str, Any]]) -> None:
    """The frozen judge's completions of every judge prompt of a generated chunk, in one call, queued per
    prompt for the rewards (`_judge_prefetched`)."""
    prompts = [p for text, f in zip(texts, fields) for p in rubric_arm_judge_prompts(
        text, f["question"], f["chosen"], f["rejected"], template=self.cfg.judge_template,
        orders=self.cfg.generator_orders)[0]]
    outs = self.frozen_judge(prompts)
    with self._judge_lock:
      for p, o in zip(prompts, outs):
        self._judged.setdefault(p, []).append(o)

  def _judge_prefetched(self, prompts: list[str]) -> list[str]:
    """The generator reward's ``judge_fn``: prefetched completions (each used once), else a direct call."""
    with self._judge_lock:
      if all(len(self._judged.get(p, ())) >= prompts.count(p) for p in prompts):
        return [self._judged[p].pop(0) for p in prompts]
    return self.frozen_judge(prompts)

  def write_rubrics(self, idx: list[int], request_ids: list[int]) -> list[str]:
    """The frozen generator's rubrics for pairs ``idx`` (current parameters, ``rubric_temperature``)."""
    g = self.generator
    sampler = g._sampler_for(max(self.steps["generator"], 1))
    out = sampler.generate([g.train_prompts.ids[i].tolist() for i in idx], n=1,
                           max_new_tokens=g.cfg.rollout.max_new_tokens, temperature=self.cfg.rubric_temperature,
                           top_p=g.cfg.rollout.top_p if self.cfg.rubric_temperature else 1.0, seed=self.cfg.seed,
                           request_ids=request_ids, stop_strings=g.cfg.rollout.stop_strings)
    return list(out.texts)

  def judge_records(self, idx: list[int], rubrics: list[str], *, phase: int) -> list[dict[str, Any]]:
    """Judge prompts for pairs ``idx`` with their rubrics; ``label`` is where ``chosen`` is shown
    (A or B, drawn per pair from ``(seed, phase)``)."""
    rng = np.random.default_rng([self.cfg.seed, phase])
    records = []
    for i, rubric in zip(idx, rubrics):
      p = self.pairs[i]
      first = bool(rng.random() < 0.5)
      a, b = (p["chosen"], p["rejected"]) if first else (p["rejected"], p["chosen"])
      records.append({"prompt": self.cfg.judge_template.format(rubric=rubric, question=p["question"], a=a, b=b),
                      "label": "A" if first else "B"})
    return records

  def _train(self, role: str, logger: train.MetricsLogger) -> list[dict[str, float]]:
    trainer: RLTrainer = getattr(self, role)
    out = []
    for _ in range(trainer.cfg.steps // self.cfg.rounds):
      self.steps[role] += 1
      step = self.steps[role]
      t0 = time.perf_counter()
      rollout, metrics = trainer.collect(step)
      if rollout is not None:
        metrics.update(trainer.update(rollout, step))
      metrics["time_step"] = time.perf_counter() - t0
      trainer.history.append(dict(metrics, step=float(step)))
      logger.log(step, metrics)
      out.append(metrics)
    return out

  def judge_phase(self, phase: int, logger: train.MetricsLogger) -> list[dict[str, float]]:
    """Caches the frozen generator's rubrics for this phase's pairs, then trains the judge on them."""
    j = self.judge.cfg
    idx, rids = self._pair_stream.take(j.rollout.prompts_per_step * (j.steps // self.cfg.rounds))
    t0 = time.perf_counter()
    rubrics = self.write_rubrics(idx, rids)
    self.rubric_time = time.perf_counter() - t0
    self.last_rubrics = rubrics
    self.judge.set_train_prompts(self.judge_records(idx, rubrics, phase=phase))
    return self._train("judge", logger)

  def generator_phase(self, logger: train.MetricsLogger) -> list[dict[str, float]]:
    """Freezes the judge at its current parameters and trains the generator against it."""
    self._judge_sampler = self.judge._sampler_for(max(self.steps["judge"], 1))
    self._judged.clear()
    try:
      return self._train("generator", logger)
    finally:
      self._judge_sampler = None
      self._judged.clear()

  def run(self, *, after_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``rounds`` × (judge phase, generator phase); returns and writes the per-phase summaries
    (``after_phase(summary)`` is called after each phase, e.g. to inspect both trainers)."""
    cfg = self.cfg
    show = ("reward/mean", "accuracy", "response/length_mean")
    loggers = {role: train.MetricsLogger(self.out_dir / role, total_steps=getattr(self, role).cfg.steps, desc=role,
                                         show=show, tensorboard=cfg.tensorboard) for role in ("judge", "generator")}
    with open(self.out_dir / "phases.jsonl", "a", encoding="utf-8") as log:
      for rnd in range(1, cfg.rounds + 1):
        for role in ("judge", "generator"):
          phase = len(self.phases) + 1
          t0 = time.perf_counter()
          hist = (self.judge_phase(phase, loggers[role]) if role == "judge" else self.generator_phase(loggers[role]))
          summary = {"phase": phase, "round": rnd, "role": role, "steps": len(hist),
                     "last_step": self.steps[role], "time": time.perf_counter() - t0,
                     "reward_mean": float(np.mean([h["reward/mean"] for h in hist])),
                     "accuracy": float(np.mean([h["accuracy"] for h in hist])),
                     "rewards": [h["reward/mean"] for h in hist]}
          if role == "judge":
            summary["time_rubrics"] = self.rubric_time
          self.phases.append(summary)
          log.write(json.dumps(summary) + "\n")
          log.flush()
          if after_phase is not None:
            after_phase(summary)
          print(f"rubric-arm round {rnd} {role:9s} phase {phase}: reward {summary['reward_mean']:.3f} "
                f"accuracy {summary['accuracy']:.3f} ({len(hist)} steps, {summary['time']:.1f} s)", file=sys.stderr)
    for lg in loggers.values():
      lg.close(title="rubric-arm")
    results = {"phases": self.phases, "steps": dict(self.steps)}
    (self.out_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results

  def close(self) -> None:
    self.generator.close()
    self.judge.close()
