"""Preference losses: DPO and its family, KTO, Bradley–Terry reward models, and packed sequence log-probs.

Every pairwise loss takes the policy's sequence log-probs of the chosen and rejected completions
(``log π(y_w|x)``, ``log π(y_l|x)``, ``[B]``) and, where it uses one, the reference model's, and returns
the per-pair losses ``[B]`` with per-pair metrics. The caller aggregates (a mean over the pairs of the
global batch, i.e. a sum of ``loss / num_pairs`` over micro-batches), so the loss does not depend on
how the batch is split; a pair's chosen and rejected sequence must sit in the same micro-batch.

With ``h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))`` (the log-ratio margin;
TRL calls it ``logits``) the registry :data:`PREFERENCE_LOSSES` holds:

| name | per-pair loss | source |
| --- | --- | --- |
| ``sigmoid`` | -(1-ε) log σ(βh) - ε log σ(-βh) | DPO (Rafailov et al. 2023); ε > 0: cDPO |
| ``robust`` | ((1-ε)(-log σ(βh)) - ε(-log σ(-βh))) / (1-2ε) | robust DPO (Chowdhury et al. 2024) |
| ``ipo`` | (h - 1/(2β))² | IPO (Azar et al. 2023) |
| ``hinge`` | max(0, 1 - βh) | SLiC-HF (Zhao et al. 2023) |
| ``simpo`` | -log σ(β·ℓ̄_w - β·ℓ̄_l - γ), ℓ̄ = log π(y)/|y| | SimPO (Meng et al. 2024) |
| ``orpo`` | NLL(y_w) - λ log σ(log odds(ℓ̄_w) - log odds(ℓ̄_l)), λ = β | ORPO (Hong et al. 2024) |

The unpaired KTO loss (:func:`kto_loss`, with :func:`kto_kl_reference`) and the reward-model loss
(:func:`bradley_terry_loss`) are separate functions. Sequence log-probs come from packed rows through
:func:`sequence_logps`. Formulas and sources: docs/losses.md, "Preference losses".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

PreferenceLoss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]

PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {}
"""Pairwise preference losses by name: ``fn(chosen, rejected, ref_chosen, ref_rejected, *, beta, ...)``."""

SEQUENCE_LOGP_MODES = ("sum", "mean")

_OPTION_DEFAULTS = {"label_smoothing": 0.0, "gamma": 0.0, "chosen_lengths": None,
                    "rejected_lengths": None, "chosen_nll": None}


def _register(name: str):
  def register(fn: PreferenceLoss) -> PreferenceLoss:
    PREFERENCE_LOSSES[name] = fn
    return fn
  return register


def _float(x) -> jax.Array:
  """``x`` as an array of at least float32 (float64 stays float64 under x64)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _ref(x, like: jax.Array) -> jax.Array:
  return jnp.zeros_like(like) if x is None else _float(x)


def _pair_metrics(rewards_chosen: jax.Array, rewards_rejected: jax.Array) -> dict[str, jax.Array]:
  """DPO's per-pair metrics from implicit rewards (gradients stopped), all ``[B]``."""
  rc = jax.lax.stop_gradient(rewards_chosen)
  rr = jax.lax.stop_gradient(rewards_rejected)
  return {"rewards_chosen": rc, "rewards_rejected": rr, "margins": rc - rr,
          "accuracy": (rc > rr).astype(rc.dtype)}


def _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps):
  """Policy/reference log-ratios of chosen and rejected, ``[B]`` each (a missing reference is 0)."""
  c, r = _float(chosen_logps), _float(rejected_logps)
  return c - _ref(ref_chosen_logps, c), r - _ref(ref_rejected_logps, r)


def _length_normalised(logps, lengths) -> jax.Array:
  """``logps / lengths`` (``lengths`` None: ``logps`` are already per-token means)."""
  logps = _float(logps)
  return logps if lengths is None else logps / jnp.maximum(_float(lengths), 1.0)


@_register("sigmoid")
def dpo_sigmoid(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
                beta: float = 0.1, label_smoothing: float = 0.0):
  """DPO (Rafailov et al. 2023, eq. 7), with conservative DPO's label smoothing ε (cDPO, Mitchell 2023).

  ``ℓ = -(1-ε) log σ(βh) - ε log σ(-βh)``, ``h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) -
  log π_ref(y_l))``. ε = 0 is plain DPO. A missing reference is 0 (TRL's ``reference_free``).

  Returns:
    per-pair losses ``[B]`` and metrics ``[B]``: ``rewards_chosen = β(log π(y_w) - log π_ref(y_w))``,
    ``rewards_rejected``, ``margins``, ``accuracy``.
  """
  lr_c, lr_r = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
  h = lr_c - lr_r  # [B]
  losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
            - label_smoothing * jax.nn.log_sigmoid(-beta * h))
  return losses, _pair_metrics(beta * lr_c, beta * lr_r)


@_register("robust")
def dpo_robust(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
               beta: float = 0.1, label_smoothing: float = 0.0):
  """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO"): unbiased under label flips ε.

  ``ℓ = ((1-ε)(-log σ(βh)) - ε(-log σ(-βh))) / (1 - 2ε)``, ε < 1/2 the flip rate; ε = 0 is DPO.
  Same metrics as :func:`dpo_sigmoid`.
  """
  if not 0.0 <= label_smoothing < 0.5:
    raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
  lr_c, lr_r = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
  h = lr_c - lr_r  # [B]
  losses = ((1.0 - label_smoothing) * -jax.nn.log_sigmoid(beta * h)
            - label_smoothing * -jax.nn.log_sigmoid(-beta * h)) / (1.0 - 2.0 * label_smoothing)
  return losses, _pair_metrics(beta * lr_c, beta * lr_r)


@_register("ipo")
def ipo(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
        beta: float = 0.1):
  """IPO (Azar et al. 2023, "A General Theoretical Paradigm...", eq. 17): ``ℓ = (h - 1/(2β))²``.

  ``h`` from the *summed* sequence log-probs, as in the paper (``β`` is the paper's τ). TRL's
  ``DPOTrainer`` instead feeds IPO per-token *mean* log-probs (``concatenated_forward`` divides by the
  completion length when ``loss_type="ipo"``); TRL's numbers are this function on
  ``sequence_logps(..., mode="mean")`` inputs. Same metrics as :func:`dpo_sigmoid`.
  """
  lr_c, lr_r = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
  h = lr_c - lr_r  # [B]
  return (h - 1.0 / (2.0 * beta)) ** 2, _pair_metrics(beta * lr_c, beta * lr_r)


@_register("hinge")
def hinge(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
          beta: float = 0.1):
  """SLiC-HF's calibration hinge (Zhao et al. 2023) on DPO's log-ratio margin: ``ℓ = max(0, 1 - βh)``.

  (TRL's ``loss_type="hinge"``; ``1/β`` is SLiC's margin δ.) Same metrics as :func:`dpo_sigmoid`.
  """
  lr_c, lr_r = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
  h = lr_c - lr_r  # [B]
  return jax.nn.relu(1.0 - beta * h), _pair_metrics(beta * lr_c, beta * lr_r)


@_register("simpo")
def simpo(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
          beta: float = 0.1, gamma: float = 0.0, label_smoothing: float = 0.0,
          chosen_lengths=None, rejected_lengths=None):
  """SimPO (Meng et al. 2024, eq. 6): reference-free, length-normalised, target margin γ.

  ``ℓ = -(1-ε) log σ(β ℓ̄_w - β ℓ̄_l - γ) - ε log σ(-(β ℓ̄_w - β ℓ̄_l - γ))`` with
  ``ℓ̄ = log π(y|x)/|y|``: pass summed log-probs with ``*_lengths`` ``[B]``, or per-token means
  (``sequence_logps(..., mode="mean")``) without. The reference log-probs are ignored. ε as in
  TRL's ``CPOTrainer`` (0 in the paper). Metrics use rewards ``β ℓ̄``.
  """
  del ref_chosen_logps, ref_rejected_logps
  c = beta * _length_normalised(chosen_logps, chosen_lengths)  # [B]
  r = beta * _length_normalised(rejected_logps, rejected_lengths)  # [B]
  z = c - r - gamma
  losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
  return losses, _pair_metrics(c, r)


def _log_odds(mean_logps: jax.Array) -> jax.Array:
  """``log(p / (1 - p))`` for ``p = exp(mean_logps)`` (< 1)."""
  return mean_logps - jnp.log(-jnp.expm1(mean_logps))


@_register("orpo")
def orpo(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
         beta: float = 0.1, chosen_lengths=None, rejected_lengths=None, chosen_nll=None):
  """ORPO (Hong et al. 2024, eq. 6-7): SFT on the chosen plus an odds-ratio term, reference-free.

  ``ℓ = NLL(y_w) + λ·(-log σ(log odds(ℓ̄_w) - log odds(ℓ̄_l)))``, ``odds(ℓ̄) = p/(1-p)`` with
  ``p = exp(ℓ̄)``, ``ℓ̄ = log π(y|x)/|y|`` (pass ``*_lengths`` with summed log-probs, or per-token
  means without), ``λ = beta``. ``chosen_nll`` ``[B]`` is the SFT term of each pair; default
  ``-ℓ̄_w`` (the chosen's per-token mean NLL; TRL averages the NLL over all chosen tokens of the
  batch instead). Metrics: rewards ``β ℓ̄`` and ``log_odds_ratio``.
  """
  del ref_chosen_logps, ref_rejected_logps
  c = _length_normalised(chosen_logps, chosen_lengths)  # [B]
  r = _length_normalised(rejected_logps, rejected_lengths)  # [B]
  log_odds_ratio = _log_odds(c) - _log_odds(r)  # [B]
  nll = -c if chosen_nll is None else _float(chosen_nll)
  losses = nll - beta * jax.nn.log_sigmoid(log_odds_ratio)
  metrics = _pair_metrics(beta * c, beta * r)
  metrics["log_odds_ratio"] = jax.lax.stop_gradient(log_odds_ratio)
  metrics["nll"] = jax.lax.stop_gradient(nll)
  return losses, metrics


def preference_loss(
    name: str,
    chosen_logps: jax.Array,  # [B]
    rejected_logps: jax.Array,  # [B]
    ref_chosen_logps: jax.Array | None = None,  # [B]
    ref_rejected_logps: jax.Array | None = None,  # [B]
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    chosen_lengths: jax.Array | None = None,  # [B]
    rejected_lengths: jax.Array | None = None,  # [B]
    chosen_nll: jax.Array | None = None,  # [B]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-pair losses ``[B]`` and metrics of :data:`PREFERENCE_LOSSES` ``[name]``.

  Options a loss does not use must keep their defaults (``ValueError`` otherwise), so a config that
  sets, say, ``gamma`` for ``sigmoid`` fails loudly. The caller aggregates (mean over pairs).
  """
  if name not in PREFERENCE_LOSSES:
    raise ValueError(f"unknown preference loss {name!r}; known: {sorted(PREFERENCE_LOSSES)}")
  fn = PREFERENCE_LOSSES[name]
  accepts = inspect.signature(fn).parameters
  options = {"label_smoothing": label_smoothing, "gamma": gamma, "chosen_lengths": chosen_lengths,
             "rejected_lengths": rejected_lengths, "chosen_nll": chosen_nll}
  kwargs = {"beta": beta}
  for key, value in options.items():
    if key in accepts:
      kwargs[key] = value
    elif (value is not None) if _OPTION_DEFAULTS[key] is None else (value != _OPTION_DEFAULTS[key]):
      raise ValueError(f"preference loss {name!r} does not use {key}")
  return fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, **kwargs)


def kto_kl_reference(
    kl_logps: jax.Array,  # [M]
    kl_ref_logps: jax.Array,  # [M]
    mask: jax.Array | None = None,  # [M]
) -> jax.Array:  # []
  """KTO's reference point ``z0 = max(0, mean_j (log π(y'_j|x_j) - log π_ref(y'_j|x_j)))``, detached.

  Ethayarajh et al. 2024 (KTO) estimate ``KL(π || π_ref)`` from *mismatched* pairs: as in TRL's
  ``KTOTrainer`` (``_get_kl_dataset``) prompt ``x_j`` is paired with the completion of example
  ``j-1`` of the batch (completions rotated by one), and both models score those pairs. ``mask``
  drops padding entries; the mean is over the entries given (pass the whole global batch for a
  split-invariant ``z0``). No gradient flows through ``z0`` (TRL detaches it as well).
  """
  d = _float(kl_logps) - _float(kl_ref_logps)  # [M]
  w = jnp.ones_like(d) if mask is None else _float(mask)
  kl = jnp.sum(w * d) / jnp.maximum(jnp.sum(w), 1.0)
  return jax.lax.stop_gradient(jnp.maximum(kl, 0.0))


def kto_loss(
    logps: jax.Array,  # [N]
    ref_logps: jax.Array,  # [N]
    desirable: jax.Array,  # [N] bool
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_ref: jax.Array | float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """KTO (Ethayarajh et al. 2024, the KTO loss) on unpaired, labelled completions; losses ``[N]``.

  With ``r = log π(y|x) - log π_ref(y|x)`` and ``z0 = kl_ref`` (:func:`kto_kl_reference`):
  desirable ``ℓ = λ_D (1 - σ(β(r - z0)))``, undesirable ``ℓ = λ_U (1 - σ(β(z0 - r)))``: the
  paper's ``λ_y - v(x, y)``, as TRL's ``KTOTrainer.kto_loss``. Metrics ``[N]``: ``rewards = β r``
  (detached). The caller averages over the examples.
  """
  r = _float(logps) - _float(ref_logps)  # [N]
  z0 = jax.lax.stop_gradient(_float(kl_ref))
  desirable = jnp.asarray(desirable, bool)
  losses = jnp.where(desirable, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (r - z0))),
                     undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - r))))
  return losses, {"rewards": jax.lax.stop_gradient(beta * r)}


def bradley_terry_loss(
    chosen_scores: jax.Array,  # [B]
    rejected_scores: jax.Array,  # [B]
    *,
    margin: jax.Array | None = None,  # [B]
    center_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Bradley–Terry reward-model loss (Ouyang et al. 2022 eq. 1; Llama 2's margin; TRL's centring).

  ``ℓ = -log σ(r_c - r_r - m) + c·(r_c + r_r)²`` per pair ``[B]``; ``m`` the optional per-pair margin
  (Touvron et al. 2023), ``c = center_coef`` (TRL's ``center_rewards_coefficient``, Eisenstein et
  al. 2023). Metrics ``[B]``: ``rewards_chosen``, ``rewards_rejected``, ``margins``, ``accuracy``.
  """
  rc, rr = _float(chosen_scores), _float(rejected_scores)
  m = 0.0 if margin is None else _float(margin)
  losses = -jax.nn.log_sigmoid(rc - rr - m) + center_coef * (rc + rr) ** 2
  return losses, _pair_metrics(rc, rr)


def _global_index(segment_ids, sequence_map, num_sequences):
  """Global sequence index per token ``[R, T]``; ``num_sequences`` for padding and unmapped tokens."""
  seg = jnp.asarray(segment_ids, jnp.int32)  # [R, T]
  if sequence_map is None:
    idx = seg - 1
  else:
    smap = jnp.asarray(sequence_map, jnp.int32)  # [R, K+1]
    idx = jnp.take_along_axis(smap, jnp.clip(seg, 0, smap.shape[1] - 1), axis=1)
    idx = jnp.where(seg > 0, idx, -1)
  return jnp.where((idx >= 0) & (idx < num_sequences), idx, num_sequences)


def sequence_lengths(
    segment_ids: jax.Array,  # [R, T]
    mask: jax.Array,  # [R, T]
    num_sequences: int,
    sequence_map: jax.Array | None = None,  # [R, K+1]
) -> jax.Array:  # [S]
  """Loss tokens of each global sequence ``[S]`` (float32), laid out as in :func:`sequence_logps`."""
  idx = _global_index(segment_ids, sequence_map, num_sequences)
  m = jnp.asarray(mask).astype(jnp.float32)
  return jax.ops.segment_sum(m.reshape(-1), idx.reshape(-1), num_segments=num_sequences + 1)[:-1]


def sequence_logps(
    token_logps: jax.Array,  # [R, T]
    segment_ids: jax.Array,  # [R, T]
    mask: jax.Array,  # [R, T]
    num_sequences: int,
    mode: str = "sum",
    sequence_map: jax.Array | None = None,  # [R, K+1]
) -> jax.Array:  # [S]
  """Sequence log-probs ``[S]`` from packed rows: ``Σ_t m·log π`` (``sum``) or its masked mean (``mean``).

  Rows are laid out as :mod:`jaxrl.data` packs them: ``segment_ids`` 1..K per row, 0 padding;
  ``mask`` marks the completion tokens (the prompt's are 0). ``sequence_map[r, k]`` is the global
  index (0..S-1) of segment ``k`` of row ``r`` (-1: none; column 0 is padding); without it the segment
  ids themselves are global (1..S). For rows from :func:`jaxrl.data.pack_samples`,
  ``sequence_map[r, 1 + k] = rows[r][k]`` with ``rows = jaxrl.data.assign_rows(...)`` (same
  arguments). A pair's chosen and rejected may share a row or not: the result depends only on which
  tokens belong to which sequence, not on the layout. ``mean`` is the length-normalised log-prob of
  SimPO / ORPO / TRL's IPO; sequences without tokens give 0.
  """
  if mode not in SEQUENCE_LOGP_MODES:
    raise ValueError(f"mode must be one of {SEQUENCE_LOGP_MODES}, got {mode!r}")
  idx = _global_index(segment_ids, sequence_map, num_sequences).reshape(-1)  # [R*T]
  lp = _float(token_logps)
  m = jnp.asarray(mask).astype(lp.dtype)
  x = jnp.where(m > 0, lp, 0.0) * m  # [R, T]
  sums = jax.ops.segment_sum(x.reshape(-1), idx, num_segments=num_sequences + 1)[:-1]  # [S]
  if mode == "sum":
    return sums
  counts = jax.ops.segment_sum(m.reshape(-1), idx, num_segments=num_sequences + 1)[:-1]  # [S]
  return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
