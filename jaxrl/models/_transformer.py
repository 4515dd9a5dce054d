"""The decoder: one Flax NNX module for the Llama, Qwen2 and Qwen3 families and the Qwen-VL models.

Pre-norm blocks ``x += attn(rms(x)); x += mlp(rms(x))`` with grouped-query attention (through
:func:`jaxrl.kernels.attention` only), RoPE (plain or Llama-3 scaled), optional q/k/v bias (Qwen2)
and per-head q/k RMSNorm (Qwen3), a SwiGLU MLP and a tied or separate output head. Every parameter
carries logical axis names in its ``out_sharding`` metadata (``embed``, ``vocab``, ``mlp``,
``heads``, ``kv_heads``, ``head_dim``, ``layers``, ``norm``); :mod:`jaxrl.sharding` maps them to mesh
axes. Inputs are packed: ``tokens``, ``positions`` and ``segment_ids`` (0 = padding), each ``[B, T]``.

A vision-language model (``cfg.vision``) is this same module with a vision tower attached as ``visual``:
:meth:`Transformer.run` takes the batch's images per token row (:class:`VisionInputs`), runs the tower once and puts its
merged embeddings at the image placeholder tokens; ``rope_positions [B, T, 3]`` (M-RoPE,
:func:`jaxrl.models.mrope_positions`) feed the rotary embedding while the 1-D ``positions`` keep driving
causality and the KV cache.

A model placed on a mesh (:func:`jaxrl.models.shard_model`, or ``init_model`` / ``load_pretrained``
with ``mesh=``) holds a :class:`Placement` (the mesh and the logical rules). Its forward pass then
constrains activations to their logical sharding (``batch``, ``seq``, ``act_*``: the residual stream
is split by rows, so FSDP gathers weights rather than reducing activations) and runs Pallas attention
kernels per shard through :func:`jaxrl.kernels.sharded_attention`.

Reference: the Hugging Face ``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py``
(transformers 5), whose checkpoints :mod:`jaxrl.models._hf` reads and writes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import kernels
from jaxrl.models._cache import KVCache, mesh_axes, write_rows
from jaxrl.models._config import ModelConfig
from jaxrl.models._lora_forward import LORA_OFF, LORA_SUFFIXES, add_lora  # noqa: F401 (re-exported)
from jaxrl.models._mrope import apply_rope, mrope_axes, rope_frequencies
from jaxrl.models._vision import VisionInputs, VisionTower
from jaxrl.sharding import LogicalRules

INIT_STD = 0.02
"""Standard deviation of the normal initialiser (HF ``initializer_range``)."""


def _param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
  """A parameter annotated with logical axis names (never mesh axes); placement is done elsewhere."""
  if len(names) != value.ndim:
    raise ValueError(f"{len(names)} logical names {names} for a parameter of shape {value.shape}")
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
  return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a model lives: the mesh its parameters are on and the logical rules that placed them.

  Hashable (it is static model metadata, part of the ``GraphDef``). The forward pass uses it to
  constrain activations (:meth:`constrain`) and to run attention kernels per shard (:meth:`attention`).
  """

  mesh: jax.sharding.Mesh
  rules: LogicalRules

  def axes(self, name: str) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that logical axis ``name`` maps to."""
    return mesh_axes(self.mesh, self.rules, name)

  def constrain(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """``x`` constrained to the sharding of logical axes ``names`` (indivisible dims replicated)."""
    return jax.lax.with_sharding_constraint(x, self.rules.sharding(names, self.mesh, x.shape))

  def attention(self, q, k, v, **kwargs):
    """:func:`jaxrl.kernels.attention` on this mesh: kernels run under ``shard_map`` (rows over the
    ``batch`` axes, heads over the ``act_heads`` axes); the XLA reference is left to the partitioner."""
    if kernels.resolve_impl(kwargs.get("impl", "auto")) == "reference":
      return kernels.attention(q, k, v, **kwargs)
    return kernels.sharded_attention(q, k, v, mesh=self.mesh, batch_axes=self.axes("batch"),
                                     head_axes=self.axes("act_heads"), sequence_axes=self.axes("seq"), **kwargs)


def _constrain(placement: Placement | None, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  return x if placement is None else placement.constrain(x, names)


_RESIDUAL = ("batch", "seq", "act_embed")




# --------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, computed in float32.

  ``y = x / sqrt(mean(x²) + eps) · scale`` (Zhang & Sennrich 2019); the result is cast back to the
  input dtype.
  """

  def __init__(self, dim: int, *, eps: float, param_dtype):
    self.scale = _param(jnp.ones((dim,), param_dtype), ("norm",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention over packed sequences; a KV cache plugs in its write and kernel (``attend``).

  ``q = x·W_q (+b_q)``, ``k, v`` likewise with ``K`` heads; Qwen3 RMS-normalises each q/k head;
  RoPE on q and k; ``o = attention(q, k, v)·W_o`` with ``attention`` = :func:`jaxrl.kernels.attention`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.jnp_param_dtype
    self.cfg = cfg
    self.q_proj = _param(_normal(rngs, (d, n, h), pd), ("embed", "heads", "head_dim"))
    self.k_proj = _param(_normal(rngs, (d, k, h), pd), ("embed", "kv_heads", "head_dim"))
    self.v_proj = _param(_normal(rngs, (d, k, h), pd), ("embed", "kv_heads", "head_dim"))
    self.o_proj = _param(_normal(rngs, (n, h, d), pd), ("heads", "head_dim", "embed"))
    if cfg.attention_bias:
      self.q_bias = _param(jnp.zeros((n, h), pd), ("heads", "head_dim"))
      self.k_bias = _param(jnp.zeros((k, h), pd), ("kv_heads", "head_dim"))
      self.v_bias = _param(jnp.zeros((k, h), pd), ("kv_heads", "head_dim"))
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=pd)
      self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=pd)
    else:
      self.q_norm = self.k_norm = None

  def project(
      self,
      x: jax.Array,  # [B, T, D]
      positions: jax.Array,  # [B, T]
      *,
      rope_positions: jax.Array | None = None,  # [B, T, 3]
      placement: Placement | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]
    """Queries, keys and values of ``x``: projections (with unmerged LoRA terms), bias, q/k norm, RoPE.

    Every path that runs this block (training forward, prefill, the sampler's and the engine's decode
    steps) calls this method, so they cannot disagree about the block. RoPE rotates by ``positions``, or
    by ``rope_positions`` (M-RoPE, ``cfg.mrope_section``) when given.
    """
    cfg = self.cfg
    dt = cfg.jnp_dtype
    q = add_lora(self, "q_proj", x, jnp.einsum("btd,dnh->btnh", x, self.q_proj[...].astype(dt)))
    k = add_lora(self, "k_proj", x, jnp.einsum("btd,dkh->btkh", x, self.k_proj[...].astype(dt)))
    v = add_lora(self, "v_proj", x, jnp.einsum("btd,dkh->btkh", x, self.v_proj[...].astype(dt)))
    if self.q_bias is not None:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if self.q_norm is not None:
      q = self.q_norm(q)
      k = self.k_norm(k)
    inv_freq, axes = rope_frequencies(cfg), None
    if rope_positions is not None:
      if cfg.mrope_section is None:
        raise ValueError(f"rope_positions: model_type {cfg.model_type!r} has no mrope_section (M-RoPE)")
      if rope_positions.shape != (*positions.shape, 3):
        raise ValueError(f"rope_positions must be [B, T, 3]={(*positions.shape, 3)}, got {rope_positions.shape}")
      positions, axes = rope_positions, mrope_axes(cfg.mrope_section)
    q = _constrain(placement, apply_rope(q, positions, inv_freq, axes), ("batch", "seq", "act_heads", "head_dim"))
    k = _constrain(placement, apply_rope(k, positions, inv_freq, axes), ("batch", "seq", "act_kv_heads", "head_dim"))
    v = _constrain(placement, v, ("batch", "seq", "act_kv_heads", "head_dim"))
    return q, k, v

  def output(self, out: jax.Array, *, placement: Placement | None = None) -> jax.Array:  # [B, T, N, H] -> [B, T, D]
    """The output projection ``out·W_o`` (with an unmerged LoRA term) of the attention output ``out``.

    For one query per row (decode steps) ``(n, h)`` are contracted as one flat axis: the einsum makes
    XLA CPU copy ``W_o`` transposed on every call, once per generated token.
    """
    dt = self.cfg.jnp_dtype
    out = _constrain(placement, out, ("batch", "seq", "act_heads", "head_dim"))
    b, t, n, h = out.shape
    w = self.o_proj[...].astype(dt)
    if t == 1:
      y = (out.reshape(b, n * h) @ w.reshape(n * h, w.shape[-1]))[:, None]  # [B, 1, D]
    else:
      y = jnp.einsum("btnh,nhd->btd", out, w)
    return add_lora(self, "o_proj", out, y)

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      *,
      positions: jax.Array,  # [B, T]
      segment_ids: jax.Array | None = None,  # [B, T]
      rope_positions: jax.Array | None = None,  # [B, T, 3]
      placement: Placement | None = None,
      attend=None,
  ) -> tuple[jax.Array, object]:  # [B, T, D], what ``attend`` returns beside the output (or None)
    """``output(attention(project(x)))``.

    Args:
      x: normed input ``[B, T, D]``.
      positions: ``[B, T]`` (RoPE and causality).
      segment_ids: ``[B, T]`` (packing; 0 = padding). Unused with ``attend``.
      rope_positions: ``[B, T, 3]`` M-RoPE positions replacing ``positions`` in RoPE (not in masking).
      placement: the model's mesh (activation constraints, sharded kernels).
      attend: ``(q, k, v) -> (out [B, T, N, H], new_kv)`` replacing the attention step: the cache write
        and the kernel of a KV cache (:meth:`Transformer.run_layers` passes one per layer).
    """
    q, k, v = self.project(x, positions, rope_positions=rope_positions, placement=placement)
    if attend is not None:
      out, new_kv = attend(q, k, v)
      return self.output(out, placement=placement), new_kv
    out = attention(self.cfg, placement, q, k, v, segment_ids=segment_ids, positions=positions)
    return self.output(out, placement=placement), None


def attention(cfg: ModelConfig, placement: Placement | None, q, k, v, **kwargs) -> jax.Array:
  """The model's attention kernel (:func:`jaxrl.kernels.attention`, sharded when placed) with its
  configured implementation; ``kwargs`` are the kernel's masks (``segment_ids``, ``positions``)."""
  attn = kernels.attention if placement is None else placement.attention
  return attn(q, k, v, impl=cfg.attention_impl, interpret=cfg.attention_interpret, **kwargs)


class MLP(nnx.Module):
  """SwiGLU feed-forward: ``(silu(x·W_gate) ⊙ x·W_up)·W_down`` (Shazeer 2020)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    self.cfg = cfg
    self.gate_proj = _param(_normal(rngs, (d, f), pd), ("embed", "mlp"))
    self.up_proj = _param(_normal(rngs, (d, f), pd), ("embed", "mlp"))
    self.down_proj = _param(_normal(rngs, (f, d), pd), ("mlp", "embed"))

  def __call__(self, x: jax.Array, *, placement: Placement | None = None) -> jax.Array:  # [B, T, D] -> [B, T, D]
    dt = self.cfg.jnp_dtype
    gate = add_lora(self, "gate_proj", x, jnp.einsum("btd,df->btf", x, self.gate_proj[...].astype(dt)))
    up = add_lora(self, "up_proj", x, jnp.einsum("btd,df->btf", x, self.up_proj[...].astype(dt)))

    # Rematerialised: the backward pass keeps only gate and up and recomputes h (elementwise, no matmul). Left
    # to autodiff it also kept sigmoid(gate), silu(gate) and h, three more [B, T, F] arrays per layer (issue 34:
    # 456 MiB of the 0.5B RL bench step's temporaries, and no slower).
    @jax.checkpoint
    def down(gate, up, w):
      h = _constrain(placement, jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))  # [B, T, F]
      return add_lora(self, "down_proj", h, jnp.einsum("btf,fd->btd", h, w))

    return down(gate, up, self.down_proj[...].astype(dt))


class Block(nnx.Module):
  """One pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = cfg.jnp_param_dtype
    self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, *, positions, segment_ids=None, rope_positions=None, placement=None, attend=None):
    """``[B, T, D] -> ([B, T, D], new kv)``; ``rope_positions`` and ``attend`` as in :meth:`Attention.__call__`."""
    with jax.named_scope("attention"):
      y, new_kv = self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids,
                            rope_positions=rope_positions, placement=placement, attend=attend)
      x = _constrain(placement, x + y, _RESIDUAL)
    with jax.named_scope("mlp"):
      x = _constrain(placement, x + self.mlp(self.mlp_norm(x), placement=placement), _RESIDUAL)
    return x, new_kv


# --------------------------------------------------------------------------------------------------
# The model


class Transformer(nnx.Module):
  """Decoder-only language model (Llama / Qwen2 / Qwen3), with a vision tower for the Qwen-VL models.

  Example::

      model = Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))
      logits = model(tokens, positions=positions, segment_ids=segment_ids)  # [B, T, V] float32
      vlm = Transformer(ModelConfig.tiny_vl(), rngs=nnx.Rngs(0))
      logits = vlm(tokens, positions=positions, segment_ids=segment_ids, rope_positions=rope, images=images)
  """

  placement: Placement | None = None
  """Mesh and rules the parameters were placed with (set by ``shard_model``/``init_model``/``load_pretrained``)."""
  visual: VisionTower | None = None
  """The vision tower of a VLM (``cfg.vision``); None for a text model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = cfg.jnp_param_dtype
    self.embed = _param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), pd), ("vocab", "embed"))
    if cfg.scan_layers:
      keys = jax.random.split(rngs.params(), cfg.num_layers)
      make = nnx.vmap(lambda key: Block(cfg, rngs=nnx.Rngs(params=key)), in_axes=0, out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
      self.layers = make(keys)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    if cfg.vision is not None:
      self.visual = VisionTower(cfg.vision, param_dtype=pd, dtype=cfg.jnp_dtype, scan_layers=cfg.scan_layers,
                                rngs=rngs)
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = _param(_normal(rngs, (cfg.hidden_size, cfg.vocab_size), pd), ("embed", "vocab"))

  def unembed_matrix(self) -> jax.Array:  # [D, V]
    """The output projection ``W`` with ``logits = hidden · W`` (the transposed embedding if tied), cast
    to the compute dtype.

    Every log-prob path (the model's logits, the trainer's and the reference's chunked log-probs, the
    sampler's decode step) multiplies the compute-dtype hidden state by this same compute-dtype
    matrix, accumulating in float32, so their log-probs differ only by the attention kernels.
    """
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return w.astype(self.cfg.jnp_dtype)

  def embed_tokens(
      self,
      tokens: jax.Array,  # [B, T] int32
      *,
      embeds: jax.Array | None = None,  # [B, T, D]
      embeds_mask: jax.Array | None = None,  # [B, T] bool
  ) -> jax.Array:  # [B, T, D] compute dtype
    """The input embedding of ``tokens``, replaced by ``embeds`` where ``embeds_mask`` (continuous
    thoughts, :mod:`jaxrl.latent`); every path into the blocks starts here."""
    dt = self.cfg.jnp_dtype
    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
      if (embeds is None) != (embeds_mask is None):
        raise ValueError("embeds and embeds_mask must be given together")
      if embeds is not None:
        if embeds.shape != x.shape or embeds_mask.shape != tokens.shape:
          raise ValueError(f"embeds must be [B, T, D]={x.shape} and embeds_mask [B, T]={tokens.shape}; "
                           f"got {embeds.shape}, {embeds_mask.shape}")
        x = jnp.where(embeds_mask[..., None], embeds.astype(dt), x)
    return x

  def embed_images(
      self,
      tokens: jax.Array,  # [B, T] int32
      images: VisionInputs,
      *,
      annotate: bool = True,
  ) -> tuple[jax.Array, jax.Array]:  # embeds [B, T, D], embeds_mask [B, T] bool
    """The vision tower over each row's images, row ``r``'s merged rows placed at row ``r``'s image tokens.

    ``images`` is per row (:class:`VisionInputs`, ``pixel_values [B, P, patch_dim]``): merged row ``k`` of
    token row ``r`` (its images concatenated in token order) goes to the ``k``-th ``cfg.image_token_id``
    token of that row (HF ``masked_scatter``, row by row); the result feeds :meth:`embed_tokens`'
    ``embeds``/``embeds_mask``. The tower runs once per call as a batch of ``B`` patch sequences, with
    ``cfg.remat_policy`` like the blocks: a caller that samples several continuations of one prompt runs
    it once and reuses ``embeds``. The host keeps the image tokens and ``grid_thw`` consistent
    (:func:`jaxrl.models.mrope_positions` checks them); tokens beyond a row's merged rows would repeat
    its last one. ``images.token_mask`` (an RL batch's ``image_token_mask``) restricts the image tokens to the
    prompts', as the sampler embeds a sampled one as text.
    """
    cfg = self.cfg
    if self.visual is None:
      raise ValueError(f"images: model_type {cfg.model_type!r} has no vision tower")
    if images.pixel_values.shape[0] != tokens.shape[0]:
      raise ValueError(f"images: pixel_values has {images.pixel_values.shape[0]} rows, tokens "
                       f"{tokens.shape[0]} (vision inputs are per token row: [B, P, patch_dim])")
    with jax.named_scope("visual"):
      feats = self.visual(images.pixel_values, images.layout, placement=self.placement if annotate else None,
                          attention_impl=cfg.attention_impl, interpret=cfg.attention_interpret,
                          remat_policy=cfg.remat_policy if annotate else None)  # [B, U, D]
    mask = tokens == cfg.image_token_id  # [B, T]
    if images.token_mask is not None:  # an RL batch: a sampled image-pad token in a response is text
      mask = mask & (images.token_mask != 0)
    index = jnp.clip(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0, feats.shape[1] - 1)  # [B, T]
    embeds = jnp.take_along_axis(feats, index[..., None], axis=1)  # [B, T, D]
    return embeds, mask

  def unembed(self, h: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, V] float32
    """Logits ``h · W`` with ``W`` = :meth:`unembed_matrix`, accumulated in float32: the output projection
    of every path (forward, the samplers' and the engine's decode steps, latent decoding).

    Tied, ``W`` is the embedding's transpose and the product contracts the embedding ``[V, D]`` directly:
    with the transposed operand XLA CPU copies the whole table in every decode program call.
    """
    with jax.named_scope("lm_head"):
      if self.lm_head is None:
        w = self.embed[...].astype(self.cfg.jnp_dtype)  # [V, D] = unembed_matrix().T
        out = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
      else:
        out = jnp.einsum("btd,dv->btv", h, self.unembed_matrix(), preferred_element_type=jnp.float32)
      return out

  def __call__(
      self,
      tokens: jax.Array,  # [B, T] int32
      *,
      positions: jax.Array,  # [B, T] int32
      segment_ids: jax.Array,  # [B, T] int32, 0 = padding
      cache: KVCache | None = None,
      cache_start: jax.Array | None = None,  # [B] int32
      return_hidden: bool = False,
      embeds: jax.Array | None = None,  # [B, T, D]
      embeds_mask: jax.Array | None = None,  # [B, T] bool
      rope_positions: jax.Array | None = None,  # [B, T, 3] int32
      images: VisionInputs | None = None,
  ):
    """Logits (or final normed hidden states) of packed token rows, optionally through a KV cache.

    Args:
      tokens: token ids ``[B, T]``.
      positions: position of each token inside its sequence ``[B, T]`` (RoPE and causality).
      segment_ids: sequence id of each token ``[B, T]``; attention never crosses ids, 0 = padding.
      cache: a :class:`KVCache`; the ``T`` new tokens' keys/values, segment ids and positions are
        written to slots ``cache_start[b] + arange(T)`` and the queries attend over the whole cache.
      cache_start: ``[B]`` first slot written per row (required with ``cache``). The caller keeps
        ``cache_start + T <= S``.
      return_hidden: return the final normed hidden states ``[B, T, D]`` (compute dtype) instead of
        logits; project them with :meth:`unembed_matrix`.
      embeds: input embeddings ``[B, T, D]`` that replace the token embedding where ``embeds_mask``
        is true (continuous thoughts, :mod:`jaxrl.latent`); cast to the compute dtype.
      embeds_mask: ``[B, T]`` bool, where ``embeds`` is used (required with ``embeds``).
      rope_positions: ``[B, T, 3]`` M-RoPE positions of a VLM (:func:`jaxrl.models.mrope_positions`; in
        decode ``position + rope delta`` on each axis); default ``positions`` on all three axes.
      images: the batch's images (:class:`VisionInputs`), embedded at the image tokens
        (:meth:`embed_images`).

    Returns:
      ``[B, T, V]`` float32 logits (or ``[B, T, D]`` hidden); with a cache, ``(out, new_cache)``.
    """
    cfg = self.cfg
    if (cache is None) != (cache_start is None):
      raise ValueError("cache and cache_start must be given together")
    if tokens.ndim != 2 or positions.shape != tokens.shape or segment_ids.shape != tokens.shape:
      raise ValueError(
          f"tokens, positions and segment_ids must all be [B, T]; got {tokens.shape}, {positions.shape}, "
          f"{segment_ids.shape}")
    run = functools.partial(self.run, tokens, positions=positions, segment_ids=segment_ids,
                            return_hidden=return_hidden, embeds=embeds, embeds_mask=embeds_mask,
                            rope_positions=rope_positions, images=images)
    if cache is None:
      return run()[0]
    b = tokens.shape[0]
    want = (cfg.num_layers, b, cache.k.shape[2], cfg.num_kv_heads, cfg.head_dim)
    if cache.k.shape != want or cache.v.shape != want or cache.segment_ids.shape != (b, want[2]):
      raise ValueError(f"cache shapes k {cache.k.shape}, v {cache.v.shape}, segment_ids {cache.segment_ids.shape} "
                       f"do not fit this model and batch: expected k/v {want}")
    cache_start = jnp.asarray(cache_start, jnp.int32)
    if cache_start.shape != (b,):
      raise ValueError(f"cache_start must be [B]=({b},), got shape {cache_start.shape}")
    kv_segment_ids = write_rows(cache.segment_ids, segment_ids, cache_start)  # [B, S]
    kv_positions = write_rows(cache.positions, positions, cache_start)  # [B, S]
    dt = cfg.jnp_dtype

    def attend(k_cache, v_cache):  # one layer: write the new keys/values at cache_start, attend over every slot
      def fn(q, k, v):  # [B, T, N, H], [B, T, K, H] x2
        k_cache2, v_cache2 = write_rows(k_cache, k, cache_start), write_rows(v_cache, v, cache_start)  # [B, S, K, H]
        out = attention(cfg, self.placement, q, k_cache2.astype(dt), v_cache2.astype(dt),
                        segment_ids=(segment_ids, kv_segment_ids), positions=(positions, kv_positions))
        return out, (k_cache2, v_cache2)
      return fn

    out, (new_k, new_v) = run(kv=(cache.k, cache.v), attend=attend)
    return out, KVCache(k=new_k, v=new_v, segment_ids=kv_segment_ids, positions=kv_positions)

  def run(
      self,
      tokens: jax.Array,  # [B, T] int32
      *,
      positions: jax.Array,  # [B, T] int32
      segment_ids: jax.Array | None = None,  # [B, T] int32 (without ``attend``)
      kv: tuple[jax.Array, jax.Array] | None = None,  # per-layer cache arrays on a leading [L] axis
      attend: Callable | None = None,
      return_hidden: bool = False,
      embeds: jax.Array | None = None,  # [B, T, D]
      embeds_mask: jax.Array | None = None,  # [B, T] bool
      annotate: bool = True,
      rope_positions: jax.Array | None = None,  # [B, T, 3] int32
      images: VisionInputs | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:  # [B, T, V] float32 (or [B, T, D]), new kv
    """The model path: :meth:`embed_tokens` (with :meth:`embed_images` when ``images``), the blocks
    (:meth:`run_layers`, with the cache's ``attend`` step), the final norm and :meth:`unembed` (skipped
    with ``return_hidden``).

    :meth:`__call__` runs it over a :class:`KVCache`; the sampler's decode kernel
    (:func:`jaxrl.sampling.decode_step`) and the engine's paged decode run it over their own caches
    (with ``annotate=False``, see :meth:`run_layers`).
    """
    placement = self.placement if annotate else None
    if images is not None:
      if embeds is not None:
        raise ValueError("images and embeds cannot be given together (both replace token embeddings)")
      embeds, embeds_mask = self.embed_images(tokens, images, annotate=annotate)
    x = _constrain(placement, self.embed_tokens(tokens, embeds=embeds, embeds_mask=embeds_mask), _RESIDUAL)
    x, kv = self.run_layers(x, positions=positions, segment_ids=segment_ids, kv=kv, attend=attend, annotate=annotate,
                            rope_positions=rope_positions)
    with jax.named_scope("final_norm"):
      h = self.final_norm(x)
    if return_hidden:
      return h, kv
    return _constrain(placement, self.unembed(h), ("batch", "seq", "act_vocab")), kv

  def run_layers(
      self,
      x: jax.Array,  # [B, T, D] embedded inputs (compute dtype)
      *,
      positions: jax.Array,  # [B, T] int32
      segment_ids: jax.Array | None = None,  # [B, T] int32 (without ``attend``)
      kv: tuple[jax.Array, jax.Array] | None = None,  # per-layer cache arrays on a leading [L] axis
      attend: Callable | None = None,
      annotate: bool = True,
      rope_positions: jax.Array | None = None,  # [B, T, 3] int32 (M-RoPE)
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:  # [B, T, D] last block's output (not normed), new kv
    """Every block over ``x``: the one layer loop (scanned when ``cfg.scan_layers``, rematerialised as
    ``cfg.remat`` says). ``rope_positions`` replace ``positions`` in RoPE only (:meth:`Attention.project`).

    With a cache, ``kv = (k, v)`` holds every layer's cache arrays (a :class:`KVCache`'s ``[L, B, S, K, H]``
    or the engine's paged pool ``[L, NB, bs, K, H]``) and ``attend(k_l, v_l)`` returns the
    ``(q, k, v) -> (out, (k_l', v_l'))`` step that :meth:`Attention.__call__` runs for layer ``l`` (the
    cache write and the attention kernel). The cache travels as the loop's carry and each layer's slab
    is written back with a dynamic update, so with the cache donated XLA updates it in place; scanning it
    as an input and stacking the outputs would make a second cache-sized buffer (the plan measured
    1.1-2.6x the pool in temporaries).

    ``annotate=False`` runs the blocks without ``cfg.remat`` and without the placement's activation
    constraints (:meth:`run` likewise skips its embedding and logits constraints): the samplers' decode
    kernel and the engine's steps, never differentiated and sharding their cache attention themselves
    (``shard_map``), where both only cost memory (DeepScaleR's engine decode on h100x8: 0.62 GiB more
    temporaries per device with remat, 0.11 GiB more with the constraints).
    """
    cfg = self.cfg

    def block_fn(block, x, kv_l):
      step = None if kv_l is None else attend(*kv_l)
      placement = self.placement if annotate else None
      return block(x, positions=positions, segment_ids=segment_ids, rope_positions=rope_positions,
                   placement=placement, attend=step)

    if annotate and cfg.remat != "none":
      # A rolled scan body keeps XLA from merging the recomputation with the forward; unrolled blocks need
      # prevent_cse as a Python loop does.
      block_fn = nnx.remat(block_fn, policy=cfg.remat_policy, prevent_cse=not cfg.scan_layers or cfg.layer_unroll > 1)

    def layer(kv, i):
      return None if kv is None else tuple(jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in kv)

    def write(kv, i, new):
      return None if kv is None else tuple(
          jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), i, 0) for a, n in zip(kv, new))

    if cfg.scan_layers:
      def body(carry, block, i):
        x, kv = carry
        x, new = block_fn(block, x, layer(kv, i))
        return (x, write(kv, i, new)), None

      scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), unroll=cfg.layer_unroll,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
      with jax.named_scope("layers"):
        (x, kv), _ = scan((x, kv), self.layers, jnp.arange(cfg.num_layers))
      return x, kv

    for i, block in enumerate(self.layers):
      with jax.named_scope(f"layer_{i}"):
        x, new = block_fn(block, x, layer(kv, i))
        kv = write(kv, i, new)
    return x, kv
