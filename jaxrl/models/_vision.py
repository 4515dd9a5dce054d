"""The Qwen2.5-VL and Qwen2-VL vision towers: the NNX module and its HF parameter names.

The config is :mod:`jaxrl.models._vision_config`, the host-side patch layout :mod:`jaxrl.models._vision_layout`.

The tower turns each batch row's patches ``[R, P, C·T·P·P]`` (the processor's ``pixel_values`` of the
row's images, concatenated in token order and zero-padded to a per-row bucket ``P``) into merged
embeddings ``[R, P / m², D_out]`` that replace the row's image placeholder tokens in the language model:

* patch embedding: a linear map over ``C·T·P·P`` (HF's ``Conv3d`` with stride = kernel);
* ``depth`` pre-norm blocks ``x += proj(attn(norm1(x))); x += mlp(norm2(x))`` with 2-D rotary
  embeddings (row, column of each patch) and bidirectional attention through
  :func:`jaxrl.kernels.attention` (``causal=False``);
* Qwen2.5-VL: RMSNorm, a SwiGLU MLP with biases, and window attention: merged units are reordered into
  windows of ``window_size / (m·P)`` units a side, every block but those in ``fullatt_block_indexes``
  attends within a window; the full-attention blocks attend within an image frame;
* Qwen2-VL: LayerNorm, a QuickGELU ``fc1``/``fc2`` MLP, every block attends within an image frame;
* patch merger: norm, then the ``m²`` patches of each merged unit concatenated and sent through
  ``Linear -> GELU(exact) -> Linear``; the window permutation is undone so rows come out in image-token
  order.

Both attention kinds are segment-id masks over each row's packed patch sequence, so the tower runs a
batch of ``R`` patch sequences (one per token row, sharded and micro-batched with the rows) in one call
with fixed (bucketed) shapes; :func:`vision_layout` builds one row's masks, window order and rotary
positions on the host, :func:`batch_vision_inputs` a batch's. A row without images is all padding
(segment 0, zero output) and needs no dummy image: every parameter's gradient comes from the same jitted
program on every device, zero where unused, so there is no FSDP-style gradient hook to keep in step.

Reference: transformers 5 ``modeling_qwen2_5_vl.py`` (``Qwen2_5_VisionTransformerPretrainedModel``),
``modeling_qwen2_vl.py`` (``Qwen2VisionTransformerPretrainedModel``) and ``vision_utils.py``
(``get_vision_window_index``, ``get_vision_position_ids``, ``get_vision_cu_seqlens``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import kernels
from jaxrl.models._lora_forward import add_lora
from jaxrl.models._vision_config import VISION_KINDS, VisionConfig  # noqa: F401 (re-exported)
from jaxrl.models._vision_layout import (  # noqa: F401 (re-exported)
    VISION_LAYOUT_KEYS,
    VisionInputs,
    VisionLayout,
    batch_vision_inputs,
    pad_patch_rows,
    stack_layouts,
    vision_layout,
)

_INIT_STD = 0.02


# --------------------------------------------------------------------------------------------------
# The module


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
  """A parameter annotated with logical axis names (as the language model's; placement is elsewhere)."""
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
  return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class VisionNorm(nnx.Module):
  """RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL) over the last axis, in float32.

  ``rms: x / sqrt(mean(x²) + eps) · scale``; ``layer: (x - mean) / sqrt(var + eps) · scale + bias``.
  """

  def __init__(self, dim: int, *, layer_norm: bool, eps: float, param_dtype):
    self.scale = _param(jnp.ones((dim,), param_dtype), ("norm",))
    self.bias = _param(jnp.zeros((dim,), param_dtype), ("norm",)) if layer_norm else None
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., E] -> [..., E]
    x32 = x.astype(jnp.float32)
    if self.bias is not None:
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps) * self.scale[...].astype(
        jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


class VisionBlock(nnx.Module):
  """One tower block: ``x += proj(attn(norm1(x))); x += mlp(norm2(x))`` with 2-D RoPE on q and k."""

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    e, n, h, f, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size, param_dtype
    layer_norm = cfg.kind == "qwen2_vl"
    self.dtype = dtype
    self.norm1 = VisionNorm(e, layer_norm=layer_norm, eps=cfg.norm_eps, param_dtype=pd)
    self.norm2 = VisionNorm(e, layer_norm=layer_norm, eps=cfg.norm_eps, param_dtype=pd)
    self.qkv = _param(_normal(rngs, (e, 3, n, h), pd), ("embed", None, "heads", "head_dim"))
    self.qkv_bias = _param(jnp.zeros((3, n, h), pd), (None, "heads", "head_dim"))
    self.proj = _param(_normal(rngs, (n, h, e), pd), ("heads", "head_dim", "embed"))
    self.proj_bias = _param(jnp.zeros((e,), pd), ("norm",))
    up, down = (("gate", "up"), "down") if cfg.kind == "qwen2_5_vl" else (("fc1",), "fc2")
    for name in up:
      setattr(self, name, _param(_normal(rngs, (e, f), pd), ("embed", "mlp")))
      setattr(self, name + "_bias", _param(jnp.zeros((f,), pd), ("mlp",)))
    setattr(self, down, _param(_normal(rngs, (f, e), pd), ("mlp", "embed")))
    setattr(self, down + "_bias", _param(jnp.zeros((e,), pd), ("norm",)))

  def _w(self, name: str) -> jax.Array:
    return getattr(self, name)[...].astype(self.dtype)

  def mlp(self, x: jax.Array) -> jax.Array:  # [R, P, E] -> [R, P, E]
    """SwiGLU ``(silu(x·Wg + bg) ⊙ (x·Wu + bu))·Wd + bd`` (Qwen2.5-VL) or QuickGELU
    ``g(x·W1 + b1)·W2 + b2``, ``g(z) = z·sigmoid(1.702 z)`` (Qwen2-VL)."""
    if hasattr(self, "gate"):
      gate, up = self._linear("gate", x), self._linear("up", x)
      return self._linear("down", jax.nn.silu(gate) * up)
    z = self._linear("fc1", x)
    return self._linear("fc2", z * jax.nn.sigmoid(1.702 * z))

  def _linear(self, name: str, x: jax.Array) -> jax.Array:  # [..., K] -> [..., F]
    """``x·W + b`` of the 2-D weight ``name`` (plus its LoRA term, :func:`add_lora`)."""
    return add_lora(self, name, x, jnp.einsum("...k,kf->...f", x, self._w(name))) + self._w(name + "_bias")

  def __call__(self, x, *, cos, sin, segments, placement=None, attention_impl="auto", interpret=False):
    """``x [R, P, E]`` -> ``[R, P, E]``; ``cos``/``sin [R, P, H]`` rotary tables, ``segments [R, P]`` the
    attention mask (each row's patch sequence attends within itself)."""
    with jax.named_scope("attention"):
      h = self.norm1(x)  # [R, P, E]
      qkv = add_lora(self, "qkv", h, jnp.einsum("rpe,ecnh->rpcnh", h, self._w("qkv")))  # [R, P, 3, N, H]
      qkv = qkv + self._w("qkv_bias")
      q, k = (_rotate(qkv[:, :, i], cos, sin) for i in (0, 1))
      attend = kernels.attention if placement is None else placement.attention
      out = attend(q, k, qkv[:, :, 2], segment_ids=segments, causal=False, impl=attention_impl,
                   interpret=interpret)  # [R, P, N, H]
      x = x + add_lora(self, "proj", out, jnp.einsum("rpnh,nhe->rpe", out, self._w("proj"))) + self._w("proj_bias")
    with jax.named_scope("mlp"):
      return x + self.mlp(self.norm2(x))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:  # [R, P, N, H] -> [R, P, N, H]
  """``x·cos + rotate_half(x)·sin`` in float32 (HF ``apply_rotary_pos_emb_vision``)."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


def rotary_tables(rotary: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
  """``cos, sin [..., P, H]`` float32 of the 2-D RoPE at (row, column) ``rotary [..., P, 2]``.

  ``inv_freq_j = θ^(-2j / (H/2))`` for ``j < H/4``; angles ``[row·inv_freq, col·inv_freq]`` (H/2) repeated
  twice to cover the head (HF ``Qwen2_5_VLVisionRotaryEmbedding``).
  """
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [H/4]
  angles = (rotary.astype(jnp.float32)[..., None] * inv_freq).reshape(*rotary.shape[:-1], half)  # [..., P, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


class PatchMerger(nnx.Module):
  """``fc2(gelu(fc1(concat_{m²}(norm(x)))))``: one output row per merged unit; exact (erf) GELU."""

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    e, m2, pd = cfg.hidden_size, cfg.spatial_merge_size ** 2, param_dtype
    self.dtype = dtype
    self.norm = VisionNorm(e, layer_norm=cfg.kind == "qwen2_vl", eps=cfg.norm_eps, param_dtype=pd)
    self.fc1 = _param(_normal(rngs, (m2 * e, m2 * e), pd), ("embed", "mlp"))
    self.fc1_bias = _param(jnp.zeros((m2 * e,), pd), ("mlp",))
    self.fc2 = _param(_normal(rngs, (m2 * e, cfg.out_hidden_size), pd), ("mlp", "embed"))
    self.fc2_bias = _param(jnp.zeros((cfg.out_hidden_size,), pd), ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:  # [R, P, E] -> [R, P / m², D_out]
    e = self.fc1.shape[0]
    h = self.norm(x).reshape(x.shape[0], -1, e)  # [R, U, m²E]
    h = jax.nn.gelu(self._linear("fc1", h), approximate=False)  # [R, U, m²E]
    return self._linear("fc2", h)

  def _linear(self, name: str, x: jax.Array) -> jax.Array:  # [..., K] -> [..., F]
    """``x·W + b`` of ``fc1`` / ``fc2`` (plus its LoRA term, :func:`add_lora`)."""
    w, b = (getattr(self, n)[...].astype(self.dtype) for n in (name, name + "_bias"))
    return add_lora(self, name, x, jnp.einsum("...k,kf->...f", x, w)) + b


class VisionTower(nnx.Module):
  """The Qwen2.5-VL / Qwen2-VL vision encoder: per-row patches ``[R, P, C·T·P·P]`` -> merged rows
  ``[R, P/m², D_out]``.

  Example::

      tower = VisionTower(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
      images = batch_vision_inputs(pixels, grid_thw, image_rows, cfg)  # pixels [R, 1024, patch_dim]
      rows = tower(jnp.asarray(images.pixel_values), jax.tree.map(jnp.asarray, images.layout))  # [R, 256, D_out]
  """

  def __init__(self, cfg: VisionConfig, *, param_dtype, dtype, scan_layers: bool = True, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    self.scan_layers = scan_layers
    c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
    self.patch_embed = _param(_normal(rngs, (c, t, p, p, cfg.hidden_size), param_dtype),
                              (None, None, None, None, "embed"))
    if scan_layers:
      keys = jax.random.split(rngs.params(), cfg.depth)
      make = nnx.vmap(lambda key: VisionBlock(cfg, param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(params=key)),
                      in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      self.blocks = make(keys)
    else:
      self.blocks = nnx.List([VisionBlock(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
                              for _ in range(cfg.depth)])
    self.merger = PatchMerger(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)

  def __call__(self, pixel_values, layout: VisionLayout, *, placement=None, attention_impl="auto",
               interpret=False, remat_policy=None) -> jax.Array:
    """Merged embeddings ``[R, U, D_out]`` of ``pixel_values [R, P, C·T·P·P]``, each row's in image-token
    (original) order.

    Rows of padding units (``image_segments == 0``) are zero. ``placement`` (the language model's
    :class:`~jaxrl.models.Placement`, or None) runs attention per shard; ``remat_policy`` (a
    ``jax.checkpoint_policies`` entry, e.g. ``ModelConfig.remat_policy``) rematerialises each block in
    the backward pass; None saves every activation.
    """
    cfg, m2 = self.cfg, self.cfg.spatial_merge_size ** 2
    want = (*layout.image_segments.shape, cfg.patch_dim)
    if layout.image_segments.ndim != 2 or tuple(pixel_values.shape) != want:
      raise ValueError(f"pixel_values: expected [R, P, patch_dim]={want} (the layout's rows and patches, "
                       f"C·T·P·P), got {tuple(pixel_values.shape)}; layouts need a leading row axis (stack_layouts)")
    num_rows, num_patches = want[:2]
    with jax.named_scope("patch_embed"):
      w = self.patch_embed[...].astype(self.dtype).reshape(cfg.patch_dim, cfg.hidden_size)
      x = jnp.einsum("rpk,ke->rpe", pixel_values.astype(self.dtype), w)  # [R, P, E]
      x = jnp.take_along_axis(x.reshape(num_rows, -1, m2, cfg.hidden_size), layout.window_index[:, :, None, None],
                              axis=1).reshape(num_rows, num_patches, -1)
    x = self._blocks(x, layout, remat_policy=remat_policy, placement=placement, attention_impl=attention_impl,
                     interpret=interpret)
    with jax.named_scope("merger"):
      merged = self.merger(x)  # [R, U, D_out], window order
      real = layout.image_segments.reshape(num_rows, -1, m2)[..., 0] > 0  # [R, U]
      merged = jnp.where(real[..., None], merged, 0)
      return jax.vmap(lambda m, order: jnp.zeros_like(m).at[order].set(m))(merged, layout.window_index)

  def _blocks(self, x, layout: VisionLayout, *, remat_policy, **kw) -> jax.Array:  # [R, P, E] -> [R, P, E]
    """Every block, scanned or looped; each takes the frame or the window segments (``full_attention``)."""
    cos, sin = rotary_tables(layout.rotary, self.cfg)
    full = jnp.asarray(self.cfg.full_attention)

    def block_fn(block, x, is_full):
      segments = jnp.where(is_full, layout.image_segments, layout.window_segments)
      return block(x, cos=cos, sin=sin, segments=segments, **kw)

    if remat_policy is not None:
      block_fn = nnx.remat(block_fn, policy=remat_policy, prevent_cse=not self.scan_layers)
    if self.scan_layers:
      scan = nnx.scan(lambda x, block, is_full: (block_fn(block, x, is_full), None), in_axes=(nnx.Carry, 0, 0),
                      out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
      with jax.named_scope("blocks"):
        return scan(x, self.blocks, full)[0]
    for i, block in enumerate(self.blocks):
      with jax.named_scope(f"block_{i}"):
        x = block_fn(block, x, full[i])
    return x


# --------------------------------------------------------------------------------------------------
# Hugging Face names


_VEC = ((1,), (0,))  # a 1-D tensor as is
_LINEAR = ((1, 1), (1, 0))  # HF [out, in] -> ours [in, out]
VISION_HF_LAYOUTS: dict[tuple[str, ...], tuple[str, tuple[int, ...], tuple[int, ...]]] = {
    ("patch_embed",): ("patch_embed.proj.weight", (1, 1, 1, 1, 1), (1, 2, 3, 4, 0)),  # [E, C, T, P, P]
    ("merger", "norm", "scale"): ("merger.ln_q.weight", *_VEC),
    ("merger", "norm", "bias"): ("merger.ln_q.bias", *_VEC),
    ("merger", "fc1"): ("merger.mlp.0.weight", *_LINEAR),
    ("merger", "fc1_bias"): ("merger.mlp.0.bias", *_VEC),
    ("merger", "fc2"): ("merger.mlp.2.weight", *_LINEAR),
    ("merger", "fc2_bias"): ("merger.mlp.2.bias", *_VEC),
    ("norm1", "scale"): ("blocks.{i}.norm1.weight", *_VEC),
    ("norm1", "bias"): ("blocks.{i}.norm1.bias", *_VEC),
    ("norm2", "scale"): ("blocks.{i}.norm2.weight", *_VEC),
    ("norm2", "bias"): ("blocks.{i}.norm2.bias", *_VEC),
    ("qkv",): ("blocks.{i}.attn.qkv.weight", (3, 1), (3, 0, 1, 2)),  # [3·N·H, E] -> [E, 3, N, H]
    ("qkv_bias",): ("blocks.{i}.attn.qkv.bias", (3,), (0, 1, 2)),
    ("proj",): ("blocks.{i}.attn.proj.weight", (1, 2), (1, 2, 0)),  # [E, N·H] -> [N, H, E]
    ("proj_bias",): ("blocks.{i}.attn.proj.bias", *_VEC),
    ("gate",): ("blocks.{i}.mlp.gate_proj.weight", *_LINEAR),
    ("gate_bias",): ("blocks.{i}.mlp.gate_proj.bias", *_VEC),
    ("up",): ("blocks.{i}.mlp.up_proj.weight", *_LINEAR),
    ("up_bias",): ("blocks.{i}.mlp.up_proj.bias", *_VEC),
    ("down",): ("blocks.{i}.mlp.down_proj.weight", *_LINEAR),
    ("down_bias",): ("blocks.{i}.mlp.down_proj.bias", *_VEC),
    ("fc1",): ("blocks.{i}.mlp.fc1.weight", *_LINEAR),
    ("fc1_bias",): ("blocks.{i}.mlp.fc1.bias", *_VEC),
    ("fc2",): ("blocks.{i}.mlp.fc2.weight", *_LINEAR),
    ("fc2_bias",): ("blocks.{i}.mlp.fc2.bias", *_VEC),
}
"""Our tower parameter paths -> ``(hf_name, groups, perm)`` in ``jaxrl.models._hf._Layout``'s convention
(``ours = reshape(hf, split).transpose(perm)``, HF dim ``i`` merging ``groups[i]`` split dims). Top-level
paths are relative to the tower, block paths (HF name with ``{i}``) relative to one block (``blocks``
holds them, stacked on a leading ``layers`` axis when scanned). HF names are relative to the tower: the
hub prefixes ``visual.``, transformers 5's modules ``model.visual.``. Each kind uses the subset its
modules hold (``norm*.bias`` and ``fc1``/``fc2``: Qwen2-VL; ``gate``/``up``/``down``: Qwen2.5-VL)."""
