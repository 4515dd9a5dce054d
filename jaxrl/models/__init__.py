"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 families and Hugging Face checkpoint interop.

Example::

    from jaxrl import models, sharding
    mesh = sharding.make_mesh({"data": -1})
    model = models.load_pretrained(hf_dir, mesh=mesh, dtype="float32")
    logits = model(tokens, positions=positions, segment_ids=segment_ids)  # [B, T, V] float32
    models.save_pretrained(model, out_dir, tokenizer=models.load_tokenizer(hf_dir))
"""

from jaxrl.models._config import PRESETS, ModelConfig, RopeScaling
from jaxrl.models._hf import (
    abstract_model,
    check_tokenizer,
    init_model,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
    shard_model,
    state_shardings,
)
from jaxrl.models._transformer import KVCache, Transformer, apply_rope, rope_frequencies

__all__ = [
    "KVCache",
    "ModelConfig",
    "PRESETS",
    "RopeScaling",
    "Transformer",
    "abstract_model",
    "apply_rope",
    "check_tokenizer",
    "init_model",
    "load_pretrained",
    "load_tokenizer",
    "rope_frequencies",
    "save_pretrained",
    "shard_model",
    "state_shardings",
]
