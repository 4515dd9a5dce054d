"""The ``distill:`` section of :class:`jaxrl.rl.RLConfig` (on-policy distillation, :mod:`jaxrl.rl._distill`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.models import ModelSource


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherServerConfig:
  """``distill.server``: a teacher behind ``jaxrl serve`` (:class:`jaxrl.rl._distill_server.ServerTeacher`)."""

  base_url: str
  "The server's OpenAI base URL, e.g. http://127.0.0.1:8001/v1 (``jaxrl serve --port 8001``)."
  model: str
  "The served model id (``jaxrl serve --served-model-name``); must be listed by ``/v1/models``."
  api_key_env: str | None = None
  "Environment variable holding the API key (sent as a bearer token); null: none."
  timeout_s: float = 120.0
  "Per-request timeout (connect and read), seconds."
  max_concurrency: int = 4
  "Most requests in flight at once."
  prompts_per_request: int = 16
  "Sequences scored by one ``/v1/completions`` request (the server scores a request's prompts in one forward)."
  max_retries: int = 4
  ("Retries of a request that timed out, lost its connection or was answered 429 or 5xx, with exponential "
   "backoff; any other failure (e.g. 400) is raised at once.")
  backoff_s: float = 0.5
  "First retry's delay; each further retry doubles it (±25 % jitter), up to ``backoff_max_s``."
  backoff_max_s: float = 8.0
  "Longest delay between two tries, seconds."

  def __post_init__(self):
    if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
      raise ValueError(f"distill.server.base_url must be an http(s) URL, got {self.base_url!r}")
    if not isinstance(self.model, str) or not self.model:
      raise ValueError(f"distill.server.model must be the served model id, got {self.model!r}")
    if self.timeout_s <= 0:
      raise ValueError(f"distill.server.timeout_s must be > 0, got {self.timeout_s!r}")
    for key in ("max_concurrency", "prompts_per_request"):
      if getattr(self, key) < 1:
        raise ValueError(f"distill.server.{key} must be >= 1, got {getattr(self, key)!r}")
    if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
      raise ValueError(f"distill.server.max_retries must be an int >= 0, got {self.max_retries!r}")
    if not 0 <= self.backoff_s <= self.backoff_max_s:
      raise ValueError(f"distill.server: need 0 <= backoff_s <= backoff_max_s, got {self.backoff_s!r} and "
                       f"{self.backoff_max_s!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  """The ``distill:`` section: on-policy distillation from a frozen teacher (docs/rl.md)."""

  teacher: ModelSource | None = None
  "The teacher model (preset or hf_dir; any size); frozen, built on the trainer's mesh in its compute dtype."
  server: TeacherServerConfig | None = None
  ("Instead of teacher: a teacher behind ``jaxrl serve`` that scores the sampled token ids with echo log-probs "
   "(mode reverse_kl only; its tokenizer fingerprint must equal the student's).")
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
  lmbda: float = 1.0
  ("gkd: GKD's λ (TRL GKDTrainer's lmbda), the fraction of steps trained on the student's own samples. Each step is "
   "on-policy with probability λ (a seeded draw per step, so a resumed run draws the same), otherwise it trains on "
   "the next prompts_per_step × n fixed completions of distill.data; 1: on-policy only.")
  data: tuple[str, ...] = ()
  ("gkd with lmbda < 1: JSONL files of fixed completions for the off-policy steps (``messages`` records ending in "
   "the assistant's answer, or ``prompt``/``completion``; e.g. the teacher's samples from jaxrl rs), read in a "
   "seeded per-epoch shuffle.")

  def __post_init__(self):
    if self.mode not in ("reverse_kl", "gkd"):
      raise ValueError(f"distill.mode: unknown {self.mode!r}; known: ['gkd', 'reverse_kl']")
    if (self.teacher is None) == (self.server is None):
      raise ValueError("distill: give exactly one of distill.teacher (in-process) and distill.server (a teacher "
                       f"behind jaxrl serve); got {'both' if self.teacher is not None else 'neither'}")
    if self.server is not None and self.mode != "reverse_kl":
      raise ValueError(f"distill.server: mode {self.mode!r} needs the teacher's full next-token distributions, which "
                       "a server does not return; use mode: reverse_kl (sampled-token log-probs) or distill.teacher")
    if self.server is not None and self.tokenizer is not None:
      raise ValueError("distill.tokenizer: applies to distill.teacher only (distill.server reports its tokenizer's "
                       "fingerprint)")
    if self.coef <= 0:
      raise ValueError(f"distill.coef must be > 0, got {self.coef!r}")
    if self.reward_coef < 0:
      raise ValueError(f"distill.reward_coef must be >= 0, got {self.reward_coef!r}")
    if not 0.0 <= self.beta <= 1.0:
      raise ValueError(f"distill.beta must be in [0, 1], got {self.beta!r}")
    if self.temperature is not None and self.temperature <= 0:
      raise ValueError(f"distill.temperature must be > 0, got {self.temperature!r}")
    if not 0.0 <= self.lmbda <= 1.0:
      raise ValueError(f"distill.lmbda must be in [0, 1], got {self.lmbda!r}")
    if self.lmbda < 1 and self.mode != "gkd":
      raise ValueError(f"distill.lmbda={self.lmbda!r} trains on fixed completions, which only mode gkd can (the "
                       "reverse_kl advantage is a policy gradient on the student's own samples); set distill.mode: gkd")
    if self.lmbda < 1 and not self.data:
      raise ValueError(f"distill.lmbda={self.lmbda!r} needs distill.data: the JSONL files of fixed completions "
                       "for its off-policy steps (e.g. the teacher's samples from jaxrl rs)")
    if self.lmbda == 1 and self.data:
      raise ValueError("distill.data is read only by off-policy steps, and distill.lmbda is 1 (on-policy only); "
                       "set distill.lmbda < 1 or drop distill.data")

  def check(self, cfg) -> None:
    """Refuses the ``RLConfig`` combinations distillation does not support, naming the keys."""
    if cfg.critic is not None:
      raise ValueError("distill: a critic: section (GAE) cannot be combined with distillation; the per-token "
                       "advantage comes from the teacher")
    if cfg.asynchronous is not None:
      raise ValueError("distill: asynchronous: is not supported with distillation (the teacher runs on the "
                       "synchronous trainer's mesh)")
    if self.lmbda < 1 and self.reward_coef != 0:
      raise ValueError(f"distill.lmbda < 1 with distill.reward_coef={self.reward_coef!r}: the fixed completions "
                       "carry no reward (GKD's mixture is pure distillation); set reward_coef: 0")
    if self.lmbda < 1 and getattr(cfg, "env", None) is not None:
      raise ValueError("distill.lmbda < 1 mixes fixed single-turn completions into the rollouts; multi-turn "
                       "episodes (env:) are not supported with it")
    if self.lmbda < 1 and cfg.algorithm.old_logprobs != "recompute":
      raise ValueError("distill.lmbda < 1 needs algorithm.old_logprobs: recompute (the fixed completions have no "
                       "sampler log-probs)")
    if self.reward_coef == 0 and cfg.rollout.dynamic_sampling:
      raise ValueError("distill: rollout.dynamic_sampling drops groups by reward, but distill.reward_coef is 0 "
                       "(pure distillation: every group carries signal); set it false")
