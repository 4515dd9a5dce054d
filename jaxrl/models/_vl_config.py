"""The vision-language part of :class:`jaxrl.models.ModelConfig`: validation, ``config.json`` layouts, FLOPs.

A Qwen2.5-VL / Qwen2-VL ``config.json`` comes in two layouts, both read here:

- the hub's flat layout (``Qwen/Qwen2.5-VL-7B-Instruct``): the language model's keys at the top level,
  ``rope_scaling: {type: mrope, mrope_section: [...]}`` and ``rope_theta`` beside them;
- transformers 5's nested layout: ``text_config: {..., rope_parameters: {rope_type, mrope_section,
  rope_theta}}``, with ``tie_word_embeddings`` and the special token ids at the top level.

Both carry ``vision_config`` (read by :meth:`VisionConfig.from_hf`). We write the hub layout, with RoPE in
both spellings (``rope_scaling`` and ``rope_parameters``) so transformers 4 and 5 read it. Reference:
transformers 5 ``Qwen2_5_VLConfig`` / ``Qwen2VLConfig`` (``configuration_qwen2_5_vl.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.models._vision import VisionConfig

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
VL_ARCHITECTURES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
HF_TOKEN_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                     "vision_end_token_id": 151653}
"""transformers' defaults for the special token ids (the Qwen2-VL / Qwen2.5-VL tokenizer's)."""
_HF_TEXT_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "rope_theta": 1000000.0}
"""``Qwen2_5_VLTextConfig`` defaults that differ from a text config's, used when a key is absent."""


def validate(cfg) -> None:
  """Checks the VLM fields of a :class:`ModelConfig` (``cfg``): all set for a VLM, all None otherwise."""
  vl = cfg.model_type in VL_MODEL_TYPES
  fields = ("mrope_section", "vision", *TOKEN_FIELDS)
  if not vl:
    given = [f for f in fields if getattr(cfg, f) is not None]
    if given:
      raise ValueError(f"{given[0]}: only vision-language models ({list(VL_MODEL_TYPES)}) take it; "
                       f"model_type is {cfg.model_type!r}")
    return
  missing = [f for f in fields if getattr(cfg, f) is None]
  if missing:
    raise ValueError(f"{missing[0]}: required for model_type {cfg.model_type!r}")
  section = cfg.mrope_section
  if len(section) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in section):
    raise ValueError(f"mrope_section: must be three positive ints (temporal, height, width), got {section!r}")
  if sum(section) != cfg.head_dim // 2:
    raise ValueError(f"mrope_section: {list(section)} sums to {sum(section)}, but it must cover the "
                     f"head_dim // 2 = {cfg.head_dim // 2} rotary frequencies")
  if not isinstance(cfg.vision, VisionConfig):
    raise ValueError(f"vision: must be a VisionConfig, got {type(cfg.vision).__name__}")
  if cfg.vision.kind != cfg.model_type:
    raise ValueError(f"vision.kind: {cfg.vision.kind!r} does not match model_type {cfg.model_type!r}")
  if cfg.vision.out_hidden_size != cfg.hidden_size:
    raise ValueError(f"vision.out_hidden_size: {cfg.vision.out_hidden_size} must equal hidden_size "
                     f"{cfg.hidden_size} (the merger's output replaces token embeddings)")
  if cfg.rope_scaling is not None:
    raise ValueError("rope_scaling: Llama-3 scaling is not supported with M-RoPE (VLMs)")
  for f in TOKEN_FIELDS:
    value = getattr(cfg, f)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.vocab_size:
      raise ValueError(f"{f}: must be an int in [0, vocab_size={cfg.vocab_size}), got {value!r}")
  if len({getattr(cfg, f) for f in TOKEN_FIELDS}) != len(TOKEN_FIELDS):
    raise ValueError(f"{', '.join(TOKEN_FIELDS)}: must be four different ids")


def from_hf(hf: Mapping[str, Any], *, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Splits a VLM ``config.json`` (either layout) into a Qwen2 text config and the VLM fields.

  Returns:
    ``(text, vl)``: ``text`` a flat ``config.json`` of the language model with ``model_type: qwen2`` and
    plain RoPE (what :meth:`ModelConfig.from_hf_config` parses for text models); ``vl`` the
    :class:`ModelConfig` fields ``model_type``, ``mrope_section``, ``vision`` and the token ids.
  """
  model_type = hf["model_type"]
  nested = hf.get("text_config")
  if nested is not None and not isinstance(nested, Mapping):
    raise ValueError(f"{source}: text_config must be a mapping, got {type(nested).__name__}")
  text = dict(nested) if nested else {k: v for k, v in hf.items() if k != "vision_config"}
  for key, value in _HF_TEXT_DEFAULTS.items():
    text.setdefault(key, value)
  where = f"{source}: text_config" if nested else source
  text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
  rope = text.get("rope_parameters") or text.get("rope_scaling")
  if not isinstance(rope, Mapping) or "mrope_section" not in rope:
    raise ValueError(f"{where}: missing rope_parameters.mrope_section (or rope_scaling.mrope_section), which "
                     f"model_type {model_type!r} needs")
  rope = dict(rope)
  section = rope.pop("mrope_section")
  if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
    raise ValueError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported with "
                     "M-RoPE; only 'default'/'mrope'")
  rope.pop("type", None)
  rope["rope_type"] = "default"
  rope.setdefault("rope_theta", text.get("rope_theta", _HF_TEXT_DEFAULTS["rope_theta"]))
  text.pop("rope_scaling", None)
  text["rope_parameters"] = rope
  text["model_type"] = "qwen2"
  vision = hf.get("vision_config")
  if not isinstance(vision, Mapping):
    raise ValueError(f"{source}: missing vision_config (a mapping), which model_type {model_type!r} needs")
  if not isinstance(section, (list, tuple)):
    raise ValueError(f"{where}: mrope_section must be a list of three ints, got {section!r}")
  vl = {"model_type": model_type, "mrope_section": tuple(section),
        "vision": VisionConfig.from_hf(vision, source=f"{source}: vision_config")}
  for f in TOKEN_FIELDS:
    vl[f] = hf.get(f, text.get(f, HF_TOKEN_DEFAULTS[f]))
  return text, vl


def to_hf(cfg, text: dict[str, Any]) -> dict[str, Any]:
  """The hub-layout ``config.json`` of a VLM ``cfg``, given ``text``, its language model's flat config."""
  section = list(cfg.mrope_section)
  hf = dict(text)
  hf.update(
      architectures=[VL_ARCHITECTURES[cfg.model_type]],
      model_type=cfg.model_type,
      rope_scaling={"type": "mrope", "mrope_section": section},
      rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": float(cfg.rope_theta)},
      vision_config=cfg.vision.to_hf(),
      **{f: getattr(cfg, f) for f in TOKEN_FIELDS},
  )
  return hf


def vision_flops_per_patch(vision: VisionConfig, patches_per_image: int) -> float:
  """Forward matmul FLOPs of the tower per input patch, for images of ``patches_per_image`` patches.

  ``2·(C·T·P²·E + depth·(4·E² + k·E·I) + (m²E)² / m² + m²E·D_out / m²)`` for the patch embedding, each
  block's qkv/output projections and MLP (``k = 3``: Qwen2.5-VL's SwiGLU; ``k = 2``: Qwen2-VL's fc1/fc2)
  and the merger's two layers (run once per ``m²`` patches), plus ``4·E`` per visible key per block
  (``q·kᵀ`` and ``p·v``, bidirectional): all of the image's patches in full-attention blocks, a window's
  ``(window_size / P)²`` (at most the image) in windowed ones.
  """
  e, i, m2 = vision.hidden_size, vision.intermediate_size, vision.spatial_merge_size ** 2
  mlp = 3 if vision.kind == "qwen2_5_vl" else 2
  weights = vision.patch_dim * e + vision.depth * (4 * e * e + mlp * e * i) + (m2 * e) ** 2 // m2 \
      + e * vision.out_hidden_size
  if vision.kind == "qwen2_5_vl":
    window = min((vision.window_size // vision.patch_size) ** 2, patches_per_image)
    full = len(vision.fullatt_block_indexes)
    keys = full * patches_per_image + (vision.depth - full) * window
  else:
    keys = vision.depth * patches_per_image
  return 2.0 * weights + 4.0 * e * keys
