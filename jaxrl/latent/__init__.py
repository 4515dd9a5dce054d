"""Coconut: reasoning in continuous latent thoughts (Hao et al. 2024, "Training Large Language Models to
Reason in a Continuous Latent Space").

Stage-k examples from worked chains, the latent forward in ``N + 1`` KV-cache passes, the stage
curriculum with its ablations and baselines, packed rows, the ``<eot>`` classifier head, latent-mode greedy
decoding, and a generated ProsQA-style task. See docs/latent.md.

Example::

    from jaxrl import latent
    cfg = latent.CoconutConfig(method="coconut", c=1, max_stage=2, stage_steps=100, steps=400)
    results = latent.CoconutTrainer(cfg).run()   # results["eval_after"]["accuracy"]

Layer (docs/design.md): may import ``train`` and the layers below; not ``rl``, ``envs`` or anything above.
"""

from jaxrl.latent._data import (
    BOT,
    EOT,
    PAUSE,
    Chain,
    LatentTokens,
    Layout,
    PackedLayout,
    StageExample,
    arithmetic_chains,
    chain_from_record,
    completion_text,
    latent_tokens,
    make_rows,
    pack_rows,
    padding_fraction,
    prompt_ids,
    read_chains,
    stage_example,
)
from jaxrl.latent._decode import LatentOutput, latent_generate, left_pad
from jaxrl.latent._eot import eot_logits, eot_loss, init_eot_head
from jaxrl.latent._forward import PACKED_KEYS, latent_hidden, packed_latent_hidden
from jaxrl.latent._prosqa import ProsQAConfig, prosqa_chain, prosqa_chains, reachable
from jaxrl.latent._trainer import (
    METHODS,
    CoconutConfig,
    CoconutTrainer,
    LatentData,
    LatentEval,
    answer_match,
    evaluate_chains,
    latent_loss_fn,
    load_chains,
    main,
    stage_schedule,
    token_mean_prepare,
)

__all__ = [
    "BOT",
    "EOT",
    "METHODS",
    "PAUSE",
    "Chain",
    "CoconutConfig",
    "CoconutTrainer",
    "LatentData",
    "LatentEval",
    "LatentOutput",
    "LatentTokens",
    "Layout",
    "PACKED_KEYS",
    "PackedLayout",
    "ProsQAConfig",
    "StageExample",
    "answer_match",
    "arithmetic_chains",
    "chain_from_record",
    "completion_text",
    "eot_logits",
    "eot_loss",
    "evaluate_chains",
    "init_eot_head",
    "latent_generate",
    "latent_hidden",
    "latent_loss_fn",
    "latent_tokens",
    "left_pad",
    "load_chains",
    "main",
    "make_rows",
    "pack_rows",
    "packed_latent_hidden",
    "padding_fraction",
    "prompt_ids",
    "prosqa_chain",
    "prosqa_chains",
    "reachable",
    "read_chains",
    "stage_example",
    "stage_schedule",
    "token_mean_prepare",
]
