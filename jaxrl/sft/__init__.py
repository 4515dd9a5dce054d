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

__all__ = [
    "BuiltinData",
    "CheckpointConfig",
    "EvalConfig",
    "SFTConfig",
    "SFTData",
    "SFTLoss",
    "SFTTrainer",
    "heldout_exact_match",
    "sft_loss_fn",
    "sft_prepare",
]
