"""Vision-language recipes in ``jaxrl plan``: the per-row image inputs of the trainer's programs.

A VLM's packed rows carry their images beside the tokens (docs/vlm.md): ``pixel_values [R, P, patch_dim]``
(``P`` the per-row patch bucket), the tower's layout arrays (``jaxrl.models.VISION_LAYOUT_KEYS``, each
``[R, ...]``), the M-RoPE positions ``rope_positions [R, T, 3]`` and (RL rows) the prompt image-token mask
``image_token_mask [R, T]``, all sharded over rows like the tokens.
:func:`vision_batch` gives their abstract shapes for a recipe, equal to what
:func:`jaxrl.data.stack_vl_rows` (``per_row=True``, with ``model_config``) writes for the same settings
(``tests/plan/test_plan_vlm.py`` compares them). :func:`runs_tower` says whether a traced program runs the vision
tower at all, so a plan never counts a tower that the program does not run.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.extend.core as jex_core

from jaxrl import models, sharding

ROPE_KEY = "rope_positions"
MASK_KEY = "image_token_mask"
"""The RL packer's ``[R, T]`` int32 mask of the prompt image tokens (``jaxrl.rl.pack_sequences``): only these take
image embeddings (``VisionInputs.token_mask``)."""
VISION_KEYS = ("pixel_values", *models.VISION_LAYOUT_KEYS)
"""The batch keys :meth:`jaxrl.models.VisionInputs.from_batch` reads."""


def check_images(cfg, model_cfg: models.ModelConfig) -> None:
  """Raises ``ValueError`` naming the ``data.images`` key whose geometry differs from the model's tower."""
  v, img = model_cfg.vision, cfg.data.images
  for key, want in (("patch_size", v.patch_size), ("temporal_patch_size", v.temporal_patch_size),
                    ("merge_size", v.spatial_merge_size)):
    if getattr(img, key) != want:
      raise ValueError(f"data.images.{key}: {getattr(img, key)!r} differs from the vision tower's {want!r}")


def patches_per_image(cfg) -> int:
  """Most patches one still image gives at ``data.images.max_pixels``: ``smart_resize`` rounds both sides to
  multiples of ``patch·merge`` with ``h·w <= max_pixels``, so ``(h/patch)(w/patch) <= merge²·⌊max_pixels /
  (patch·merge)²⌋`` (one temporal patch: a still image is repeated over it). 1280·28·28 pixels: 5120."""
  img = cfg.data.images
  unit = img.patch_size * img.merge_size
  return img.merge_size ** 2 * (img.max_pixels // unit ** 2)


def vision_bucket(cfg, *, row_len: int, seq_len: int) -> int:
  """Patches per packed row: ``data.num_patches`` when set, else the worst case of rows of ``row_len`` tokens
  packed with sequences of ``seq_len`` (prompt + full response): ``max(1, row_len // seq_len) ×
  images_per_prompt × patches_per_image``."""
  if cfg.data.num_patches is not None:
    return cfg.data.num_patches
  return max(1, row_len // seq_len) * cfg.data.images_per_prompt * patches_per_image(cfg)


def vision_batch(model_cfg: models.ModelConfig, *, rows: int, row_len: int, num_patches: int, mesh,
                 rules) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract per-row image inputs and M-RoPE positions of ``rows`` packed rows, sharded over rows.

  ``mesh=None``: unsharded. Shapes and dtypes are the data pipeline's: ``pixel_values`` float32 ``[R, P, patch_dim]``,
  one row's :func:`jaxrl.models.vision_layout` arrays with a leading ``[R]`` axis, ``rope_positions`` int32
  ``[R, T, 3]`` and the RL packer's ``image_token_mask`` int32 ``[R, T]``.
  """
  vision = model_cfg.vision
  layout = models.vision_layout(np.zeros((0, 3), np.int64), vision, num_patches=num_patches)  # one empty row
  shapes = {"pixel_values": ((num_patches, vision.patch_dim), np.dtype(np.float32))}
  shapes.update({k: (np.shape(getattr(layout, k)), np.asarray(getattr(layout, k)).dtype)
                 for k in models.VISION_LAYOUT_KEYS})
  shapes[ROPE_KEY] = ((row_len, 3), np.dtype(np.int32))
  shapes[MASK_KEY] = ((row_len,), np.dtype(np.int32))
  place = lambda ndim: None if mesh is None else sharding.batch_sharding(mesh, rules, ndim=ndim)
  return {k: jax.ShapeDtypeStruct((rows, *shape), dtype, sharding=place(1 + len(shape)))
          for k, (shape, dtype) in shapes.items()}


def runs_tower(fn, args: tuple, vision: models.VisionConfig) -> bool:
  """Whether the traced program ``fn(*args)`` runs the vision tower: its jaxpr (sub-programs included) holds the
  patch embedding, a matmul contracting ``patch_dim`` values per patch into the tower's ``hidden_size``.
  (A jaxpr dead-code elimination cannot say this: it keeps every input of a while loop, so a ``pixel_values``
  only split into micro-batches would count as read.)"""
  closed = jax.make_jaxpr(fn)(*args)
  for eqn in _equations(closed.jaxpr):
    if eqn.primitive.name != "dot_general":
      continue
    (lc, rc), _ = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    if any(lhs[c] == vision.patch_dim for c in lc) and (vision.hidden_size in rhs or vision.hidden_size in lhs):
      return True
    if any(rhs[c] == vision.patch_dim for c in rc) and vision.hidden_size in lhs:
      return True
  return False


def _equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters (jit, scan, while, cond, remat)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          yield from _equations(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          yield from _equations(sub)


def vision_note(model_cfg: models.ModelConfig, cfg, *, num_patches: int, read: bool) -> str:
  """The row note of a program's images: the bucket, and whether the program runs the tower on them."""
  per_image = patches_per_image(cfg)
  head = (f"images: {num_patches} patches per row ({num_patches // per_image} x {per_image}-patch images at "
          f"max_pixels={cfg.data.images.max_pixels}) + rope_positions [R, T, 3]")
  if read:
    return head + "; the vision tower runs in this program"
  return (head + "; NOT READ: this program does not run the vision tower on them (the RL loss / log-prob path "
          "takes no images yet), so its bytes and FLOPs are the language model's only")


def tower_flops(model_cfg: models.ModelConfig, cfg, *, row_len: int, num_patches: int, training: bool) -> float:
  """Model FLOPs per token of rows of ``row_len`` tokens each holding ``num_patches`` patches (tower included)."""
  return model_cfg.flops_per_token(row_len, training=training, patches_per_token=num_patches / row_len,
                                   patches_per_image=patches_per_image(cfg))



def engine_patch_bucket(cfg, model_cfg: models.ModelConfig) -> int:
  """The rollout engine's per-prompt patch bucket for the recipe's largest prompt (``images_per_prompt``
  images at ``max_pixels``): the power of two at or above its patches (at least ``4·m²``), a multiple of
  ``m²`` (``jaxrl.sampling``'s ``patch_bucket``, the shape the engine's tower program compiles for)."""
  m2 = model_cfg.vision.spatial_merge_size ** 2
  patches = cfg.data.images_per_prompt * patches_per_image(cfg)
  b = 1 << (max(patches, 4 * m2) - 1).bit_length()
  return -(-b // m2) * m2


def vision_inputs(model_cfg: models.ModelConfig, *, rows: int, num_patches: int, sharding) -> models.VisionInputs:
  """Abstract :class:`jaxrl.models.VisionInputs` of ``rows`` rows of ``num_patches`` patches (one ``sharding``)."""
  batch = vision_batch(model_cfg, rows=rows, row_len=1, num_patches=num_patches, mesh=None, rules=None)
  put = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  layout = models.VisionLayout(**{k: put(batch[k]) for k in models.VISION_LAYOUT_KEYS})
  return models.VisionInputs(pixel_values=put(batch["pixel_values"]), layout=layout)


def tower_flops_per_patch(model_cfg: models.ModelConfig, patches_per_image: int) -> float:
  """The vision tower's forward FLOPs per patch (``ModelConfig.flops_per_token``'s tower term)."""
  with_tower = model_cfg.flops_per_token(1, training=False, patches_per_token=1.0, patches_per_image=patches_per_image)
  return with_tower - model_cfg.flops_per_token(1, training=False)
