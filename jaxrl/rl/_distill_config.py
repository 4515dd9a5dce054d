"""The ``distill:`` section of :class:`jaxrl.rl.RLConfig` (on-policy distillation, :mod:`jaxrl.rl._distill`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.models import ModelSource


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  """The ``distill:`` section: on-policy distillation from a frozen teacher (docs/rl.md)."""

  teacher: ModelSource
  "The teacher model (preset or hf_dir; any size); frozen, built on the trainer's mesh in its compute dtype."
  tokenizer: str | None = None
  "The teacher's tokenizer dir; default its hf_dir, else the built-in tiny tokenizer. Must equal the student's."
  mode: Literal["reverse_kl", "gkd"] = "reverse_kl"
  ("reverse_kl: per-token advantage −(log π_student − log π_teacher) of the sampled tokens, policy-gradient loss; "
   "gkd: generalised JSD of the full next-token distributions on the sampled sequences, as a loss.")
  coef: float = 1.0
  "Scale of the distillation term (the reverse-KL advantage, or the JSD loss)."
  reward_coef: float = 0.0
  ("Weight of the task advantage (algorithm.advantage over reward.fn) added to the distillation term; 0: pure "
   "distillation (the reward still runs, for the accuracy metrics).")
  beta: float = 0.5
  "gkd: β of the generalised JSD (0 forward KL(teacher‖student), 1 reverse KL(student‖teacher), TRL's convention)."
  temperature: float | None = None
  "gkd: temperature of both distributions in the JSD; default rollout.temperature."

  def __post_init__(self):
    if self.mode not in ("reverse_kl", "gkd"):
      raise ValueError(f"distill.mode: unknown {self.mode!r}; known: ['gkd', 'reverse_kl']")
    if self.coef <= 0:
      raise ValueError(f"distill.coef must be > 0, got {self.coef!r}")
    if self.reward_coef < 0:
      raise ValueError(f"distill.reward_coef must be >= 0, got {self.reward_coef!r}")
    if not 0.0 <= self.beta <= 1.0:
      raise ValueError(f"distill.beta must be in [0, 1], got {self.beta!r}")
    if self.temperature is not None and self.temperature <= 0:
      raise ValueError(f"distill.temperature must be > 0, got {self.temperature!r}")

  def check(self, cfg) -> None:
    """Refuses the ``RLConfig`` combinations distillation does not support, naming the keys."""
    if cfg.critic is not None:
      raise ValueError("distill: a critic: section (GAE) cannot be combined with distillation; the per-token "
                       "advantage comes from the teacher")
    if cfg.asynchronous is not None:
      raise ValueError("distill: asynchronous: is not supported with distillation (the teacher runs on the "
                       "synchronous trainer's mesh)")
    if self.reward_coef == 0 and cfg.rollout.dynamic_sampling:
      raise ValueError("distill: rollout.dynamic_sampling drops groups by reward, but distill.reward_coef is 0 "
                       "(pure distillation: every group carries signal); set it false")
