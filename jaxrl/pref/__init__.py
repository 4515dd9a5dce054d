"""Preference optimisation: DPO and its family (``jaxrl.losses.PREFERENCE_LOSSES``) on packed pairs, and
Bradley–Terry reward models (``loss.name: bradley_terry``) with the batched scorer ``jaxrl rl`` uses.

Layer (docs/design.md): may import ``train`` and the layers below; not ``rl``, ``envs`` or anything above.
"""

from jaxrl.pref._data import (
    PAIR_KEYS,
    REJECTED_KINDS,
    Pair,
    PairStream,
    answer_messages,
    arithmetic_pairs,
    encode_pair,
    pack_pairs,
    pack_sequences,
    pair_batch,
    pair_messages,
    read_pairs,
    write_builtin_pairs,
)
from jaxrl.pref._rm import (
    REWARD_HEAD_FILE,
    RewardModel,
    export_reward_model,
    last_token_mask,
    load_reward_model,
    reward_model_score,
    sequence_scores,
)
from jaxrl.pref._trainer import (
    BRADLEY_TERRY,
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
    rm_loss_fn,
)

__all__ = [
    "BRADLEY_TERRY",
    "PAIR_KEYS",
    "REJECTED_KINDS",
    "REWARD_HEAD_FILE",
    "RewardModel",
    "DPOConfig",
    "DPOTrainer",
    "Pair",
    "PairPacking",
    "PairStream",
    "PrefData",
    "PrefEval",
    "PrefLoss",
    "answer_messages",
    "arithmetic_pairs",
    "encode_pair",
    "export_reward_model",
    "last_token_mask",
    "load_reward_model",
    "pack_pairs",
    "pack_sequences",
    "pair_batch",
    "pair_logps",
    "pair_messages",
    "pref_loss_fn",
    "pref_prepare",
    "read_pairs",
    "reference_logps",
    "reward_model_score",
    "rm_loss_fn",
    "sequence_scores",
    "write_builtin_pairs",
]
