"""The LoRA term of a projection's forward pass, shared by the decoder and the vision tower.

Lives below both :mod:`jaxrl.models._transformer` and :mod:`jaxrl.models._vision` so each can apply
adapters without importing the other; :mod:`jaxrl.models._lora` adds, merges and saves them.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

LORA_SUFFIXES = ("_lora_a", "_lora_b")
"""Attribute suffixes of a projection's LoRA factors (``q_proj_lora_a``, ``q_proj_lora_b``); see
:mod:`jaxrl.models._lora`, which adds them."""
LORA_OFF = contextvars.ContextVar("jaxrl_lora_off", default=False)
"""True while :func:`jaxrl.models.lora_disabled` is active: :func:`add_lora` then returns the base."""


def add_lora(module: nnx.Module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """``y + s·((x·A)·B)`` when ``module`` holds an active LoRA adapter for projection ``name``, else ``y``.

  ``y = x·W`` is the base projection, ``A [*in, r]`` and ``B [r, *out]`` the factors (``*in``/``*out``
  are ``W``'s input/output axes, e.g. ``q_proj``: ``A [D, r]``, ``B [r, N, H]``), ``s = alpha / r``
  (or ``alpha / sqrt(r)``). ``W' = W + s·A·B`` is never formed. Inactive when the adapter is merged
  into ``W`` or disabled (:func:`jaxrl.models.lora_disabled`). Hu et al. 2021, LoRA.

  Args:
    module: the module owning ``name`` (decoder :class:`Attention` / ``MLP``, a vision block or the merger).
    name: projection attribute, e.g. ``"q_proj"``.
    x: the projection's input ``[..., *in]`` (compute dtype).
    y: ``x·W`` ``[..., *out]``.
  """
  a = getattr(module, name + LORA_SUFFIXES[0], None)
  if a is None or getattr(module, "lora_merged", False) or LORA_OFF.get():
    return y
  a, b = a[...], getattr(module, name + LORA_SUFFIXES[1])[...]
  dt = y.dtype
  xa = jnp.tensordot(x, a.astype(dt), axes=a.ndim - 1)  # [..., r]
  return y + module.lora_scale * jnp.tensordot(xa, b.astype(dt), axes=1)
