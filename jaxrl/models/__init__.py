"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 families and the Qwen2-VL / Qwen2.5-VL vision-language
models, and Hugging Face checkpoint interop.

Example::

    from jaxrl import models, sharding
    mesh = sharding.make_mesh({"data": -1})
    model = models.load_pretrained(hf_dir, mesh=mesh, dtype="float32")
    logits = model(tokens, positions=positions, segment_ids=segment_ids)  # [B, T, V] float32
    models.save_pretrained(model, out_dir, tokenizer=models.load_tokenizer(hf_dir))

Layer (docs/design.md): may import ``kernels``, ``sharding`` and ``config``; nothing above.
"""

from jaxrl.models._cache import (
    PAGE_AXES,
    CacheAxes,
    KVCache,
    cache_axes,
    cache_block_bytes,
    cache_shards,
    write_page_blocks,
    write_page_tokens,
    write_rows,
)
from jaxrl.models._config import PRESETS, VL_MODEL_TYPES, ModelConfig, RopeScaling
from jaxrl.models._hf import (
  check_tokenizer,
  config_from_dir,
  load_pretrained,
  load_tokenizer,
  save_pretrained,
  tokenizer_fingerprint,
)
from jaxrl.models._lora import (
    LORA_LR_MULTIPLIER,
    LORA_MODULES,
    VISION_LORA_MODULES,
    LoraConfig,
    LoraParam,
    apply_lora,
    base_logits,
    has_lora,
    has_merged_lora,
    lora_disabled,
    lora_loss,
    lora_state,
    merge_lora,
    merged_base,
    set_lora_merged,
    split_lora,
    unmerge_lora,
)
from jaxrl.models._lora_budget import (
    SHORT_RUN_LR_MULTIPLIER,
    hidden_size_lr,
    lora_flops_per_token,
    lora_lr,
    lora_param_counts,
    lr_scale_tree,
    optimizer_state_bytes,
)
from jaxrl.models._mrope import (
    apply_rope,
    decode_rope_positions,
    mrope_axes,
    mrope_positions,
    rope_frequencies,
)
from jaxrl.models._peft import load_peft, read_peft_config, save_peft
from jaxrl.models._placement import abstract_model, cast_params, compute_view, init_model, shard_model, state_shardings
from jaxrl.models._source import ModelSource, convert, describe_model_section
from jaxrl.models._transformer import Placement, Transformer
from jaxrl.models._transformer import add_lora
from jaxrl.models._value import ValueModel, build_value_model, place_value_model
from jaxrl.models._vision import (
    VISION_LAYOUT_KEYS,
    VisionConfig,
    VisionInputs,
    VisionLayout,
    VisionTower,
    batch_vision_inputs,
    pad_patch_rows,
    stack_layouts,
    vision_layout,
)

__all__ = [
    "LORA_LR_MULTIPLIER",
    "LORA_MODULES",
    "VISION_LORA_MODULES",
    "SHORT_RUN_LR_MULTIPLIER",
    "LoraConfig",
    "LoraParam",
    "add_lora",
    "apply_lora",
    "base_logits",
    "has_lora",
    "has_merged_lora",
    "hidden_size_lr",
    "load_peft",
    "lora_disabled",
    "lora_flops_per_token",
    "lora_loss",
    "lora_lr",
    "lora_param_counts",
    "lora_state",
    "lr_scale_tree",
    "merge_lora",
    "merged_base",
    "set_lora_merged",
    "optimizer_state_bytes",
    "read_peft_config",
    "save_peft",
    "split_lora",
    "unmerge_lora",
    "VL_MODEL_TYPES",
    "VisionConfig",
    "VisionInputs",
    "VisionLayout",
    "VisionTower",
    "VISION_LAYOUT_KEYS",
    "batch_vision_inputs",
    "pad_patch_rows",
    "stack_layouts",
    "decode_rope_positions",
    "mrope_axes",
    "mrope_positions",
    "vision_layout",
    "CacheAxes",
    "KVCache",
    "PAGE_AXES",
    "ModelSource",
    "ModelConfig",
    "PRESETS",
    "Placement",
    "RopeScaling",
    "Transformer",
    "ValueModel",
    "abstract_model",
    "apply_rope",
    "cache_axes",
    "cache_block_bytes",
    "cache_shards",
    "cast_params",
    "compute_view",
    "check_tokenizer",
    "config_from_dir",
    "convert",
    "describe_model_section",
    "init_model",
    "load_pretrained",
    "load_tokenizer",
    "rope_frequencies",
    "save_pretrained",
    "shard_model",
    "state_shardings",
    "tokenizer_fingerprint",
    "write_page_blocks",
    "write_page_tokens",
    "write_rows",
    "build_value_model",
    "place_value_model",
]
