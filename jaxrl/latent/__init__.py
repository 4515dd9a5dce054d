"""Coconut: reasoning in continuous latent thoughts (Hao et al. 2024, "Training Large Language Models to
Reason in a Continuous Latent Space").

Stage-k examples from worked chains, the latent forward in ``N + 1`` KV-cache passes, the stage
curriculum with its ablations and baselines, and latent-mode greedy decoding. See docs/latent.md.

Example::

    from jaxrl import latent
    cfg = latent.CoconutConfig(method="coconut", c=1, max_stage=2, stage_steps=100, steps=400)
    results = latent.CoconutTrainer(cfg).run()   # results["eval_after"]["accuracy"]
"""

from jaxrl.latent._data import (
    BOT,
    EOT,
    PAUSE,
    Chain,
    LatentTokens,
    Layout,
    StageExample,
    arithmetic_chains,
    chain_from_record,
    completion_text,
    latent_tokens,
    make_rows,
    prompt_ids,
    read_chains,
    stage_example,
)
from jaxrl.latent._decode import LatentOutput, latent_generate, left_pad
from jaxrl.latent._forward import latent_hidden
from jaxrl.latent._trainer import (
    METHODS,
    CoconutConfig,
    CoconutTrainer,
    LatentData,
    LatentEval,
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
    "StageExample",
    "arithmetic_chains",
    "chain_from_record",
    "completion_text",
    "evaluate_chains",
    "latent_generate",
    "latent_hidden",
    "latent_loss_fn",
    "latent_tokens",
    "left_pad",
    "load_chains",
    "main",
    "make_rows",
    "prompt_ids",
    "read_chains",
    "stage_example",
    "stage_schedule",
    "token_mean_prepare",
]
