"""Supervised fine-tuning on packed sequences."""

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
