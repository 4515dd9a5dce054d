"""Attention kernels behind one entry point.

``attention(q, k, v, *, segment_ids, positions, causal=True, impl="auto")`` dispatches to an
implementation by name. The model and the sampler call only :func:`attention` and
:func:`decode_attention`.

Implementations (``impl=``):
  ``reference``          pure JAX/XLA (``_reference.py``), the numerical reference; used on CPU.
  ``pallas_triton``      Pallas GPU kernels lowered through Triton (``_triton.py``); GPU default.
  ``pallas_tpu``         Pallas Mosaic TPU kernels (``_tpu.py``); TPU default.
  ``cudnn``              ``jax.nn.dot_product_attention(implementation="cudnn")`` + dense mask.
  ``pallas_mosaic_gpu``  not built: raises ``NotImplementedError``.
Both Pallas variants skip tiles from segment-id metadata (``_blocks.py``) and have forward and
backward kernels; with ``interpret=True`` they run on CPU.

This package imports nothing but JAX (it lives inside ``jaxrl`` only so that it does not shadow the
unrelated ``kernels`` package on PyPI, which ``transformers`` probes for at import time).
"""

from __future__ import annotations

from jaxrl.kernels._blocks import BlockRanges, block_ranges, tile_classes, visited_tiles
from jaxrl.kernels._common import BlockSizes
from jaxrl.kernels._decode import decode_attention_reference
from jaxrl.kernels._dispatch import DECODE_IMPLS, IMPLS, attention, decode_attention
from jaxrl.kernels._flash import flash_attention, tiles, visited_tile_counts
from jaxrl.kernels._reference import MASK_VALUE, attention_reference, make_mask

__all__ = [
    "BlockRanges",
    "BlockSizes",
    "DECODE_IMPLS",
    "IMPLS",
    "MASK_VALUE",
    "attention",
    "attention_reference",
    "block_ranges",
    "decode_attention",
    "decode_attention_reference",
    "flash_attention",
    "make_mask",
    "tile_classes",
    "tiles",
    "visited_tile_counts",
    "visited_tiles",
]
