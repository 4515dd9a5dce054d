"""Advantage estimators: group baselines (GRPO family), critic-based GAE/EGAE, global normalisation.

The implementation is split by family: ``_adv_base`` (registry, reductions, group statistics),
``_adv_group`` (GRPO family), ``_adv_whiten`` (token whitening), ``_adv_gae`` (GAE/EGAE) and
``_adv_tree`` (SEED-GRPO, ARPO); this module gathers their public names.

Every estimator in :data:`ADVANTAGES` has one keyword-only signature::

    advantages, metrics = fn(*, rewards, group_ids, response_mask, **options)

``rewards`` is ``[B]`` (one scalar per response), ``group_ids`` ``[B]`` int (responses to the same
prompt share an id in ``[0, num_groups)``), ``response_mask`` ``[B, T]`` (1 on response tokens that
enter the loss). ``advantages`` is ``[B, T]`` float32, zero outside the mask; ``metrics`` maps names
to float32 scalars.

Conventions shared by all estimators:

- **Who counts.** A response takes part in group and batch statistics iff ``sample_mask`` is true
  (default: it has at least one valid response token) and ``0 <= group_id < num_groups``. Passing
  ``sample_mask`` explicitly lets a masked-out response (e.g. an overlong, filtered one: DAPO /
  DeepCoder GRPO+) still count in its group's baseline while receiving no gradient.
- **Static shapes.** Group statistics use ``jax.ops.segment_sum`` with the static ``num_groups``
  (default ``B``); nothing loops over groups, so every function is ``jit``/``vmap``-safe. String and
  integer switches (``mean_level``, ``num_groups``, ``k``) are static: bind them with
  ``functools.partial`` before ``jax.jit``.
- **Degenerate groups.** A group with fewer than two members or with all rewards equal gives every
  member advantage exactly 0 in group-baselined estimators (never NaN, never ``0 / eps`` noise).
- **Global statistics.** Batch-level means and stds are sums over the whole global batch divided
  by global counts. Inside ``jax.shard_map`` pass ``axis_name`` (the data-parallel mesh axis): every
  segment sum, count, max and min is ``psum``/``pmax``/``pmin``-reduced over it, so groups may even
  span shards (then ``num_groups`` must cover the global group ids). Token-level whitening also
  accepts precomputed additive :class:`Moments` (e.g. summed over gradient-accumulation
  micro-batches) through ``global_moments``.
- Population statistics (ddof 0) unless ``unbiased_std=True``; normalisation is
  ``(x - mean) / (std + eps)``.
"""

from jaxrl.losses._adv_base import ADVANTAGES, Moments, masked_moments, register_advantage
from jaxrl.losses._adv_gae import egae, gae, gae_returns
from jaxrl.losses._adv_group import dr_grpo, gpg, grpo, grpo_passk, maxrl, opo, remax, rloo
from jaxrl.losses._adv_tree import arpo_hard, arpo_soft, seed_grpo
from jaxrl.losses._adv_whiten import global_normalize, reinforce_pp, reinforce_pp_baseline

__all__ = [
    "ADVANTAGES",
    "Moments",
    "arpo_hard",
    "arpo_soft",
    "dr_grpo",
    "egae",
    "gae",
    "gae_returns",
    "global_normalize",
    "gpg",
    "grpo",
    "grpo_passk",
    "masked_moments",
    "maxrl",
    "opo",
    "register_advantage",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "seed_grpo",
]
