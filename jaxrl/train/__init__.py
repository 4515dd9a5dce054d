"""Training machinery: optimizers, the jitted step with gradient accumulation, checkpoints, logging, the
training-loop skeleton every trainer runs through (``_loop.py``: logger, step tail, export, results), and the
config, set-up and step loop the packed-batch trainers share (``_trainer.py``).

Layer (docs/design.md): may import ``rewards``, ``sampling`` and the layers below; not the trainers or
anything above.
"""

from jaxrl.train._checkpoint import (
    CheckpointConfig,
    CheckpointError,
    Checkpointer,
    gather_process_states,
    own_process_state,
)
from jaxrl.train._guards import GuardConfig, LossSpikeError, NonFiniteError, SkipGuard
from jaxrl.train._logging import MetricsLogger
from jaxrl.train._loop import (
    eval_if_resumed_at_end,
    export_hf,
    finish_step,
    process_logger,
    resumable,
    stop_preempted,
    write_results,
)
from jaxrl.train._optim import OptimConfig, make_optimizer, make_schedule, param_path
from jaxrl.train._preempt import Preempted, PreemptionGuard
from jaxrl.train._trainer import ChunkedLoss, EvalCadence, PackedTrainer, TrainerConfig, run_steps
from jaxrl.train._step import (
    NONFINITE_KEY,
    TrainState,
    accumulate_gradients,
    init_train_state,
    make_train_step,
    place_on_mesh,
    split_micro_batches,
)

__all__ = [
    "NONFINITE_KEY",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "ChunkedLoss",
    "EvalCadence",
    "GuardConfig",
    "LossSpikeError",
    "MetricsLogger",
    "NonFiniteError",
    "OptimConfig",
    "PackedTrainer",
    "Preempted",
    "PreemptionGuard",
    "SkipGuard",
    "TrainState",
    "TrainerConfig",
    "accumulate_gradients",
    "eval_if_resumed_at_end",
    "export_hf",
    "finish_step",
    "gather_process_states",
    "init_train_state",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "own_process_state",
    "param_path",
    "place_on_mesh",
    "process_logger",
    "resumable",
    "run_steps",
    "split_micro_batches",
    "stop_preempted",
    "write_results",
]
