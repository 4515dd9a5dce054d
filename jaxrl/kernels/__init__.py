"""Attention kernels behind one entry point.

``attention(q, k, v, *, segment_ids, positions, causal=True, impl="auto")`` dispatches to an
implementation by name. The model and the sampler call only :func:`attention` and
:func:`decode_attention` (or :func:`paged_decode_attention` over a paged cache); on a device mesh
they go through :func:`sharded_attention`, which runs the kernel per shard under ``jax.shard_map``
(``pallas_call`` is not partitioned automatically).

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

Layer (docs/design.md): may import ``sharding`` and ``config``; nothing above.
"""

from __future__ import annotations

from jaxrl.kernels._blocks import BlockRanges, block_ranges, tile_classes, visited_tiles
from jaxrl.kernels._common import BlockSizes
from jaxrl.kernels._decode import decode_attention_reference
from jaxrl.kernels._dispatch import DECODE_IMPLS, IMPLS, attention, decode_attention, resolve_impl
from jaxrl.kernels._flash import flash_attention, tiles, visited_tile_counts
from jaxrl.kernels._paged import PAGED_IMPLS, paged_decode_attention, paged_decode_attention_reference
from jaxrl.kernels._reference import MASK_VALUE, attention_reference, make_mask
from jaxrl.kernels._sharded import sharded_attention

__all__ = [
    "BlockRanges",
    "BlockSizes",
    "DECODE_IMPLS",
    "IMPLS",
    "MASK_VALUE",
    "PAGED_IMPLS",
    "attention",
    "attention_reference",
    "block_ranges",
    "decode_attention",
    "decode_attention_reference",
    "flash_attention",
    "make_mask",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "resolve_impl",
    "sharded_attention",
    "tile_classes",
    "tiles",
    "visited_tile_counts",
    "visited_tiles",
]
