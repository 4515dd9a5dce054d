"""Training machinery: optimizers, the jitted step with gradient accumulation, checkpoints, logging."""

from jaxrl.train._checkpoint import Checkpointer
from jaxrl.train._logging import MetricsLogger
from jaxrl.train._optim import OptimConfig, make_optimizer, make_schedule
from jaxrl.train._step import (
    TrainState,
    accumulate_gradients,
    init_train_state,
    make_train_step,
    place_on_mesh,
    split_micro_batches,
)

__all__ = [
    "Checkpointer",
    "MetricsLogger",
    "OptimConfig",
    "TrainState",
    "accumulate_gradients",
    "init_train_state",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "place_on_mesh",
    "split_micro_batches",
]
