"""Loss aggregation as per-token weights computed once per global batch.

Every mean over tokens, sequences or prompts is folded into a weight per token, ``w [B, T]``, whose
normaliser is a count over the *global* batch (all data-parallel shards and all gradient-accumulation
micro-batches). The loss of any micro-batch is then the plain weighted sum ``Σ w·ℓ``, and the sum
of the micro-batch losses (and of their gradients) equals the unsplit loss whatever the split. This is
SkyRL's approach; it removes by construction the normalisation bugs of per-micro-batch means
(verl / TRL gradient-accumulation issues) described in the seeds' "样本packing与权重讨论" section.

Modes (``m`` the response mask, ``|o_i|`` the tokens of sequence ``i``, ``N_tok``, ``N_seq``, ``N_grp``
global counts of tokens, non-empty sequences and non-empty prompt groups, ``L`` a fixed length):

| mode | loss | source |
| --- | --- | --- |
| ``token_mean`` | Σ_{i,t} m ℓ / N_tok | DAPO token-level loss |
| ``seq_mean_token_mean`` | 1/N_seq Σ_i 1/|o_i| Σ_t m ℓ | original GRPO |
| ``seq_mean_token_sum`` | 1/N_seq Σ_i Σ_t m ℓ | Dr. GRPO (no length normaliser) |
| ``seq_mean_token_sum_norm`` | 1/N_seq Σ_i 1/L Σ_t m ℓ | Dr. GRPO with a constant length |
| ``prompt_mean`` | 1/N_grp Σ_g 1/N_tok(g) Σ_{i∈g,t} m ℓ | mean over prompts of each prompt's token mean |

A "sequence" is a row of ``[B, T]``, or one ``(row, segment)`` of a packed row when ``segment_ids``
are given (each segment a contiguous run of its row, as packing lays them out); sequences must not be
split across shards or micro-batches (split along ``B``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["AGGREGATION_MODES", "GlobalCounts", "aggregate", "global_counts", "loss_weights"]

AGGREGATION_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "prompt_mean",
)


class GlobalCounts(NamedTuple):
  """Counts over the global batch that the aggregation modes divide by.

  Attributes:
    tokens: scalar int32, Σ of the response mask.
    sequences: scalar int32, number of sequences with at least one response token.
    group_tokens: ``[num_groups]`` int32, response tokens per prompt group (``[0]``-shaped when no
      ``group_ids`` were given).
    groups: scalar int32, number of groups with at least one response token.
  """

  tokens: jax.Array
  sequences: jax.Array
  group_tokens: jax.Array
  groups: jax.Array


def _as_mask(mask: jax.Array) -> jax.Array:
  return jnp.asarray(mask).astype(jnp.float32)


def sequence_index(shape: tuple[int, int], segment_ids: jax.Array | None) -> tuple[jax.Array, int]:
  """Flat sequence index per token ``[B, T]`` and the number of index slots.

  Without ``segment_ids`` every row is one sequence (index = row). With packed rows the index of
  token ``(b, t)`` is ``b·(T+1) + segment_ids[b, t]``.
  """
  b, t = shape
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  if segment_ids is None:
    return jnp.broadcast_to(rows, (b, t)), b
  return rows * (t + 1) + jnp.asarray(segment_ids, jnp.int32), b * (t + 1)


def sequence_sum(
    x: jax.Array,  # [B, T]
    segment_ids: jax.Array | None = None,  # [B, T]
) -> jax.Array:  # [B, T]
  """Σ of ``x`` over each token's sequence, broadcast back to the tokens of that sequence."""
  if segment_ids is None:
    return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
  idx, n = sequence_index(x.shape, segment_ids)
  sums = jax.ops.segment_sum(x.reshape(-1), idx.reshape(-1), num_segments=n)
  return sums[idx]


def sequence_max(
    x: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # [B, T]
  """Masked max of ``x`` over each token's sequence (``-inf``-free: empty sequences give 0)."""
  neg = jnp.finfo(jnp.float32).min
  xm = jnp.where(mask > 0, x, neg)
  if segment_ids is None:
    out = jnp.broadcast_to(jnp.max(xm, axis=-1, keepdims=True), x.shape)
  else:
    idx, n = sequence_index(x.shape, segment_ids)
    out = jax.ops.segment_max(xm.reshape(-1), idx.reshape(-1), num_segments=n)[idx]
  return jnp.where(out == neg, 0.0, out)


def sequence_mean(
    x: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # [B, T]
  """Masked mean of ``x`` over each token's sequence (0 for sequences without tokens)."""
  mask = _as_mask(mask)
  num = sequence_sum(jnp.where(mask > 0, x, 0.0) * mask, segment_ids)
  den = sequence_sum(mask, segment_ids)
  return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def _broadcast_groups(group_ids: jax.Array, shape: tuple[int, int]) -> jax.Array:
  group_ids = jnp.asarray(group_ids, jnp.int32)
  if group_ids.ndim == 1:
    group_ids = group_ids[:, None]
  return jnp.broadcast_to(group_ids, shape)


def _count_sequences(valid: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """Number of sequences (rows, or contiguous segment runs of packed rows) with a valid token.

  ``O(B·T)`` with no scatter: a running count of valid tokens along each row, read at every
  segment's last token minus its value just before the segment's first token (carried forward from
  the segment start with a running max, since the count never decreases).
  """
  if segment_ids is None:
    return jnp.sum(jnp.any(valid, axis=-1), dtype=jnp.int32)
  seg = jnp.asarray(segment_ids, jnp.int32)
  edge = jnp.ones_like(seg[:, :1], bool)
  change = seg[:, 1:] != seg[:, :-1]
  start = jnp.concatenate([edge, change], axis=-1)  # [B, T] first token of a segment run
  end = jnp.concatenate([change, edge], axis=-1)  # [B, T] last token of a segment run
  running = jnp.cumsum(valid, axis=-1, dtype=jnp.int32)  # valid tokens up to and including t
  before = jax.lax.cummax(jnp.where(start, running - valid, 0), axis=1)  # ... before t's segment
  return jnp.sum(end & (running > before), dtype=jnp.int32)


def _count(response_mask, group_ids, num_groups, segment_ids, axis_name) -> GlobalCounts:
  mask = _as_mask(response_mask)
  tokens = jnp.sum(mask > 0, dtype=jnp.int32)
  sequences = _count_sequences(mask > 0, segment_ids)
  if group_ids is not None:
    if num_groups is None:
      raise ValueError("global_counts: group_ids needs a static num_groups")
    g = _broadcast_groups(group_ids, mask.shape)
    group_tokens = jax.ops.segment_sum(
        (mask > 0).astype(jnp.int32).reshape(-1), g.reshape(-1), num_segments=num_groups)
  else:
    group_tokens = jnp.zeros((0,), jnp.int32)
  if axis_name is not None:
    tokens, sequences, group_tokens = jax.lax.psum((tokens, sequences, group_tokens), axis_name)
  groups = jnp.sum(group_tokens > 0, dtype=jnp.int32)
  return GlobalCounts(tokens=tokens, sequences=sequences, group_tokens=group_tokens, groups=groups)


def global_counts(
    response_mask: jax.Array,  # [B, T]
    *,
    group_ids: jax.Array | None = None,  # [B] or [B, T] int in [0, num_groups)
    num_groups: int | None = None,
    segment_ids: jax.Array | None = None,  # [B, T]
    axis_name: str | tuple[str, ...] | None = None,
) -> GlobalCounts:
  """Counts tokens, sequences and prompt groups once for the whole global batch.

  Call it on the global batch before splitting into micro-batches (or on each shard's full local
  batch with ``axis_name`` under ``shard_map``: the counts are ``psum``-ed), then pass the result
  to :func:`loss_weights` for every micro-batch.

  Args:
    response_mask: ``[B, T]`` 1 on response tokens that enter the loss.
    group_ids: ``[B]`` (one per row) or ``[B, T]`` (per token, packed rows) prompt-group index in
      ``[0, num_groups)``; needed for ``prompt_mean``.
    num_groups: static number of group slots (required with ``group_ids``).
    segment_ids: ``[B, T]`` packed-row segment ids; each ``(row, segment)`` is a sequence.
    axis_name: mesh axis (or axes) to ``psum`` the counts over.

  Returns:
    A :class:`GlobalCounts`.
  """
  return _count(response_mask, group_ids, num_groups, segment_ids, axis_name)


def loss_weights(
    response_mask: jax.Array,  # [B, T]
    *,
    mode: str,
    group_ids: jax.Array | None = None,  # [B] or [B, T]
    num_groups: int | None = None,
    segment_ids: jax.Array | None = None,  # [B, T]
    max_len: int | None = None,
    global_counts: GlobalCounts | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:  # [B, T] float32
  """Per-token weights ``w`` such that the loss of any micro-batch is ``Σ w·ℓ``.

  ``w = m / Z`` with ``Z`` from the table in this module's docstring: ``N_tok`` (``token_mean``),
  ``N_seq·|o_i|`` (``seq_mean_token_mean``), ``N_seq`` (``seq_mean_token_sum``), ``N_seq·L``
  (``seq_mean_token_sum_norm``), ``N_grp·N_tok(g)`` (``prompt_mean``). Counts are global: either
  ``global_counts`` (from :func:`global_counts` on the global batch) or, when it is ``None``,
  computed from ``response_mask`` and ``psum``-ed over ``axis_name`` (then call this once on each
  shard's full local batch and slice the weights into micro-batches). ``|o_i|`` is always local:
  a sequence lives in one row. Empty masks give all-zero weights, never NaN.

  Args:
    response_mask: ``[B, T]`` 1 on tokens in the loss (any further 0/1 masks already multiplied in).
    mode: one of :data:`AGGREGATION_MODES`.
    group_ids: ``[B]`` or ``[B, T]`` prompt-group ids in ``[0, num_groups)`` (``prompt_mean``).
    num_groups: static number of group slots (``prompt_mean`` without ``global_counts``).
    segment_ids: ``[B, T]`` packed-row segment ids.
    max_len: the fixed length ``L`` of ``seq_mean_token_sum_norm``.
    global_counts: precomputed global counts.
    axis_name: mesh axis to ``psum`` counts over when ``global_counts`` is ``None``.

  Returns:
    ``[B, T]`` float32 weights.

  Example::

    gc = global_counts(mask, group_ids=gid, num_groups=G)          # once, global batch
    for sl in micro_batches:
      w = loss_weights(mask[sl], mode="prompt_mean", group_ids=gid[sl], global_counts=gc)
      loss, metrics = OBJECTIVES["ppo_clip"](..., loss_weights=w)
  """
  if mode not in AGGREGATION_MODES:
    raise ValueError(f"unknown aggregation mode {mode!r}; valid: {list(AGGREGATION_MODES)}")
  if global_counts is not None and axis_name is not None:
    raise ValueError("loss_weights: pass either global_counts or axis_name, not both")
  if mode == "prompt_mean" and group_ids is None:
    raise ValueError("loss_weights: mode 'prompt_mean' needs group_ids")
  if mode == "seq_mean_token_sum_norm" and (max_len is None or max_len <= 0):
    raise ValueError(f"loss_weights: mode 'seq_mean_token_sum_norm' needs a positive max_len, got {max_len!r}")
  mask = _as_mask(response_mask)
  if global_counts is None:
    if mode == "prompt_mean" and num_groups is None:
      raise ValueError("loss_weights: mode 'prompt_mean' needs num_groups (or global_counts)")
    global_counts = _count(mask, group_ids if mode == "prompt_mean" else None, num_groups, segment_ids,
                           axis_name)
  gc = global_counts

  def safe_inv(x):
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(x > 0, 1.0 / jnp.maximum(x, 1.0), 0.0)

  if mode == "token_mean":
    return mask * safe_inv(gc.tokens)
  if mode == "seq_mean_token_mean":
    return mask * safe_inv(sequence_sum(mask, segment_ids)) * safe_inv(gc.sequences)
  if mode == "seq_mean_token_sum":
    return mask * safe_inv(gc.sequences)
  if mode == "seq_mean_token_sum_norm":
    return mask * safe_inv(gc.sequences) / float(max_len)
  g = _broadcast_groups(group_ids, mask.shape)
  return mask * safe_inv(gc.group_tokens[g]) * safe_inv(gc.groups)


def aggregate(
    values: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    *,
    mode: str,
    group_ids: jax.Array | None = None,
    num_groups: int | None = None,
    segment_ids: jax.Array | None = None,
    max_len: int | None = None,
    global_counts: GlobalCounts | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:  # scalar float32
  """Aggregates per-token values: ``Σ_{b,t} loss_weights(mask, mode=...)·values`` (float32).

  Masked-out entries of ``values`` are ignored even when they are NaN/inf. See :func:`loss_weights`
  for the arguments.
  """
  w = loss_weights(mask, mode=mode, group_ids=group_ids, num_groups=num_groups, segment_ids=segment_ids,
                   max_len=max_len, global_counts=global_counts, axis_name=axis_name)
  values = jnp.asarray(values).astype(jnp.float32)
  return jnp.sum(jnp.where(w != 0, w * values, 0.0))
