"""Reinforcement learning for LLMs: GRPO / DAPO / GRPO+ / decoupled PPO, synchronous, on one mesh.

``RLTrainer(RLConfig).run()`` takes each step's rollouts from its :class:`RolloutSource` (by default
:class:`EngineRollout`: :class:`jaxrl.sampling.Sampler`, or the engine built by :func:`build_engine`, on the
trainer's parameters, scored with a reward function from :mod:`jaxrl.rewards`), computes advantages and
updates the policy with losses chosen by name from :mod:`jaxrl.losses`. ``jaxrl rl --config FILE`` is
:mod:`jaxrl.cli.rl`.

Layer (docs/design.md): may import ``sft``, ``latent``, ``train`` and the layers below; not ``envs``,
``plan``, ``serve``, ``bench`` or ``cli``.
"""

from jaxrl.rl._config import (
    AlgorithmConfig,
    BuiltinPrompts,
    ContextStage,
    EngineConfig,
    MicroBatchConfig,
    OverlongPenalty,
    PlanSection,
    PromptData,
    ImplicitPRMSection,
    RewardModelSection,
    RewardSection,
    RLConfig,
    RLEvalConfig,
    RolloutConfig,
)
from jaxrl.rl._distill_config import DistillConfig, TeacherServerConfig
from jaxrl.rl._distill import Teacher, check_shared_vocab
from jaxrl.rl._distill_server import ServerTeacher
from jaxrl.rl._engine_build import build_engine, build_sampler, rollout_max_len
from jaxrl.rl._loss import make_logprob_fn, make_loss_fn, make_prepare, policy_logprobs
from jaxrl.rl._packing import (PackedBatch, agree_patch_bucket, assign_micro_batches, loss_column_capacity,
                               pack_sequences, with_loss_columns)
from jaxrl.rl._prompts import EncodedPrompts, PromptStream, load_prompt_sets, read_records, reward_fields
from jaxrl.rl._rewards import arithmetic_reward, image_answer_reward, weighted_reward
from jaxrl.rl._rubric_arm import PairData, RubricARM, RubricARMConfig, arithmetic_pairs
from jaxrl.rl._rollout import (
    Rollout,
    compute_advantages,
    concat_rollouts,
    informative_groups,
    loss_mask,
    sequence_fields,
    total_rewards,
    vision_fields,
)
from jaxrl.rl._source import EngineRollout, RolloutBatch, RolloutSource, draw_rounds
from jaxrl.rl._learner import make_learner_step, make_logprob_program, packed_layout
from jaxrl.rl._trainer import RLTrainer
from jaxrl.rl._async import AsyncRLTrainer, make_trainer, split_devices
from jaxrl.rl._async_config import AsyncConfig

__all__ = [
    "AlgorithmConfig",
    "AsyncConfig",
    "AsyncRLTrainer",
    "BuiltinPrompts",
    "ContextStage",
    "DistillConfig",
    "EncodedPrompts",
    "EngineConfig",
    "EngineRollout",
    "MicroBatchConfig",
    "OverlongPenalty",
    "PlanSection",
    "PackedBatch",
    "PairData",
    "PromptData",
    "PromptStream",
    "RLConfig",
    "RLEvalConfig",
    "RLTrainer",
    "ImplicitPRMSection",
    "RewardModelSection",
    "RewardSection",
    "Rollout",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutSource",
    "RubricARM",
    "RubricARMConfig",
    "ServerTeacher",
    "Teacher",
    "TeacherServerConfig",
    "agree_patch_bucket",
    "arithmetic_pairs",
    "arithmetic_reward",
    "image_answer_reward",
    "assign_micro_batches",
    "build_engine",
    "build_sampler",
    "check_shared_vocab",
    "compute_advantages",
    "concat_rollouts",
    "draw_rounds",
    "informative_groups",
    "load_prompt_sets",
    "loss_column_capacity",
    "loss_mask",
    "make_learner_step",
    "make_logprob_fn",
    "make_logprob_program",
    "make_loss_fn",
    "make_prepare",
    "make_trainer",
    "pack_sequences",
    "packed_layout",
    "policy_logprobs",
    "read_records",
    "reward_fields",
    "rollout_max_len",
    "sequence_fields",
    "vision_fields",
    "split_devices",
    "total_rewards",
    "weighted_reward",
    "with_loss_columns",
]
