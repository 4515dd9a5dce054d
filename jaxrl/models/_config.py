"""Decoder shapes and numerics: one frozen dataclass for Llama, Qwen2 and Qwen3 models.

:class:`ModelConfig` holds everything that decides a parameter shape or a numerical choice. Named
constructors give the published shapes of real checkpoints (``ModelConfig.qwen2p5_1p5b()``), and
:meth:`ModelConfig.from_hf_config` / :meth:`ModelConfig.to_hf_config` translate to and from a
Hugging Face ``config.json`` (both the transformers-4 ``rope_theta``/``rope_scaling`` layout and the
transformers-5 ``rope_parameters`` layout).

A vision-language model (Qwen2.5-VL, Qwen2-VL) is the same decoder (a Qwen2 language model) with a
vision tower: ``model_type`` ``qwen2_5_vl``/``qwen2_vl``, ``vision`` (a :class:`VisionConfig`), the
M-RoPE split ``mrope_section`` and the special token ids; see :mod:`jaxrl.models._vl_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxrl import kernels
from jaxrl.models import _vl_config
from jaxrl.models._vision import VisionConfig

VL_MODEL_TYPES = _vl_config.VL_MODEL_TYPES
MODEL_TYPES = ("llama", "qwen2", "qwen3", *VL_MODEL_TYPES)
QKV_BIAS_TYPES = ("qwen2", *VL_MODEL_TYPES)
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 **_vl_config.VL_ARCHITECTURES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 RoPE frequency scaling (``rope_type: llama3`` in a Hugging Face config).

  Wavelengths ``λ = 2π / ω`` longer than ``L / low_freq_factor`` are divided by ``factor``, shorter
  than ``L / high_freq_factor`` kept, and interpolated in between (``L`` =
  ``original_max_position_embeddings``); see :func:`jaxrl.models._mrope.rope_frequencies`.
  """

  factor: float
  "Divisor of the low frequencies."
  low_freq_factor: float
  "Wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."
  high_freq_factor: float
  "Wavelengths below original_max_position_embeddings / high_freq_factor are not scaled."
  original_max_position_embeddings: int
  "Context length the model was pre-trained with."
  rope_type: str = "llama3"
  "Only 'llama3' is supported."

  def __post_init__(self):
    if self.rope_type != "llama3":
      raise ValueError(f"rope_scaling.rope_type: {self.rope_type!r} is not supported; only 'llama3'")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"rope_scaling.{name}: must be a positive number, got {value!r}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"rope_scaling: high_freq_factor ({self.high_freq_factor!r}) must exceed "
          f"low_freq_factor ({self.low_freq_factor!r})")

  def to_dict(self) -> dict[str, Any]:
    return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shapes and numerics of a pre-norm decoder (Llama / Qwen2 / Qwen3 family, and the Qwen2-VL /
  Qwen2.5-VL vision-language models: a Qwen2 decoder with ``vision`` set).

  Example::

      cfg = ModelConfig.qwen3_0p6b()
      cfg = dataclasses.replace(cfg, dtype="bfloat16", remat="dots")
  """

  model_type: str = "llama"
  "Architecture: 'llama', 'qwen2' (q/k/v bias), 'qwen3' (per-head q/k RMSNorm), 'qwen2_5_vl' or 'qwen2_vl' (VLMs)."
  vocab_size: int
  "Rows of the embedding matrix V."
  hidden_size: int
  "Model width D."
  intermediate_size: int
  "SwiGLU width F."
  num_layers: int
  "Decoder blocks L."
  num_heads: int
  "Query heads N."
  num_kv_heads: int
  "Key/value heads K (N must be a multiple of K)."
  head_dim: int | None = None
  "Per-head width H; None means hidden_size // num_heads."
  rms_norm_eps: float = 1e-6
  "RMSNorm epsilon."
  rope_theta: float = 10000.0
  "RoPE base."
  rope_scaling: RopeScaling | None = None
  "None (plain RoPE) or Llama-3 scaling; a mapping with the RopeScaling fields is accepted."
  max_position_embeddings: int = 4096
  "Longest context the checkpoint supports (metadata; nothing is sized by it)."
  tie_word_embeddings: bool = False
  "Use the embedding matrix as the output projection."
  attention_bias: bool = False
  "Bias on the q/k/v projections (always on for qwen2, off otherwise)."
  qk_norm: bool = False
  "Per-head RMSNorm of queries and keys before RoPE (always on for qwen3, off otherwise)."
  param_dtype: str = "float32"
  "Storage dtype of the parameters (the trained master weights): 'float32' (default) or 'bfloat16'."
  dtype: str = "float32"
  "Compute dtype of matmuls and activations: 'float32' or 'bfloat16'. Norms, softmax and logits stay float32."
  scan_layers: bool = True
  "Stack the blocks and run them with nnx.scan (fast compiles); False: a Python loop over blocks."
  scan_unroll: int | bool = 1
  ("Blocks per iteration of the scanned layer loop (lax.scan's unroll; with scan_layers only). 1 (default) "
   "compiles one block; True (or >= num_layers) unrolls the loop in the program while the weights stay "
   "stacked: XLA then fuses and lays out across blocks as for a Python loop, at an unrolled model's compile "
   "time. On CPU the tiny jaxrl bench rl train step ran 15 % faster fully unrolled (issue 34).")
  remat: str = "none"
  "Rematerialisation of each block: 'none', 'full', 'dots' or 'dots_with_no_batch_dims'."
  attention_impl: str = "auto"
  "Implementation name passed to jaxrl.kernels.attention."
  attention_interpret: bool = False
  "Run Pallas attention kernels in interpret mode (CPU tests and debugging; slow)."
  mrope_section: tuple[int, int, int] | None = None
  "VLMs: rotary frequencies per (temporal, height, width) axis, summing to head_dim // 2 (M-RoPE); else None."
  vision: VisionConfig | None = None
  "VLMs: the vision tower; None for a text model."
  image_token_id: int | None = None
  "VLMs: the image placeholder token (``<|image_pad|>``) that the tower's embeddings replace."
  video_token_id: int | None = None
  "VLMs: the video placeholder token (``<|video_pad|>``; videos are refused)."
  vision_start_token_id: int | None = None
  "VLMs: ``<|vision_start|>``."
  vision_end_token_id: int | None = None
  "VLMs: ``<|vision_end|>``."

  def __post_init__(self):
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", _rope_scaling_from_mapping(self.rope_scaling, "rope_scaling"))
    if self.head_dim is None and _is_pos_int(self.hidden_size) and _is_pos_int(self.num_heads):
      if self.hidden_size % self.num_heads:
        raise ValueError(
            f"head_dim: None needs hidden_size ({self.hidden_size}) divisible by num_heads ({self.num_heads})")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model_type: {self.model_type!r} is not one of {list(MODEL_TYPES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
      if not _is_pos_int(getattr(self, name)):
        raise ValueError(f"{name}: must be a positive int, got {getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads: {self.num_kv_heads} does not divide num_heads ({self.num_heads})")
    for name in ("rms_norm_eps", "rope_theta"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}: must be a positive number, got {value!r}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling: must be None, a RopeScaling or a mapping, got {self.rope_scaling!r}")
    for name in ("tie_word_embeddings", "attention_bias", "qk_norm", "scan_layers", "attention_interpret"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
    if self.attention_bias != (self.model_type in QKV_BIAS_TYPES):
      raise ValueError(
          f"attention_bias: {self.attention_bias!r} with model_type {self.model_type!r}; q/k/v bias is "
          "always on for qwen2 (and the VLMs) and unsupported for llama/qwen3 (their HF bias also covers o_proj)")
    if self.qk_norm != (self.model_type == "qwen3"):
      raise ValueError(
          f"qk_norm: {self.qk_norm!r} with model_type {self.model_type!r}; q/k norm is always on for "
          "qwen3 and absent from llama/qwen2")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {list(DTYPES)}")
    if self.scan_unroll is not True and not _is_pos_int(self.scan_unroll):
      raise ValueError(f"scan_unroll: must be a positive int or true (fully unrolled), got {self.scan_unroll!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat: {self.remat!r} is not one of {list(REMAT_POLICIES)}")
    if self.attention_impl not in kernels.IMPLS:
      raise ValueError(f"attention_impl: {self.attention_impl!r} is not one of {list(kernels.IMPLS)}")
    if self.mrope_section is not None:
      object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
    _vl_config.validate(self)

  # ----------------------------------------------------------------------------------------------
  # Derived values

  @property
  def jnp_dtype(self) -> jnp.dtype:
    """Compute dtype as a ``jnp.dtype``."""
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self) -> jnp.dtype:
    """Parameter dtype as a ``jnp.dtype``."""
    return jnp.dtype(self.param_dtype)

  @property
  def layer_unroll(self) -> int:
    """Blocks per iteration of the scanned layer loop: :attr:`scan_unroll` resolved (``True`` → all of them),
    at most :attr:`num_layers`."""
    return self.num_layers if self.scan_unroll is True else min(self.scan_unroll, self.num_layers)

  @property
  def remat_policy(self) -> Callable[..., bool] | None:
    """The ``jax.checkpoint_policies`` entry for :attr:`remat` (``None`` when ``remat='none'``)."""
    return {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[self.remat]

  def num_params(self) -> int:
    """Number of parameters, counting a tied embedding once.

    ``V·D (+ V·D untied) + D + L·(D·N·H + 2·D·K·H + N·H·D + 3·D·F + 2·D + bias + qk_norm)`` with
    ``bias = N·H + 2·K·H`` (qwen2 and the VLMs) and ``qk_norm = 2·H`` (qwen3), plus the vision tower's
    :attr:`VisionConfig.num_params` for a VLM.
    """
    d, h, n, k, f, v = (self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                        self.intermediate_size, self.vocab_size)
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * d
    if self.attention_bias:
      per_layer += n * h + 2 * k * h
    if self.qk_norm:
      per_layer += 2 * h
    embed = v * d * (1 if self.tie_word_embeddings else 2)
    tower = 0 if self.vision is None else self.vision.num_params
    return embed + d + self.num_layers * per_layer + tower

  def flops_per_token(self, seq_len: int, *, training: bool = True, patches_per_token: float = 0.0,
                      patches_per_image: int = 0) -> float:
    """Matmul FLOPs per token of a causal sequence of ``seq_len`` tokens.

    Forward: ``2·P + 2·L·N·H·seq_len`` where ``P`` counts the weights of every matmul (projections,
    MLP and the output head, not the embedding lookup) and the second term is ``q·kᵀ`` plus
    ``p·v`` (``2·N·H`` FLOPs each per visible key) over the ``seq_len / 2`` keys a causal query
    sees on average. Training (forward + backward) is three times the forward (Kaplan et al. 2020;
    PaLM appendix B). A VLM adds ``patches_per_token`` times the tower's forward FLOPs per patch
    (:func:`jaxrl.models._vl_config.vision_flops_per_patch`; each image token stands for ``m²`` patches).

    Args:
      seq_len: tokens per sequence.
      training: count the backward pass too.
      patches_per_token: vision patches per language-model token (VLMs; e.g. ``m² · image tokens / tokens``).
      patches_per_image: patches of one image (sets the tower's attention span).

    Returns:
      FLOPs per token as a float.
    """
    d, h, n, k, f, v = (self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                        self.intermediate_size, self.vocab_size)
    matmul_params = self.num_layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f) + v * d
    forward = 2.0 * matmul_params + 2.0 * self.num_layers * n * h * seq_len
    if patches_per_token:
      if self.vision is None:
        raise ValueError(f"patches_per_token: {patches_per_token!r} for model_type {self.model_type!r}, which has "
                         "no vision tower")
      if patches_per_image <= 0:
        raise ValueError(f"patches_per_image: must be positive with patches_per_token, got {patches_per_image!r}")
      forward += patches_per_token * _vl_config.vision_flops_per_patch(self.vision, patches_per_image)
    return 3.0 * forward if training else forward

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], *, source: str = "config.json", **overrides) -> ModelConfig:
    """Builds a config from a Hugging Face ``config.json`` mapping.

    Reads both layouts: transformers 4 (``rope_theta`` plus ``rope_scaling`` with ``rope_type`` or
    ``type``) and transformers 5 (``rope_parameters: {rope_type, rope_theta, factor, ...}``); for the
    VLMs both the hub's flat layout and transformers 5's nested ``text_config``
    (:func:`jaxrl.models._vl_config.from_hf`).

    Args:
      hf: the parsed ``config.json``.
      source: how to name the file in errors (e.g. its path).
      **overrides: ModelConfig fields to set on top (dtype, scan_layers, remat, ...).

    Returns:
      The ModelConfig. Raises ValueError naming ``source`` and the key for anything unsupported.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
      raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {list(MODEL_TYPES)}")
    vl = {}
    if model_type in VL_MODEL_TYPES:
      hf, vl = _vl_config.from_hf(hf, source=source)
      model_type = hf["model_type"]

    def need(key):
      if key not in hf or hf[key] is None:
        raise ValueError(f"{source}: missing required key {key!r} (model_type {model_type!r})")
      return hf[key]

    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported; only 'silu'")
    if hf.get("mlp_bias", False):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    if model_type in ("llama", "qwen3") and hf.get("attention_bias", False):
      raise ValueError(f"{source}: attention_bias=true is not supported for {model_type} (o_proj bias)")
    if hf.get("use_sliding_window", False):
      raise ValueError(f"{source}: use_sliding_window=true is not supported")
    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is None:
      head_dim = 128 if model_type == "qwen3" else hidden // num_heads
    max_pos = hf.get("max_position_embeddings", 4096)
    rope_theta, rope_scaling = _parse_rope(hf, source, max_pos)
    kwargs = dict(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
    )
    kwargs.update(vl)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown ModelConfig fields in overrides: {sorted(unknown)}")
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_config(self, *, torch_dtype: str | None = None, **extra) -> dict[str, Any]:
    """A ``config.json`` mapping that ``transformers.AutoConfig`` loads to this architecture.

    RoPE is written in both layouts (``rope_theta``/``rope_scaling`` for transformers 4 and
    ``rope_parameters`` for transformers 5) so either version reads it. A VLM is written in the hub's
    flat layout with ``vision_config`` (:func:`jaxrl.models._vl_config.to_hf`).

    Args:
      torch_dtype: dtype name stored as ``torch_dtype``/``dtype`` (default: ``param_dtype``).
      **extra: further keys (``bos_token_id``, ``eos_token_id``, ...) copied verbatim.
    """
    dtype = torch_dtype or self.param_dtype
    rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
    if self.rope_scaling is not None:
      rope_parameters = {**self.rope_scaling.to_dict(), "rope_theta": float(self.rope_theta)}
    hf = {
        "architectures": [ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": float(self.rope_theta),
        "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_dict(),
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if self.model_type == "llama":
      hf.update(attention_bias=False, mlp_bias=False)
    elif self.model_type == "qwen3":
      hf.update(attention_bias=False, use_sliding_window=False)
    else:
      hf.update(use_sliding_window=False)
    if self.vision is not None:
      hf = _vl_config.to_hf(self, hf)
    hf.update(extra)
    return hf

  # ----------------------------------------------------------------------------------------------
  # Presets: published shapes of real checkpoints.

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A 2-layer GQA model for tests and laptops (vocab 512, width 64, 4 heads over 2 kv heads)."""
    return cls(**{**dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=2048), **overrides})

  @classmethod
  def qwen2p5_0p5b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2.5-0.5B."""
    return cls._qwen2(dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                           num_kv_heads=2, max_position_embeddings=32768, tie_word_embeddings=True), overrides)

  @classmethod
  def qwen2p5_1p5b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2.5-1.5B."""
    return cls._qwen2(dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                           num_kv_heads=2, max_position_embeddings=131072, tie_word_embeddings=True), overrides)

  @classmethod
  def qwen2p5_7b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2.5-7B."""
    return cls._qwen2(dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                           num_kv_heads=4, max_position_embeddings=131072, tie_word_embeddings=False), overrides)

  @classmethod
  def deepseek_r1_distill_qwen_1p5b(cls, **overrides) -> ModelConfig:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (Qwen2.5-Math-1.5B shapes, rope_theta 1e4, untied)."""
    return cls._qwen2(dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                           num_heads=12, num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=131072,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def deepseek_r1_distill_qwen_7b(cls, **overrides) -> ModelConfig:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-Math-7B shapes, rope_theta 1e4)."""
    return cls._qwen2(dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                           num_heads=28, num_kv_heads=4, rope_theta=10000.0, max_position_embeddings=131072,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def deepseek_r1_distill_qwen_14b(cls, **overrides) -> ModelConfig:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-14B (Qwen2.5-14B shapes)."""
    return cls._qwen2(dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                           num_heads=40, num_kv_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def qwen3_0p6b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-0.6B."""
    return cls._qwen3(dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                           tie_word_embeddings=True), overrides)

  @classmethod
  def qwen3_1p7b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-1.7B."""
    return cls._qwen3(dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                           tie_word_embeddings=True), overrides)

  @classmethod
  def qwen3_4b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-4B."""
    return cls._qwen3(dict(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8,
                           tie_word_embeddings=True), overrides)

  @classmethod
  def qwen3_8b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-8B."""
    return cls._qwen3(dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def qwen3_14b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-14B."""
    return cls._qwen3(dict(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40, num_kv_heads=8,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def qwen3_32b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen3-32B."""
    return cls._qwen3(dict(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8,
                           tie_word_embeddings=False), overrides)

  @classmethod
  def llama3p1_8b(cls, **overrides) -> ModelConfig:
    """meta-llama/Llama-3.1-8B (Llama-3 RoPE scaling: factor 8 from an 8192 context)."""
    return cls(**{**dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False), **overrides})

  @classmethod
  def tiny_vl(cls, kind: str = "qwen2_5_vl", **overrides) -> ModelConfig:
    """A tiny VLM for tests (the HF fixtures' shapes): the :meth:`tiny` decoder as Qwen2 with M-RoPE
    ``(2, 3, 3)`` over head_dim 16, and a 4-block tower (width 32, 2 heads; Qwen2.5-VL: windows of 2x2
    merged units, full attention in blocks 1 and 3). Special tokens are the last four ids of the vocab."""
    if kind not in VL_MODEL_TYPES:
      raise ValueError(f"kind: {kind!r} is not one of {list(VL_MODEL_TYPES)}")
    vision = VisionConfig(kind=kind, depth=4, hidden_size=32, num_heads=2, out_hidden_size=64,
                          intermediate_size=64, window_size=56,
                          fullatt_block_indexes=(1, 3) if kind == "qwen2_5_vl" else ())
    base = dict(model_type=kind, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=1000000.0, max_position_embeddings=2048, attention_bias=True,
                mrope_section=(2, 3, 3), vision=vision, vision_start_token_id=508, vision_end_token_id=509,
                image_token_id=510, video_token_id=511)
    return cls(**{**base, **overrides})

  @classmethod
  def qwen2p5_vl_3b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2.5-VL-3B-Instruct (config.json: hidden 2048, intermediate 11008, 36 layers, 16/2 heads,
    vocab 151936, tied, rope_theta 1e6, max_position_embeddings 128000, mrope_section [16, 24, 24]; tower
    depth 32, hidden 1280, intermediate 3420, 16 heads, window 112, full attention in blocks 7/15/23/31)."""
    return cls._qwen2_5_vl(dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                                num_heads=16, num_kv_heads=2, tie_word_embeddings=True), overrides)

  @classmethod
  def qwen2p5_vl_7b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2.5-VL-7B-Instruct (config.json: hidden 3584, intermediate 18944, 28 layers, 28/4 heads,
    vocab 152064, untied, rope_theta 1e6, max_position_embeddings 128000, mrope_section [16, 24, 24]; the
    3B's tower with out_hidden_size 3584)."""
    return cls._qwen2_5_vl(dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                                num_heads=28, num_kv_heads=4, tie_word_embeddings=False), overrides)

  @classmethod
  def qwen2_vl_2b(cls, **overrides) -> ModelConfig:
    """Qwen/Qwen2-VL-2B-Instruct (config.json: hidden 1536, intermediate 8960, 28 layers, 12/2 heads,
    vocab 151936, tied, rope_theta 1e6, max_position_embeddings 32768, mrope_section [16, 24, 24]; tower
    depth 32, embed_dim 1280, mlp_ratio 4, 16 heads, hidden_size (merger output) 1536, no windows)."""
    return cls._qwen2(dict(model_type="qwen2_vl", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                           num_layers=28, num_heads=12, num_kv_heads=2, max_position_embeddings=32768,
                           tie_word_embeddings=True, mrope_section=(16, 24, 24), vision=VisionConfig.qwen2_vl_2b(),
                           **_vl_config.HF_TOKEN_DEFAULTS), overrides)

  @classmethod
  def _qwen2_5_vl(cls, shapes, overrides) -> ModelConfig:
    vision = VisionConfig.qwen2p5_vl_3b(out_hidden_size=shapes["hidden_size"])
    return cls._qwen2(dict(model_type="qwen2_5_vl", max_position_embeddings=128000, mrope_section=(16, 24, 24),
                           vision=vision, **_vl_config.HF_TOKEN_DEFAULTS, **shapes), overrides)

  @classmethod
  def _qwen2(cls, shapes, overrides) -> ModelConfig:
    base = dict(model_type="qwen2", head_dim=shapes["hidden_size"] // shapes["num_heads"], rms_norm_eps=1e-6,
                rope_theta=1000000.0, attention_bias=True)
    return cls(**{**base, **shapes, **overrides})

  @classmethod
  def _qwen3(cls, shapes, overrides) -> ModelConfig:
    base = dict(model_type="qwen3", vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=40960, qk_norm=True)
    return cls(**{**base, **shapes, **overrides})


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "qwen2p5_0p5b": ModelConfig.qwen2p5_0p5b,
    "qwen2p5_1p5b": ModelConfig.qwen2p5_1p5b,
    "qwen2p5_7b": ModelConfig.qwen2p5_7b,
    "qwen3_0p6b": ModelConfig.qwen3_0p6b,
    "qwen3_1p7b": ModelConfig.qwen3_1p7b,
    "qwen3_4b": ModelConfig.qwen3_4b,
    "qwen3_8b": ModelConfig.qwen3_8b,
    "qwen3_14b": ModelConfig.qwen3_14b,
    "qwen3_32b": ModelConfig.qwen3_32b,
    "llama3p1_8b": ModelConfig.llama3p1_8b,
    "deepseek_r1_distill_qwen_1p5b": ModelConfig.deepseek_r1_distill_qwen_1p5b,
    "deepseek_r1_distill_qwen_7b": ModelConfig.deepseek_r1_distill_qwen_7b,
    "deepseek_r1_distill_qwen_14b": ModelConfig.deepseek_r1_distill_qwen_14b,
    "tiny_vl": ModelConfig.tiny_vl,
    "qwen2p5_vl_3b": ModelConfig.qwen2p5_vl_3b,
    "qwen2p5_vl_7b": ModelConfig.qwen2p5_vl_7b,
    "qwen2_vl_2b": ModelConfig.qwen2_vl_2b,
}
"""Preset name -> named constructor (each accepts field overrides as keywords)."""


def _is_pos_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _rope_scaling_from_mapping(m: Mapping[str, Any], where: str) -> RopeScaling:
  fields = {f.name for f in dataclasses.fields(RopeScaling)}
  m = dict(m)
  if "type" in m and "rope_type" not in m:
    m["rope_type"] = m.pop("type")
  m.pop("type", None)
  m.pop("rope_theta", None)
  unknown = set(m) - fields
  if unknown:
    raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(fields)}")
  missing = fields - set(m) - {"rope_type"}
  if missing:
    raise ValueError(f"{where}: missing keys {sorted(missing)}")
  return RopeScaling(**m)


def _parse_rope(hf: Mapping[str, Any], source: str, max_pos: int) -> tuple[float, RopeScaling | None]:
  """(rope_theta, rope_scaling) from either config.json layout."""
  params = hf.get("rope_parameters")
  key = "rope_parameters"
  if not params:
    params, key = hf.get("rope_scaling"), "rope_scaling"
  params = dict(params or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"{source}: partial_rotary_factor {partial!r} is not supported")
  rope_type = params.pop("rope_type", params.pop("type", "default"))
  params.pop("type", None)
  if rope_type == "default":
    extra = {k: v for k, v in params.items() if v is not None}
    if extra:
      raise ValueError(f"{source}: {key} has rope_type 'default' but also {sorted(extra)}")
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(f"{source}: {key}.rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'")
  params.setdefault("original_max_position_embeddings", max_pos)
  return float(theta), _rope_scaling_from_mapping({"rope_type": "llama3", **params}, f"{source}: {key}")
