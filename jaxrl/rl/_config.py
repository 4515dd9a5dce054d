"""The RL trainer's configuration: one frozen dataclass per YAML section, validated on construction.

Every registry name (advantage estimator, policy objective, aggregation mode, KL estimator) is checked
against :mod:`jaxrl.losses` here, so a typo fails when the config loads, naming the key and value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxrl import data as data_lib
from jaxrl import losses, models, sharding, train
from jaxrl.models import ModelSource
from jaxrl.rewards import parse_metrics
from jaxrl.rewards import RewardRunnerConfig
from jaxrl.rl import _validate
from jaxrl.rl._critic import CriticConfig
from jaxrl.rl._async_config import AsyncConfig
from jaxrl.rl._distill_config import DistillConfig
from jaxrl.targets import TARGETS
from jaxrl import config as config_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinPrompts(data_lib.BuiltinTask):
  """The built-in arithmetic task as prompts with ``answer`` fields (single-turn)."""

  n_train: int = 2000
  "Training prompts drawn from the train split."

  def __post_init__(self):
    super().__post_init__()
    if self.num_turns != 1:
      raise ValueError(f"data.builtin.num_turns must be 1 for RL prompts, got {self.num_turns!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptData(data_lib.TaskData):
  """Where prompts come from: JSONL ``train`` / ``heldout`` files. A record is ``{"prompt": str | messages}``
  or ``{"messages": [...]}`` plus the fields the reward function reads (``answer``, ``tests``, ...)."""

  builtin: BuiltinPrompts | None = dataclasses.field(default_factory=BuiltinPrompts)
  "The built-in task as single-turn prompts, used when `train` is empty."
  image_task: data_lib.BuiltinImageTask | None = None
  ("Vision-language models: the built-in image task's prompts (image + question, `answer` per record), used when "
   "`train` is empty, instead of `builtin` (configs/vision_r1_tiny.yaml).")
  caption_task: data_lib.BuiltinCaptionTask | None = None
  ("Vision-language models: the built-in caption task's prompts (image + `Describe the image.`, `questions` and "
   "`rubrics` per record), used when `train` is empty (configs/caprl_tiny.yaml, configs/rubicap_tiny.yaml).")
  shuffle_seed: int = 0
  "Seed of the per-epoch prompt shuffle."
  max_prompt_tokens: int = 1024
  "Prompts longer than this many tokens are skipped (counted in the end-of-run skip report and results.json)."
  images: data_lib.ImageConfig = dataclasses.field(default_factory=data_lib.ImageConfig)
  "Vision-language models: how prompt images become patches (min/max pixels; geometry must match the tower)."
  images_per_prompt: int = 1
  "Vision-language models: most images one prompt holds (sizes the per-row patch bucket)."
  num_patches: int | None = None
  ("Vision-language models: patches per packed row (a fixed bucket, a multiple of merge_size**2); None: the worst "
   "case, sequences per row x images_per_prompt x max_pixels // patch_size**2 (`jaxrl.plan.vision_bucket`).")
  zero_pixels: bool = False
  ("Vision-language models: zero every prompt image's pixel values in rollouts, training and held-out eval "
   "(tokens and layouts unchanged): the image-ablated control.")

  def __post_init__(self):
    if not self.train and self.builtin is None and self.image_task is None and self.caption_task is None:
      raise ValueError("data: give data.train files, data.builtin, data.image_task or data.caption_task")
    if self.image_task is not None and self.caption_task is not None:
      raise ValueError("data: give data.image_task or data.caption_task, not both")
    if self.max_prompt_tokens < 1:
      raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens!r}")
    if self.images_per_prompt < 1:
      raise ValueError(f"data.images_per_prompt must be >= 1, got {self.images_per_prompt!r}")
    unit = self.images.merge_size ** 2
    if self.num_patches is not None and (self.num_patches < unit or self.num_patches % unit):
      raise ValueError(f"data.num_patches must be a positive multiple of merge_size**2={unit}, got {self.num_patches!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextStage:
  """One stage of iterative context lengthening (DeepScaleR 8K → 16K → 24K)."""

  start_step: int
  "First RL step of the stage; the stage restarts from the checkpoint saved at ``start_step - 1``."
  max_new_tokens: int
  "Response budget from this step on."
  n: int | None = None
  "Samples per prompt from this step on (default: unchanged)."

  def __post_init__(self):
    if self.start_step < 2:
      raise ValueError(f"rollout.context_schedule[].start_step must be >= 2, got {self.start_step!r}")
    if self.max_new_tokens < 1:
      raise ValueError(f"rollout.context_schedule[].max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
    if self.n is not None and self.n < 1:
      raise ValueError(f"rollout.context_schedule[].n must be >= 1, got {self.n!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongPenalty:
  """DAPO soft overlong punishment added to the task reward (``jaxrl.losses.dapo_overlong_penalty``)."""

  cache_len: int
  "L_cache: the punishment ramps from 0 to -1 over the last `cache_len` tokens."
  max_len: int | None = None
  "L_max; default the current stage's `max_new_tokens`."

  def __post_init__(self):
    if self.cache_len < 1:
      raise ValueError(f"rollout.overlong_penalty.cache_len must be >= 1, got {self.cache_len!r}")
    if self.max_len is not None and self.max_len < self.cache_len:
      raise ValueError(f"rollout.overlong_penalty.max_len={self.max_len!r} must be >= cache_len={self.cache_len}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Rollouts on :class:`jaxrl.sampling.Engine` (decode slots over a paged KV cache)."""

  num_slots: int = 64
  "Decode slots (rows decoded together); a multiple of the data-parallel shards."
  kv_cache_bytes: int | None = None
  "KV-cache budget per device, in bytes; exclusive with `kv_cache_fraction`."
  kv_cache_fraction: float | None = None
  "KV-cache budget as a fraction of each device's free memory at engine start (where reported)."
  num_blocks: int | None = None
  ("KV-cache blocks in all (what `jaxrl serve --num-blocks` sets); exclusive with `kv_cache_bytes` and "
   "`kv_cache_fraction`.")
  block_size: int = 16
  "Cache slots per block."
  steps_per_call: int = 8
  "Most decode steps per device call (a call also ends when a row finishes)."
  prefill_rows: int = 4
  ("Prompts per prefill program; on a mesh rounded up to a multiple of the cache's data shards (each shard "
   "prefills its own rows).")
  prefill_chunk: int | None = None
  ("Prefill long prompts this many tokens (a multiple of `block_size`) per scheduling round, decoding the "
   "running rows between chunks; null: whole prompts.")

  def __post_init__(self):
    for key in ("num_slots", "block_size", "steps_per_call", "prefill_rows"):
      if getattr(self, key) < 1:
        raise ValueError(f"rollout.engine.{key} must be >= 1, got {getattr(self, key)!r}")
    if self.prefill_chunk is not None and (self.prefill_chunk < 1 or self.prefill_chunk % self.block_size):
      raise ValueError(f"rollout.engine.prefill_chunk must be a positive multiple of block_size={self.block_size}, "
                       f"got {self.prefill_chunk!r}")
    if sum(x is not None for x in (self.kv_cache_bytes, self.kv_cache_fraction, self.num_blocks)) != 1:
      raise ValueError("rollout.engine: set exactly one of kv_cache_bytes, kv_cache_fraction and num_blocks")
    if self.num_blocks is not None and self.num_blocks < 1:
      raise ValueError(f"rollout.engine.num_blocks must be >= 1, got {self.num_blocks!r}")
    if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
      raise ValueError(f"rollout.engine.kv_cache_bytes must be >= 1, got {self.kv_cache_bytes!r}")
    if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
      raise ValueError(f"rollout.engine.kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Sampling, dynamic sampling and overlong handling."""

  prompts_per_step: int = 8
  "Prompt groups in the batch of one RL step."
  n: int = 8
  "Samples per prompt (the group size)."
  max_new_tokens: int = 64
  "Response budget (first stage of `context_schedule`)."
  context_schedule: tuple[ContextStage, ...] = ()
  ("Later stages of iterative context lengthening (DeepScaleR) or PTST (Vision-R1), in increasing `start_step`; "
   "asynchronous: each group gets the stage of the step that trains it (not with dynamic_sampling).")
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stop_strings: tuple[str, ...] = ()
  dynamic_sampling: bool = False
  "DAPO: drop groups whose rewards are all equal and generate more until the batch is full."
  max_rounds: int = 3
  "Most generation rounds per step with dynamic sampling (the batch may stay short)."
  overlong_filter: bool = False
  "Mask truncated responses out of the loss (GRPO+ / DAPO overlong filtering)."
  overlong_penalty: OverlongPenalty | None = None
  "DAPO soft overlong punishment; null disables it."
  decode_impl: Literal["kernel", "model"] = "kernel"
  "Sampler decode path (jaxrl.sampling.Sampler)."
  engine: EngineConfig | None = None
  "Roll out on the continuous-batching engine with this budget; null: jaxrl.sampling.Sampler."
  reward_overlap_chunks: int = 1
  ("Generate each round in this many prompt chunks; a chunk's rewards are scored in the pool while the "
   "next chunk generates (pays off for slow rewards such as the code sandbox). 1: generate all, then score. "
   "Samples do not depend on it (per-row PRNG keys).")

  def __post_init__(self):
    for key in ("prompts_per_step", "n", "max_new_tokens", "max_rounds", "reward_overlap_chunks"):
      if getattr(self, key) < 1:
        raise ValueError(f"rollout.{key} must be >= 1, got {getattr(self, key)!r}")
    if self.temperature <= 0:
      raise ValueError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p!r}")
    if self.top_k < 0:
      raise ValueError(f"rollout.top_k must be >= 0, got {self.top_k!r}")
    starts = [s.start_step for s in self.context_schedule]
    if starts != sorted(set(starts)):
      raise ValueError(f"rollout.context_schedule: start_step values must increase, got {starts}")

  def stage(self, step: int) -> tuple[int, int, int]:
    """``(stage index, max_new_tokens, n)`` in force at RL step ``step``."""
    index, max_new, n = 0, self.max_new_tokens, self.n
    for i, s in enumerate(self.context_schedule, start=1):
      if step >= s.start_step:
        index, max_new, n = i, s.max_new_tokens, s.n or n
    return index, max_new, n

  @property
  def max_max_new_tokens(self) -> int:
    return max([self.max_new_tokens] + [s.max_new_tokens for s in self.context_schedule])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelSection:
  """``reward.model``: a Bradley–Terry reward model scores every sample on the trainer's mesh (batched,
  jitted; :class:`jaxrl.pref.RewardModel`); its score is the task reward."""

  path: str
  "The reward model's directory: out_dir/hf of `jaxrl dpo` with loss.name: bradley_terry (docs/pref.md)."
  rows: int = 8
  "Rows per scoring batch (a multiple of the data-parallel devices)."
  seq_len: int = 512
  "Tokens per row; a prompt + completion longer than this is an error (never truncated)."

  def __post_init__(self):
    if self.rows < 1 or self.seq_len < 2:
      raise ValueError(f"reward.model: rows >= 1 and seq_len >= 2, got {self.rows}, {self.seq_len}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImplicitPRMSection:
  """``reward.implicit_prm``: a DPO-trained policy and its reference score every sampled response token by token
  (:class:`jaxrl.pref.ImplicitPRM`, on the trainer's mesh); ``coef`` × the step rewards is a dense reward added to
  the task reward (docs/rl.md, "Implicit process rewards")."""

  policy: str
  "The DPO-trained policy's HF directory (out_dir/hf of `jaxrl dpo`)."
  reference: str
  "Its reference: the DPO run's starting model (HF directory, the same tokenizer)."
  beta: float
  "β of the implicit reward q_t = β log π/π_ref (the DPO run's loss.beta)."
  coef: float = 1.0
  "Weight of the process rewards in the advantage (GAE: token rewards; critic-free: PRIME's process advantage)."
  rows: int = 8
  "Rows per scoring batch (a multiple of the data-parallel devices)."
  seq_len: int = 512
  "Tokens per row; must hold data.max_prompt_tokens + the longest max_new_tokens (never truncated)."
  step_delimiter: str | None = "\n"
  "Text that ends a step (its last token closes the step); null: every token is a step (PRIME's token rewards)."

  def __post_init__(self):
    if not self.beta > 0:
      raise ValueError(f"reward.implicit_prm.beta must be > 0, got {self.beta!r}")
    if self.rows < 1 or self.seq_len < 2:
      raise ValueError(f"reward.implicit_prm: rows >= 1 and seq_len >= 2, got {self.rows}, {self.seq_len}")
    if self.step_delimiter == "":
      raise ValueError("reward.implicit_prm.step_delimiter: an empty string; give text or null")


DEFAULT_REWARD = "jaxrl.rl:arithmetic_reward"
"""``reward.fn`` when none is given."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSection:
  """The reward function and its runner (or a reward model, ``reward.model``)."""

  fn: str = DEFAULT_REWARD
  ("Import path ``module:function`` or a built-in name (math, code, format, reasoning_gym, judge, pairwise_judge, "
   "rubric, rubric_anchor, alignxplore_jud, alignxplore_gen).")
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  "Bound to the function, e.g. {config: {correct_value: 5.0, incorrect_value: -5.0}}."
  runner: RewardRunnerConfig = dataclasses.field(default_factory=RewardRunnerConfig)
  correct_threshold: float = 0.5
  "A sample counts as correct (the `accuracy` metric) when its task reward exceeds this."
  model: RewardModelSection | None = None
  "A reward model instead of `fn`: {path: <rm dir>, rows, seq_len}; its score is the task reward."
  implicit_prm: ImplicitPRMSection | None = None
  ("Dense process rewards of a DPO policy and its reference, added to the task reward: {policy, reference, beta, "
   "coef, rows, seq_len, step_delimiter}.")

  def __post_init__(self):
    if self.model is not None and (self.fn != DEFAULT_REWARD or self.kwargs):
      raise config_lib.ConfigError("reward: give reward.fn (with reward.kwargs) or reward.model, not both")
    _validate.check_reward(self.fn, self.kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
  """Advantage, objective, aggregation, KL and the update schedule; names index `jaxrl.losses`."""

  TREE_ROLLOUTS = False  # class attribute, not a key: True in jaxrl.envs, whose rollouts supply prefix_ids

  advantage: str = "grpo"
  "A key of jaxrl.losses.ADVANTAGES."
  advantage_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  objective: str = "ppo_clip"
  "A key of jaxrl.losses.OBJECTIVES; `decoupled_ppo` gets the sampler's log-probs as π_behav and the "
  "trainer's as π_prox."
  objective_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  aggregation: str = "token_mean"
  "A jaxrl.losses.AGGREGATION_MODES entry; normalised once per global mini-batch."
  aggregation_max_len: int | None = None
  "L of `seq_mean_token_sum_norm`; default the current stage's max_new_tokens."
  ppo_epochs: int = 1
  "Passes over each step's batch."
  mini_batches: int = 1
  "Optimizer updates per epoch; the step's prompt groups are split evenly between them."
  old_logprobs: Literal["sampler", "recompute"] = "recompute"
  "π_old: the sampler's log-probs, or the trainer's forward pass at the rollout parameters."
  kl_coef: float = 0.0
  "β of the KL loss to a frozen reference policy (the initial model); 0 skips the reference entirely."
  kl_estimator: str = "k3"
  "A key of jaxrl.losses.KL."
  entropy_coef: float = 0.0
  "Entropy bonus coefficient (loss -= coef · aggregated entropy)."
  logprob_chunk_size: int = 1024
  "Tokens per chunk of jaxrl.losses.token_logprobs."

  def __post_init__(self):
    if self.advantage not in losses.ADVANTAGES:
      raise ValueError(f"algorithm.advantage: unknown {self.advantage!r}; known: {sorted(losses.ADVANTAGES)}")
    if self.objective not in losses.OBJECTIVES:
      raise ValueError(f"algorithm.objective: unknown {self.objective!r}; known: {sorted(losses.OBJECTIVES)}")
    if self.aggregation not in losses.AGGREGATION_MODES:
      raise ValueError(f"algorithm.aggregation: unknown {self.aggregation!r}; "
                       f"known: {list(losses.AGGREGATION_MODES)}")
    if self.kl_estimator not in losses.KL:
      raise ValueError(f"algorithm.kl_estimator: unknown {self.kl_estimator!r}; known: {sorted(losses.KL)}")
    # gae/egae pass here; RLConfig checks that a `critic:` section supplies their values.
    _validate.check_advantage(self.advantage, self.advantage_kwargs,
                              critic=self.advantage in _validate.CRITIC_ESTIMATORS, tree=self.TREE_ROLLOUTS)
    _validate.check_objective(self.objective, self.objective_kwargs)
    for key in ("ppo_epochs", "mini_batches", "logprob_chunk_size"):
      if getattr(self, key) < 1:
        raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(self, key)!r}")
    if self.kl_coef < 0:
      raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef!r}")
    if self.aggregation_max_len is not None and self.aggregation_max_len < 1:
      raise ValueError(f"algorithm.aggregation_max_len must be >= 1, got {self.aggregation_max_len!r}")

  @property
  def decoupled(self) -> bool:
    return self.objective == "decoupled_ppo"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchConfig:
  """Token-budget micro-batching of the updates (AReaL Algorithm 1)."""

  token_budget: int = 8192
  "Tokens per micro-batch (all of its rows together): `token_budget // row_len` rows."
  row_len: int | None = None
  ("Tokens per packed row (every stage); default `data.max_prompt_tokens` + the current context stage's "
   "`max_new_tokens`, so early short-context stages pack short rows.")
  bucket: Literal["pow2", "exact"] = "pow2"
  "Micro-batch count per update: rounded up to a power of two (fewer compilations) or exact."

  def __post_init__(self):
    if self.token_budget < 1:
      raise ValueError(f"micro_batch.token_budget must be >= 1, got {self.token_budget!r}")
    if self.row_len is not None and not 2 <= self.row_len <= self.token_budget:
      raise ValueError(f"micro_batch.row_len must be in [2, token_budget={self.token_budget}], "
                       f"got {self.row_len!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLEvalConfig:
  """Held-out evaluation: completions scored by the reward function (greedy by default).

  ``eval/accuracy`` is the share of correct completions over all prompts and samples: greedy
  accuracy with ``temperature: 0``, or pass@1 averaged over ``samples`` draws (DeepScaleR reports
  AIME pass@1 as the mean of 16 samples at T = 0.6); ``eval/pass@k`` is logged when ``samples > 1``.
  """

  every: int = 10
  "RL steps between evaluations (and before the first and after the last step); 0 disables."
  prompts: int = 64
  "Held-out prompts to evaluate."
  max_new_tokens: int | None = None
  "Default: the current stage's max_new_tokens."
  temperature: float = 0.0
  "0 = greedy."
  samples: int = 1
  "Completions per prompt (use > 1 only with temperature > 0)."
  metrics: str = ""
  """More metrics, as ``jaxrl eval`` reports them (e.g. ``"pass@1,maj@n"``; ``n`` = ``samples``; maj@k votes
  over the reward's ``extracted`` answers), each logged as ``eval/<name>``."""
  benchmarks: tuple[config_lib.Benchmark, ...] = ()
  "Benchmarks ``jaxrl eval --config`` runs (:class:`jaxrl.config.Benchmark`; docs/eval.md); training ignores them."

  def __post_init__(self):
    if self.metrics:
      try:
        parse_metrics(self.metrics, self.samples)
      except ValueError as e:
        raise ValueError(f"eval.metrics: {e}") from None
    if self.every < 0 or self.prompts < 0:
      raise ValueError(f"eval.every / eval.prompts must be >= 0, got {self.every!r} / {self.prompts!r}")
    if self.temperature < 0:
      raise ValueError(f"eval.temperature must be >= 0, got {self.temperature!r}")
    if self.samples < 1 or (self.samples > 1 and self.temperature == 0):
      raise ValueError(f"eval.samples must be >= 1, and 1 when eval.temperature is 0; got {self.samples!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSection:
  """What ``jaxrl plan`` checks this recipe against (docs/scaling.md)."""

  targets: tuple[str, ...] = ()
  "Hardware the recipe is meant for, names of jaxrl.plan.TARGETS (e.g. [v5p-8, h100x8])."
  preset: str | None = None
  "Model shapes to plan with when model.hf_dir is not on this machine (a jaxrl.models.PRESETS name)."
  overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  ("Per-target changes, ``{target: {dotted.key: value}}`` (e.g. ``h100x8: {micro_batch.token_budget: 360448}``): "
   "applied by ``jaxrl plan --target T`` and ``jaxrl rl --target T`` before the command line's key=value "
   "(docs/scaling.md); checked at load against the config they produce.")

  def __post_init__(self):
    if self.preset is not None and self.preset not in models.PRESETS:
      raise ValueError(f"plan.preset: unknown {self.preset!r}; known: {sorted(models.PRESETS)}")
    for target, changes in self.overrides.items():
      if target not in TARGETS:
        raise ValueError(f"plan.overrides: unknown target {target!r}; known: {sorted(TARGETS)}")
      for key in changes:
        if not key or not all(key.split(".")) or key.split(".")[0] == "plan":
          raise ValueError(f"plan.overrides.{target}: {key!r} is not a dotted config key outside plan")

  def for_target(self, target: str) -> list[str]:
    """``key=value`` overrides of ``target`` (none when the recipe has none for it)."""
    import yaml
    if target not in TARGETS:
      raise ValueError(f"--target: unknown {target!r}; known: {sorted(TARGETS)}")
    dump = lambda v: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()
    return [f"{k}={dump(v)}" for k, v in self.overrides.get(target, {}).items()]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """``jaxrl rl --config FILE``: GRPO / DAPO / GRPO+ / decoupled PPO on one mesh."""

  model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(preset="tiny"))
  tokenizer: str | None = None
  "Tokenizer dir; default the model's hf_dir, else the built-in tiny tokenizer."
  data: PromptData = dataclasses.field(default_factory=PromptData)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  reward: RewardSection = dataclasses.field(default_factory=RewardSection)
  algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
  micro_batch: MicroBatchConfig = dataclasses.field(default_factory=MicroBatchConfig)
  optim: train.OptimConfig = dataclasses.field(default_factory=lambda: train.OptimConfig(lr=1e-6))
  "Schedules count optimizer updates: steps × ppo_epochs × mini_batches in all."
  lora: models.LoraConfig | None = None
  ("Train LoRA adapters only (lr = optim.lr × lora.lr_multiplier); the frozen base is the KL reference "
   "(adapters switched off: no second copy of the weights) and the sampler runs the unmerged adapters.")
  steps: int = 100
  "RL steps (rollout + updates)."
  eval: RLEvalConfig = dataclasses.field(default_factory=RLEvalConfig)
  checkpoint: train.CheckpointConfig = dataclasses.field(default_factory=train.CheckpointConfig)
  guards: train.GuardConfig = dataclasses.field(default_factory=train.GuardConfig)
  "Non-finite updates: skipped and counted; abort after guards.max_consecutive_skips in a row."
  mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
  out_dir: str = "runs/rl"
  seed: int = 0
  "Base of the sampler's PRNG keys and of the mini-batch shuffle."
  export_hf: bool = False
  "Write an HF directory (out_dir/hf) at the end."
  log_samples: int = 0
  ("Each step, append the first N samples of process 0's rollout to out_dir/samples.jsonl (step, group, the "
   "decoded prompt, the completion, reward, task reward, length, truncated); 0: none.")
  tensorboard: bool = True
  plan: PlanSection = dataclasses.field(default_factory=PlanSection)
  "Targets and model shapes for ``jaxrl plan`` (ignored by training)."
  critic: CriticConfig | None = None
  "A value model for PPO with GAE (algorithm.advantage gae/egae; docs/rl.md); null: critic-free."
  asynchronous: AsyncConfig | None = None
  "Asynchronous RL (AReaL / one-off pipelining) on rollout and trainer sub-meshes (docs/async.md); null: synchronous."
  distill: DistillConfig | None = None
  "On-policy distillation from a frozen teacher (reverse-KL advantage or GKD loss; docs/rl.md); null: plain RL."

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps!r}")
    if isinstance(self.log_samples, bool) or not isinstance(self.log_samples, int) or self.log_samples < 0:
      raise ValueError(f"log_samples must be an int >= 0, got {self.log_samples!r}")
    for target in self.plan.overrides:  # each target's variant must itself be a valid recipe
      data = config_lib.to_dict(dataclasses.replace(self, plan=PlanSection(targets=self.plan.targets,
                                                                           preset=self.plan.preset)))
      try:
        config_lib.from_dict(type(self), config_lib.apply_overrides(data, self.plan.for_target(target)))
      except (config_lib.ConfigError, ValueError) as e:
        raise ValueError(f"plan.overrides.{target}: {e}") from e
    _validate.check_critic(self.algorithm.advantage, self.algorithm.advantage_kwargs, self.critic is not None)
    if self.asynchronous is not None:
      self.asynchronous.check(self)
    if self.distill is not None:
      self.distill.check(self)
    if self.reward.implicit_prm is not None:
      self._check_implicit_prm()
    if self.rollout.prompts_per_step % self.algorithm.mini_batches:
      raise ValueError(f"algorithm.mini_batches={self.algorithm.mini_batches} must divide "
                       f"rollout.prompts_per_step={self.rollout.prompts_per_step}")
    last = [s.start_step for s in self.rollout.context_schedule if s.start_step > self.steps]
    if last:
      raise ValueError(f"rollout.context_schedule: start_step {last} beyond steps={self.steps}")
    need = self.data.max_prompt_tokens + self.rollout.max_max_new_tokens
    if self.micro_batch.row_len is not None and self.micro_batch.row_len < need - 1:
      raise ValueError(f"micro_batch.row_len={self.micro_batch.row_len} cannot hold a full sequence: need "
                       f">= data.max_prompt_tokens + max_new_tokens - 1 = {need - 1}")
    if self.micro_batch.row_len is None and self.micro_batch.token_budget < need:
      raise ValueError(f"micro_batch.token_budget={self.micro_batch.token_budget} is below one full sequence "
                       f"(data.max_prompt_tokens + max_new_tokens = {need})")

  def _check_implicit_prm(self) -> None:
    prm = self.reward.implicit_prm
    need = self.data.max_prompt_tokens + self.rollout.max_max_new_tokens
    if prm.seq_len < need:
      raise ValueError(f"reward.implicit_prm.seq_len={prm.seq_len} cannot hold a full sequence: need >= "
                       f"data.max_prompt_tokens + max_new_tokens = {need}")
    if self.distill is not None:
      raise ValueError("reward.implicit_prm: not with distill (the process advantage is the task reward's)")
    smallest = min([self.rollout.n] + [s.n for s in self.rollout.context_schedule if s.n])
    if self.critic is None and smallest < 2:
      raise ValueError(f"reward.implicit_prm without a critic needs rollout.n >= 2 (PRIME's leave-one-out "
                       f"baseline), got {smallest}")

  @property
  def row_len(self) -> int:
    """The longest packed row of any stage (``micro_batch.row_len`` when set)."""
    return self.micro_batch.row_len or self.data.max_prompt_tokens + self.rollout.max_max_new_tokens

  def row_len_at(self, step: int) -> int:
    """Packed row length at RL step ``step``: ``micro_batch.row_len``, else prompt + that stage's response budget."""
    return self.micro_batch.row_len or self.data.max_prompt_tokens + self.rollout.stage(step)[1]

  @property
  def updates_per_step(self) -> int:
    return self.algorithm.ppo_epochs * self.algorithm.mini_batches
