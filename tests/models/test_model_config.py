"""ModelConfig: validation, presets, Hugging Face config.json in both layouts."""

import dataclasses

import pytest
import transformers

from jaxrl.models import PRESETS, ModelConfig, RopeScaling

LLAMA3_HF_V4 = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}


def test_presets_have_published_parameter_counts():
  # Totals published on the model cards (tied embeddings counted once).
  assert ModelConfig.qwen2p5_0p5b().num_params() == 494_032_768
  assert ModelConfig.qwen3_0p6b().num_params() == 596_049_920
  assert ModelConfig.llama3p1_8b().num_params() == 8_030_261_248


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_hf_config(name):
  cfg = PRESETS[name]()
  assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_transformers4_and_transformers5_layouts_parse_the_same():
  v4 = ModelConfig.from_hf_config(LLAMA3_HF_V4)
  v5_dict = {k: v for k, v in LLAMA3_HF_V4.items() if k not in ("rope_theta", "rope_scaling")}
  v5_dict["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
  v5 = ModelConfig.from_hf_config(v5_dict)
  assert v4 == v5 == ModelConfig.llama3p1_8b()


def test_written_config_is_parsed_by_transformers():
  cfg = ModelConfig.llama3p1_8b()
  hf = transformers.LlamaConfig(**cfg.to_hf_config())
  assert hf.rope_parameters["rope_type"] == "llama3"
  assert hf.rope_parameters["rope_theta"] == 500000.0
  assert hf.rope_parameters["original_max_position_embeddings"] == 8192
  assert (hf.head_dim, hf.num_key_value_heads, hf.num_hidden_layers) == (128, 8, 32)
  qwen3 = transformers.Qwen3Config(**ModelConfig.qwen3_0p6b().to_hf_config())
  assert qwen3.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
  assert qwen3.tie_word_embeddings and qwen3.head_dim == 128


def test_unknown_model_type_names_config_json_and_value():
  with pytest.raises(ValueError, match=r"config\.json: model_type 'mistral' is not supported"):
    ModelConfig.from_hf_config({**LLAMA3_HF_V4, "model_type": "mistral"})


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias=true is not supported for llama"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"hidden_size": None}, "missing required key 'hidden_size'"),
])
def test_unsupported_hf_configs_are_named(change, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config({**LLAMA3_HF_V4, **change}, source="ckpt/config.json")


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "gpt2", "model_type: 'gpt2'"),
    ("num_kv_heads", 3, "num_kv_heads: 3 does not divide num_heads"),
    ("hidden_size", 0, "hidden_size: must be a positive int, got 0"),
    ("dtype", "float16", "dtype: 'float16'"),
    ("param_dtype", "int8", "param_dtype: 'int8'"),
    ("remat", "everything", "remat: 'everything'"),
    ("attention_impl", "flash9", "attention_impl: 'flash9'"),
    ("attention_bias", True, "attention_bias: True with model_type 'llama'"),
    ("qk_norm", True, "qk_norm: True with model_type 'llama'"),
    ("rms_norm_eps", -1.0, "rms_norm_eps: must be a positive number, got -1.0"),
    ("scan_layers", "yes", "scan_layers: must be a bool, got 'yes'"),
    ("scan_unroll", 0, "scan_unroll: must be a positive int or true"),
    ("scan_unroll", False, "scan_unroll: must be a positive int or true"),
])
def test_bad_fields_are_named_with_their_value(field, value, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.tiny(**{field: value})


def test_rope_scaling_mapping_becomes_a_hashable_dataclass():
  cfg = ModelConfig.tiny(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
  assert isinstance(cfg.rope_scaling, RopeScaling)
  assert hash(cfg) == hash(dataclasses.replace(cfg))
  with pytest.raises(ValueError, match="rope_scaling: unknown keys"):
    ModelConfig.tiny(rope_scaling={"factor": 8.0, "alpha": 1.0})


def test_head_dim_defaults_to_hidden_over_heads():
  assert ModelConfig.tiny(head_dim=None, hidden_size=96, num_heads=4).head_dim == 24
  with pytest.raises(ValueError, match=r"head_dim: None needs hidden_size \(90\) divisible"):
    ModelConfig.tiny(head_dim=None, hidden_size=90, num_heads=4)


def test_flops_per_token_matches_hand_count():
  cfg = ModelConfig.tiny()  # V=512 D=64 F=128 L=2 N=4 K=2 H=16
  matmul = 2 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128) + 512 * 64
  forward = 2 * matmul + 2 * 2 * 4 * 16 * 100
  assert cfg.flops_per_token(100, training=False) == forward
  assert cfg.flops_per_token(100) == 3 * forward


def test_remat_names_map_to_checkpoint_policies():
  import jax
  assert ModelConfig.tiny().remat_policy is None
  assert ModelConfig.tiny(remat="dots").remat_policy is jax.checkpoint_policies.checkpoint_dots
  assert ModelConfig.tiny(remat="full").remat_policy is jax.checkpoint_policies.nothing_saveable
