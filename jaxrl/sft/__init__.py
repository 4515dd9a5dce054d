"""Supervised fine-tuning on packed sequences.

Layer (docs/design.md): may import ``train`` and the layers below; not ``rl``, ``envs`` or anything above.
"""

from jaxrl.sft._trainer import (
    BuiltinData,
    CheckpointConfig,
    EvalConfig,
    SFTConfig,
    SFTData,
    SFTLoss,
    SFTTrainer,
    heldout_exact_match,
    sft_loss_fn,
    sft_prepare,
)
from jaxrl.sft._vl import device_arrays as vl_device_arrays
from jaxrl.sft._vl import image_heldout_accuracy

__all__ = [
    "BuiltinData",
    "CheckpointConfig",
    "EvalConfig",
    "SFTConfig",
    "SFTData",
    "SFTLoss",
    "SFTTrainer",
    "heldout_exact_match",
    "image_heldout_accuracy",
    "sft_loss_fn",
    "sft_prepare",
    "vl_device_arrays",
]
