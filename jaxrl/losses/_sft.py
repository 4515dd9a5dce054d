"""SFT loss weighting under sequence packing: every mode of the seeds' note, split-invariant.

The note (seeds, "NLP——样本packing与权重讨论") lists how per-token losses can be combined. With
``l_i`` the per-token NLL and sums over loss tokens of the *global* batch (all data-parallel
shards and all gradient-accumulation micro-batches):

  token_sum          L = Σ_i l_i                       or  (1/GBS) Σ_i l_i      (GBS a constant)
  global_token_mean  L = (1/GBS_Token_Num) Σ_i l_i
  row_mean           L = Σ_row (1/|row|) Σ_{i∈row} l_i  or  (1/GBS) Σ_row ...   ("packing 样本内部")
  sample_mean        L = (1/D) Σ_{s true sample} (1/|s|) Σ_{i∈s} l_i,  D ∈ {1, GBS, GBS_true}
  turn_mean          L = (1/D) Σ_{u assistant turn} (1/|u|) Σ_{i∈u} l_i, D ∈ {1, GBS, GBS_true}

Why the packed-row mean and the ``/GBS`` divisor differ from the true-sample forms: a packed row
holds several true samples, so averaging within a row gives a long sample a larger share of its
row than a short neighbour (the note: "长样本占优"), and packing changes the number of rows: GBS
counts rows (packed sequences), not true samples, so ``/GBS`` rescales every sample by a factor
that depends on how tightly the batch was packed. Only ``/GBS_true`` (true samples, or true turns
for ``turn_mean``) makes every sample weigh the same in packed and unpacked layouts.

Everything is written as per-token weights ``w`` with ``L = Σ w · l``
(:func:`sft_loss_weights`). A true sample or turn never spans two rows, so its token count is
computed from its own row; the divisors are global counts (:func:`sft_global_counts`, with a
``psum`` over ``axis_name`` under ``shard_map``). Hence each micro-batch's ``Σ w · l`` adds up to
the global loss, and loss and gradient do not depend on how the batch is split across devices or
micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

SFT_MODES = ("token_sum", "global_token_mean", "row_mean", "sample_mean", "turn_mean")
SFT_DIVISORS = ("none", "gbs", "gbs_true")
_ALLOWED = {
    "token_sum": ("none", "gbs"),
    "global_token_mean": (None,),
    "row_mean": ("none", "gbs"),
    "sample_mean": SFT_DIVISORS,
    "turn_mean": SFT_DIVISORS,
}
_DEFAULT_DIVISOR = {"token_sum": "none", "global_token_mean": None, "row_mean": "gbs",
                    "sample_mean": "gbs_true", "turn_mean": "gbs_true"}


class SFTGlobalCounts(NamedTuple):
  """Counts over the whole global batch (float32 scalars)."""

  tokens: jax.Array
  "Loss tokens, ``GBS_Token_Num``."
  samples: jax.Array
  "True samples with at least one loss token, ``GBS_true`` of ``sample_mean``."
  turns: jax.Array
  "Assistant turns with at least one loss token, ``GBS_true`` of ``turn_mean``."
  rows: jax.Array
  "Rows (packed sequences): the ``GBS`` divisor when no constant ``gbs`` is given."


def _num_segments(ids: jax.Array, num_segments: int | None) -> int:
  return ids.size + 1 if num_segments is None else num_segments


def _per_id_counts(loss_mask, ids, num_segments):
  """Loss tokens per id ([num_segments]); id 0 (no sample / no turn) is zeroed."""
  counts = jax.ops.segment_sum(loss_mask.reshape(-1), ids.reshape(-1),
                               num_segments=num_segments)  # [S]
  return counts.at[0].set(0.0)


def sft_global_counts(
    loss_mask: jax.Array,  # [B, T]
    sample_ids: jax.Array,  # [B, T]
    turn_ids: jax.Array,  # [B, T]
    *,
    axis_name: str | tuple[str, ...] | None = None,
    num_segments: int | None = None,
) -> SFTGlobalCounts:
  """Counts the divisors of every mode over the global batch.

  Pass the whole global batch (every micro-batch), or under ``shard_map`` this device's part of
  it with ``axis_name`` set to the data-parallel mesh axes: the local counts are then ``psum`` ed.
  The psum is exact because a sample (and a turn) lies within one row, hence within one shard.

  Args:
    loss_mask: [B, T] 1 where a token has a loss.
    sample_ids: [B, T] int, unique per true sample within the global batch, 0 = padding.
    turn_ids: [B, T] int, unique per assistant turn within the global batch, 0 = no loss.
    axis_name: mesh axis name(s) to ``psum`` over, or None when the arrays are the global batch.
    num_segments: static bound on the ids (all ids < num_segments; larger ids are ignored by
      ``segment_sum`` and their tokens get no weight); default ``B * T + 1``. Under
      ``shard_map`` pass the global batch's bound, since ids are numbered globally.

  Returns:
    :class:`SFTGlobalCounts`.
  """
  mask = loss_mask.astype(jnp.float32)
  ns_s = _num_segments(sample_ids, num_segments)
  ns_t = _num_segments(turn_ids, num_segments)
  counts = SFTGlobalCounts(
      tokens=jnp.sum(mask),
      samples=jnp.sum(_per_id_counts(mask, sample_ids, ns_s) > 0).astype(jnp.float32),
      turns=jnp.sum(_per_id_counts(mask, turn_ids, ns_t) > 0).astype(jnp.float32),
      rows=jnp.asarray(loss_mask.shape[0], jnp.float32),
  )
  if axis_name is not None:
    counts = SFTGlobalCounts(*jax.lax.psum(tuple(counts), axis_name))
  return counts


def _check(mode: str, divisor: str | None) -> str | None:
  if mode not in _ALLOWED:
    raise ValueError(f"SFT loss mode must be one of {list(SFT_MODES)}, got {mode!r}")
  if divisor == "default":
    divisor = _DEFAULT_DIVISOR[mode]
  if divisor not in _ALLOWED[mode]:
    raise ValueError(f"divisor for SFT mode {mode!r} must be one of {list(_ALLOWED[mode])}, "
                     f"got {divisor!r}")
  return divisor


def sft_loss_weights(
    mode: str,
    loss_mask: jax.Array,  # [B, T]
    sample_ids: jax.Array,  # [B, T]
    turn_ids: jax.Array,  # [B, T]
    *,
    divisor: str | None = "default",
    global_counts: SFTGlobalCounts | None = None,
    gbs: float | None = None,
    num_segments: int | None = None,
) -> jax.Array:
  """Per-token weights ``w`` [B, T] such that the SFT loss is ``Σ w · nll``.

  With ``m`` the loss mask, ``n(x)`` the loss tokens of the sample / turn / row holding token
  ``x``, and ``D`` the divisor:

    token_sum          w = m / D,       D = 1 (``none``) or GBS (``gbs``)
    global_token_mean  w = m / GBS_Token_Num
    row_mean           w = m / (n_row(x) · D),     D = 1 or GBS
    sample_mean        w = m / (n_sample(x) · D),  D = 1, GBS or GBS_true (true samples)
    turn_mean          w = m / (n_turn(x) · D),    D = 1, GBS or GBS_true (assistant turns)

  GBS is ``gbs`` when given, else ``global_counts.rows``. ``n(x)`` comes from the rows passed (a
  sample or turn never spans rows), ``D`` from ``global_counts``, so weights of any subset of the
  global batch's rows equal the global weights on those rows. Tokens with ``m = 1`` but id 0 get
  no weight in ``sample_mean`` / ``turn_mean``. Divisors are clamped to at least 1, so an empty
  batch has weight 0.

  Args:
    mode: one of :data:`SFT_MODES`.
    loss_mask: [B, T] 1 where a token has a loss.
    sample_ids: [B, T] int, unique per true sample in the global batch, 0 = padding.
    turn_ids: [B, T] int, unique per assistant turn in the global batch, 0 = no loss.
    divisor: ``none``, ``gbs`` or ``gbs_true`` (see above; ``default`` picks ``none`` for
      token_sum, ``gbs`` for row_mean, ``gbs_true`` for sample/turn_mean, None for
      global_token_mean, which has its own divisor).
    global_counts: :func:`sft_global_counts` of the global batch; default: counted from these
      arrays (they are then the global batch).
    gbs: a constant GBS (e.g. the configured rows per global batch).
    num_segments: static bound on ids; default ``B * T + 1`` (see :func:`sft_global_counts`).

  Returns:
    [B, T] float32 weights.

  References:
    seeds, "NLP——样本packing与权重讨论".
  """
  divisor = _check(mode, divisor)
  mask = loss_mask.astype(jnp.float32)  # [B, T]
  if global_counts is None:
    global_counts = sft_global_counts(loss_mask, sample_ids, turn_ids, num_segments=num_segments)
  gbs_value = global_counts.rows if gbs is None else jnp.asarray(gbs, jnp.float32)
  if mode == "global_token_mean":
    return mask / jnp.maximum(global_counts.tokens, 1.0)
  denom = {"none": jnp.float32(1.0), "gbs": gbs_value,
           "gbs_true": global_counts.turns if mode == "turn_mean" else global_counts.samples}[divisor]
  denom = jnp.maximum(denom, 1.0)
  if mode == "token_sum":
    return mask / denom
  if mode == "row_mean":
    per_token = jnp.sum(mask, axis=-1, keepdims=True)  # [B, 1]
  else:
    ids = sample_ids if mode == "sample_mean" else turn_ids
    counts = _per_id_counts(mask, ids, _num_segments(ids, num_segments))  # [S]
    per_token = jnp.where(ids > 0, counts[ids], 0.0)  # [B, T]
  return jnp.where(per_token > 0, mask / jnp.where(per_token > 0, per_token, 1.0), 0.0) / denom


def _weighted_loss(mode, nll, loss_mask, sample_ids, turn_ids, *, divisor, global_counts, gbs,
                   num_segments):
  sample_ids = jnp.zeros(loss_mask.shape, jnp.int32) if sample_ids is None else sample_ids
  turn_ids = jnp.zeros(loss_mask.shape, jnp.int32) if turn_ids is None else turn_ids
  w = sft_loss_weights(mode, loss_mask, sample_ids, turn_ids, divisor=divisor,
                       global_counts=global_counts, gbs=gbs, num_segments=num_segments)  # [B, T]
  mask = loss_mask.astype(jnp.float32)
  nll = jnp.where(mask > 0, nll.astype(jnp.float32), 0.0)  # [B, T]
  loss = jnp.sum(w * nll)
  metrics = {"loss": loss, "loss_tokens": jnp.sum(mask), "nll_sum": jnp.sum(nll),
             "weight_sum": jnp.sum(w)}
  return loss, metrics


_DOC_ARGS = """
  Args:
    nll: [B, T] per-token negative log-likelihood of ``targets``.
    loss_mask: [B, T] 1 where a token has a loss.
    sample_ids: [B, T] int, unique per true sample in the global batch, 0 = padding.
    turn_ids: [B, T] int, unique per assistant turn in the global batch, 0 = no loss.
    divisor: see :func:`sft_loss_weights`.
    global_counts: :func:`sft_global_counts` of the global batch; default: counted from these
      arrays (they are then the whole global batch).
    gbs: a constant GBS for the ``gbs`` divisor (default: rows in the global batch).
    num_segments: static bound on ids (default ``B * T + 1``).

  Returns:
    ``(loss, metrics)``: the scalar ``Σ w · nll`` of these rows, and additive metrics ``loss``,
    ``loss_tokens``, ``nll_sum`` (masked), ``weight_sum`` — summing them over micro-batches and
    devices gives the global batch's values.

  References:
    seeds, "NLP——样本packing与权重讨论".
"""


def sft_token_sum(nll, loss_mask, sample_ids=None, turn_ids=None, *, divisor="none",
                  global_counts=None, gbs=None, num_segments=None):
  """Every token of the data set weighs the same: ``L = Σ_i l_i`` or ``(1/GBS) Σ_i l_i``.

  With ``divisor="gbs"`` pass a constant ``gbs`` (the configured global batch size); then the loss
  is the same for packed and unpacked layouts. Pre-training weighting.
  """
  return _weighted_loss("token_sum", nll, loss_mask, sample_ids, turn_ids, divisor=divisor,
                        global_counts=global_counts, gbs=gbs, num_segments=num_segments)


def sft_global_token_mean(nll, loss_mask, sample_ids=None, turn_ids=None, *, divisor=None,
                          global_counts=None, gbs=None, num_segments=None):
  """Tokens of one global batch weigh the same: ``L = (1/GBS_Token_Num) Σ_i l_i``.

  ``GBS_Token_Num`` counts loss tokens over the whole global batch (not per micro-batch or per
  device), so the result does not depend on packing or on how the batch is split.
  """
  return _weighted_loss("global_token_mean", nll, loss_mask, sample_ids, turn_ids,
                        divisor=divisor, global_counts=global_counts, gbs=gbs,
                        num_segments=num_segments)


def sft_row_mean(nll, loss_mask, sample_ids=None, turn_ids=None, *, divisor="gbs",
                 global_counts=None, gbs=None, num_segments=None):
  """Naive packed mean: ``L = (1/GBS) Σ_row (1/|row|) Σ_{i∈row} l_i`` (or without ``1/GBS``).

  This is the per-sequence mean of an unpacked trainer applied to packed rows. The note warns
  that it differs from the unpacked per-sample mean: a packed row mixes several true samples, so
  long samples dominate their row, and GBS counts rows, which packing changes. Kept for
  comparison; prefer ``sample_mean`` with ``gbs_true``.
  """
  return _weighted_loss("row_mean", nll, loss_mask, sample_ids, turn_ids, divisor=divisor,
                        global_counts=global_counts, gbs=gbs, num_segments=num_segments)


def sft_sample_mean(nll, loss_mask, sample_ids, turn_ids=None, *, divisor="gbs_true",
                    global_counts=None, gbs=None, num_segments=None):
  """True samples weigh the same: ``L = (1/D) Σ_s (1/|s|) Σ_{i∈s} l_i``, D ∈ {1, GBS, GBS_true}.

  ``s`` runs over true samples (identified by ``sample_ids``, not rows). With ``D = GBS_true``
  (true samples in the global batch) every sample weighs ``1/GBS_true`` in packed and unpacked
  layouts alike; ``D = GBS`` divides by rows instead, which packing changes (the note: "此时除以
  GBS 和除以 GBS_true 是不同的").
  """
  return _weighted_loss("sample_mean", nll, loss_mask, sample_ids, turn_ids, divisor=divisor,
                        global_counts=global_counts, gbs=gbs, num_segments=num_segments)


def sft_turn_mean(nll, loss_mask, sample_ids, turn_ids, *, divisor="gbs_true",
                  global_counts=None, gbs=None, num_segments=None):
  """Assistant turns weigh the same: ``L = (1/D) Σ_u (1/|u|) Σ_{i∈u} l_i``, D ∈ {1, GBS, GBS_true}.

  Each assistant turn (``turn_ids``) is treated as a sample, whatever its length and whether it
  shares a conversation or a row with others (the note's "轮次即样本", way two); ``GBS_true`` is the
  number of turns in the global batch.
  """
  return _weighted_loss("turn_mean", nll, loss_mask, sample_ids, turn_ids, divisor=divisor,
                        global_counts=global_counts, gbs=gbs, num_segments=num_segments)


for _fn in (sft_token_sum, sft_global_token_mean, sft_row_mean, sft_sample_mean, sft_turn_mean):
  if _fn.__doc__:  # None under python -OO
    _fn.__doc__ += _DOC_ARGS
del _fn

SFT_LOSSES: dict[str, Callable] = {
    "token_sum": sft_token_sum,
    "global_token_mean": sft_global_token_mean,
    "row_mean": sft_row_mean,
    "sample_mean": sft_sample_mean,
    "turn_mean": sft_turn_mean,
}
"""Mode name → loss function, all with the signature
``fn(nll, loss_mask, sample_ids, turn_ids, *, divisor, global_counts, gbs, num_segments)``."""

__all__ = [
    "SFT_DIVISORS",
    "SFT_LOSSES",
    "SFT_MODES",
    "SFTGlobalCounts",
    "sft_global_counts",
    "sft_global_token_mean",
    "sft_loss_weights",
    "sft_row_mean",
    "sft_sample_mean",
    "sft_token_sum",
    "sft_turn_mean",
]
