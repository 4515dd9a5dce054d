"""Preference optimisation: DPO and its family (``jaxrl.losses.PREFERENCE_LOSSES``) on packed pairs.

Layer (docs/design.md): may import ``train`` and the layers below; not ``rl``, ``envs`` or anything above.
"""

from jaxrl.pref._data import (
    PAIR_KEYS,
    Pair,
    PairStream,
    arithmetic_pairs,
    encode_pair,
    pack_pairs,
    pair_batch,
    pair_messages,
    read_pairs,
    write_builtin_pairs,
)
from jaxrl.pref._trainer import (
    DPOConfig,
    DPOTrainer,
    PairPacking,
    PrefData,
    PrefEval,
    PrefLoss,
    pair_logps,
    pref_loss_fn,
    pref_prepare,
    reference_logps,
)

__all__ = [
    "PAIR_KEYS",
    "DPOConfig",
    "DPOTrainer",
    "Pair",
    "PairPacking",
    "PairStream",
    "PrefData",
    "PrefEval",
    "PrefLoss",
    "arithmetic_pairs",
    "encode_pair",
    "pack_pairs",
    "pair_batch",
    "pair_logps",
    "pair_messages",
    "pref_loss_fn",
    "pref_prepare",
    "read_pairs",
    "reference_logps",
    "write_builtin_pairs",
]
