"""The work-changing settings of ``jaxrl bench rl``, one object for all three frameworks.

A benchmark that leaves one framework's memory/compute trade-off at a different default measures the
default, not the framework (issue 34: TRL's ``gradient_checkpointing`` was on, so TRL recomputed its
forward in the backward pass while jaxrl did not). :class:`RLBenchSettings` holds every knob that
changes the work of a step; the parent sends :meth:`RLBenchSettings.to_message` to every worker, each
worker maps it onto its own configuration (:func:`jaxrl_config` here, ``trl_config_kwargs`` in
``benchmarks/rl_trl.py``, ``tunix_config_kwargs`` in ``benchmarks/rl_tunix.py``) and answers ``setup``
with the values it read back from the objects it built; :func:`check_applied` refuses a run whose
workers disagree. The table header prints :meth:`RLBenchSettings.header`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

OLD_LOGPROBS = "current"
"""π_old in all three: ``stop_gradient(log π_θ)`` from the train forward itself (one PPO epoch over one
mini-batch: the parameters are the rollout's), so no framework runs an extra log-prob pass. TRL does
this when ``num_iterations == 1`` and ``steps_per_generation == gradient_accumulation_steps``; Tunix when
``num_iterations == 1``; jaxrl with ``old_logprobs: recompute`` on its first mini-batch
(``current_as_old``)."""


def default_threads() -> int:
  """CPUs this process may run on (``sched_getaffinity``), the default for :attr:`RLBenchSettings.threads`."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin_cpus(threads: int) -> None:
  """Restricts this process to the first ``threads`` CPUs it may use (XLA sizes its CPU thread pool from
  the affinity mask, so this must run before the first JAX computation); one-line error if there are fewer."""
  if not hasattr(os, "sched_setaffinity"):
    return
  cpus = sorted(os.sched_getaffinity(0))
  if threads > len(cpus):
    raise ValueError(f"bench rl settings: threads={threads} but this process may use only {len(cpus)} CPUs")
  os.sched_setaffinity(0, cpus[:threads])


@dataclasses.dataclass(frozen=True)
class RLBenchSettings:
  """Every knob that changes the work of one GRPO step, equal in every framework.

  Attributes:
    remat: rematerialise activations in the backward pass (TRL ``gradient_checkpointing``, Tunix
      ``RematConfig.BLOCK``, jaxrl ``model.overrides.remat: full``); off, the log-prob head also runs as
      one un-rematerialised chunk in jaxrl, as the peers' full-logits head.
    threads: CPU threads: every worker is pinned to this many CPUs (``sched_setaffinity``, which sizes
      XLA's CPU thread pool) and PyTorch gets ``torch.set_num_threads(threads)``.
    dtype: parameter and compute dtype in all three.
    kl_coef: KL coefficient (0: no reference model anywhere).
    loss: ``token_mean``: Σ over the batch's completion tokens / their count (TRL ``dapo``, Tunix
      ``token-mean``, jaxrl ``aggregation: token_mean``).
    ppo_epochs: passes over the rollout per step (TRL/Tunix ``num_iterations``).
    micro_batches: gradient-accumulation micro-batches per update (one: the whole batch at once).
  """

  remat: bool = False
  threads: int = dataclasses.field(default_factory=default_threads)
  dtype: str = "float32"
  kl_coef: float = 0.0
  loss: str = "token_mean"
  ppo_epochs: int = 1
  micro_batches: int = 1

  def __post_init__(self):
    if self.threads < 1:
      raise ValueError(f"bench rl settings: threads must be >= 1, got {self.threads}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"bench rl settings: dtype must be float32 or bfloat16, got {self.dtype!r}")
    if self.loss != "token_mean":
      raise ValueError(f"bench rl settings: loss {self.loss!r}: only token_mean is mapped onto every framework")
    if self.ppo_epochs != 1:
      raise ValueError("bench rl settings: ppo_epochs must be 1 (π_old = the train forward's own log-probs)")
    if self.micro_batches < 1:
      raise ValueError(f"bench rl settings: micro_batches must be >= 1, got {self.micro_batches}")

  def to_message(self) -> dict[str, Any]:
    """What every worker's ``setup`` receives under ``settings`` (and must answer back, applied)."""
    return dict(dataclasses.asdict(self), old_logprobs=OLD_LOGPROBS)

  @classmethod
  def from_message(cls, msg: dict[str, Any]) -> RLBenchSettings:
    """The settings of a :meth:`to_message` dict (e.g. a results JSON's ``settings``)."""
    return cls(**{f.name: msg[f.name] for f in dataclasses.fields(cls)})

  def header(self, new_tokens: int, rows: int) -> str:
    """One line for the table: the settings every framework ran with."""
    return (f"equal settings: remat {'on' if self.remat else 'off'}, {self.threads} CPU threads, {self.dtype}, "
            f"KL {self.kl_coef:g} (no reference), loss {self.loss}, π_old = {OLD_LOGPROBS} log-probs "
            f"(no extra pass), {self.ppo_epochs} PPO epoch, {self.micro_batches} micro-batch, "
            f"{rows} rows × exactly {new_tokens} new tokens")


def jaxrl_config(settings: dict[str, Any], *, n_prompts: int, samples: int, prompt_tokens: int,
                 new_tokens: int) -> dict[str, Any]:
  """The ``model.overrides``, ``algorithm`` and ``micro_batch`` sections of jaxrl's ``RLConfig`` for
  ``settings`` (a :meth:`RLBenchSettings.to_message` dict)."""
  rows, row_len = n_prompts * samples, prompt_tokens + new_tokens
  if rows % settings["micro_batches"]:
    raise ValueError(f"bench rl settings: {rows} rows do not split into {settings['micro_batches']} micro-batches")
  per_micro = rows // settings["micro_batches"] * row_len
  return {
      "model_overrides": {"dtype": settings["dtype"], "param_dtype": settings["dtype"],
                          "remat": "full" if settings["remat"] else "none"},
      "algorithm": {"advantage": "grpo", "objective": "ppo_clip", "aggregation": settings["loss"],
                    "old_logprobs": "recompute", "kl_coef": settings["kl_coef"], "mini_batches": 1,
                    "ppo_epochs": settings["ppo_epochs"],
                    # remat off: the head's logits in one chunk, as the peers' (a chunk is rematerialised)
                    "logprob_chunk_size": 1024 if settings["remat"] else per_micro},
      "micro_batch": {"token_budget": per_micro, "row_len": row_len},
  }


def jaxrl_applied(cfg, model_cfg) -> dict[str, Any]:
  """The settings jaxrl's worker actually runs with, read back from its ``RLConfig`` and ``ModelConfig``."""
  algo = cfg.algorithm
  rows = cfg.rollout.prompts_per_step * cfg.rollout.n
  micro = rows * cfg.micro_batch.row_len // cfg.micro_batch.token_budget
  one_chunk = algo.logprob_chunk_size >= cfg.micro_batch.token_budget
  return {"remat": model_cfg.remat != "none" or not one_chunk, "threads": default_threads(),
          "dtype": model_cfg.dtype if model_cfg.dtype == model_cfg.param_dtype else "mixed",
          "kl_coef": algo.kl_coef, "loss": algo.aggregation, "ppo_epochs": algo.ppo_epochs,
          "micro_batches": micro,
          "old_logprobs": OLD_LOGPROBS if (algo.old_logprobs == "recompute" and algo.mini_batches == 1
                                           and algo.ppo_epochs == 1) else algo.old_logprobs}


def check_applied(name: str, expected: dict[str, Any], applied: dict[str, Any] | None) -> None:
  """Raises a one-line ``ValueError`` naming the framework and key when a worker's read-back settings
  differ from those sent (or it reports none)."""
  if applied is None:
    raise ValueError(f"bench rl: the {name} worker reported no applied settings")
  diff = [f"{k}={applied.get(k)!r} (sent {v!r})" for k, v in expected.items() if applied.get(k) != v]
  if diff:
    raise ValueError(f"bench rl: the {name} worker runs with other settings: {', '.join(diff)}")
