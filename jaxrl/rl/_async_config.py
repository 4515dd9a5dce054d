"""The ``asynchronous:`` section of :class:`jaxrl.rl.RLConfig` (docs/async.md).

Kept apart from ``_config.py`` so the asynchronous trainer owns its keys; ``RLConfig`` holds one
``asynchronous: AsyncConfig | None`` field and calls :meth:`AsyncConfig.check` with itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal
from jaxrl.sharding import MeshConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
  """Rollouts on a separate device set, overlapped with training (AReaL / DeepCoder one-off).

  ``mode: areal``: prompts are admitted continuously under the staleness bound ``max_staleness``
  (η, AReaL eq. 3); a weight update interrupts in-flight rows (their cache is recomputed with the new
  weights, tokens kept). ``mode: one_off`` (DeepCoder one-off pipelining): generation runs exactly
  one step ahead; the weights change only between batches, so every trajectory has one version and a
  staleness of at most 1 (``max_staleness`` must stay 1).

  Works with ``lora:`` (only the adapters move to the rollout devices at each version), with
  ``rollout.dynamic_sampling`` (rounds of ``B`` groups, filtered as synchronously, under the same
  bound) and with ``rollout.context_schedule`` (PTST: each group is generated with the stage of the step that
  trains it; not together with dynamic sampling); needs ``rollout.engine``. On several processes each rolls out
  its own share on its own devices (``rollout_devices`` and ``rollout.engine.num_slots`` count all processes';
  no dynamic sampling there yet; docs/async.md, "Several processes").
  """

  mode: Literal["areal", "one_off"] = "areal"
  "areal: continuous admission under eq. 3, interruptible rollouts; one_off: DeepCoder one-step-ahead pipeline."
  max_staleness: int = 4
  "η: no training batch holds a token more than η policy versions (RL steps) old; 0 is the synchronous trainer."
  rollout_devices: int | None = None
  ("Devices of the rollout sub-mesh (the first ones; each process's first rollout_devices / P on P processes); the "
   "rest train. Default 3/4 of the devices (AReaL's ratio).")
  rollout_mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
  "Mesh axis sizes of the rollout sub-mesh (the trainer keeps `mesh:`); the logical rules are `mesh.rules`."
  interrupt: bool = True
  "areal: interrupt in-flight rows at a weight update (AReaL); false: they finish under the old weights first."
  reward_workers: int | None = None
  "Reward pool size of the rollout side; default `reward.runner.workers`."

  def __post_init__(self):
    if self.mode not in ("areal", "one_off"):
      raise ValueError(f"asynchronous.mode must be 'areal' or 'one_off', got {self.mode!r}")
    if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
      raise ValueError(f"asynchronous.max_staleness must be an int >= 0, got {self.max_staleness!r}")
    if self.mode == "one_off" and self.max_staleness != 1:
      raise ValueError(f"asynchronous.max_staleness must be 1 with mode: one_off (one step ahead), "
                       f"got {self.max_staleness!r}")
    if self.rollout_devices is not None and (isinstance(self.rollout_devices, bool)
                                             or not isinstance(self.rollout_devices, int) or self.rollout_devices < 1):
      raise ValueError(f"asynchronous.rollout_devices must be an int >= 1 or null, got {self.rollout_devices!r}")
    if self.reward_workers is not None and self.reward_workers < 1:
      raise ValueError(f"asynchronous.reward_workers must be >= 1, got {self.reward_workers!r}")
    try:
      MeshConfig(shape=dict(self.rollout_mesh))
    except ValueError as e:
      raise ValueError(f"asynchronous.rollout_mesh: {e}") from None

  def check(self, cfg: Any) -> None:
    """Cross-section checks against the whole :class:`RLConfig` (what the async trainer supports)."""
    r = cfg.rollout
    if r.engine is None:
      raise ValueError("asynchronous: needs rollout.engine (the continuous-batching engine streams rows)")
    if r.context_schedule and r.dynamic_sampling:
      raise ValueError("asynchronous: rollout.context_schedule with rollout.dynamic_sampling is not supported (a "
                       "group's batch, hence its stage, is only known once earlier rounds are filtered)")
    if r.reward_overlap_chunks != 1:
      raise ValueError("asynchronous: rollout.reward_overlap_chunks must be 1 (rows are scored as each finishes)")
    if cfg.reward.model is not None:
      raise ValueError("asynchronous: reward.model is not supported (the reward model scores a whole chunk in one "
                       "forward on the trainer's mesh; the async rollout scores each row as it finishes); run it "
                       "synchronously, or serve the reward model (jaxrl serve) and score through reward.fn")
