"""``TaskData``: the ``data:`` section every trainer's config shares (files, or the built-in task)."""

from __future__ import annotations

import dataclasses

from jaxrl.data._synthetic import BuiltinTask


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskData:
  """Where a trainer's records come from: ``train`` files, or the built-in task when there are none.

  The base of ``data:`` in the SFT (``SFTData``), RL (``PromptData``) and latent-reasoning (``LatentData``)
  configs; each adds the fields its trainer reads and narrows ``builtin`` to its own task.
  """

  train: tuple[str, ...] = ()
  "Training files (the trainer's record format). Empty: use `builtin`."
  heldout: tuple[str, ...] = ()
  "Held-out files for evaluation. Empty with `builtin`: the built-in held-out split."
  builtin: BuiltinTask | None = dataclasses.field(default_factory=BuiltinTask)
  "The built-in task, used when `train` is empty."
