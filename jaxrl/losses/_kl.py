"""Per-token KL estimators, the KL loss / KL-penalised rewards, and KL coefficient controllers.

Estimators take sampled-token log-probs of the policy and the reference, ``x = log π_θ(y_t) -
log π_ref(y_t)`` with ``y_t ~ π_θ``, and estimate ``KL(π_θ ‖ π_ref)`` per token:

| name | value | gradient (w.r.t. log π_θ) |
| --- | --- | --- |
| ``k1`` | ``x`` | 1 |
| ``k2`` | ``x²/2`` | ``x`` |
| ``k3`` | ``e^{-x} - 1 + x`` (``r - log r - 1``, ``r = π_ref/π_θ``) | ``1 - e^{-x}`` |
| ``abs`` | ``|x|`` | ``sign(x)`` |
| ``low_var_kl`` | ``k3`` clamped to ``[-10, 10]`` (verl) | as ``k3`` inside the clamp |
| ``k1+``, ``k3+``, ``abs+``, ``low_var_kl+`` | the forward value of the base estimator | ``x`` (k2's) |

The ``+`` (straight-through) variants report one estimator but differentiate like ``k2``, whose
gradient is the unbiased gradient of ``KL(π_θ‖π_ref)`` for on-policy samples. References: Schulman
2020, "Approximating KL Divergence"; verl ``kl_penalty`` (``"+"`` suffix = straight-through k2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "KL",
    "KLController",
    "KLControllerState",
    "adaptive_kl_controller",
    "fixed_kl_controller",
    "kl_loss",
    "kl_penalized_rewards",
]

_BOUND = 20.0


def _log_ratio(logprobs, ref_logprobs):
  lp = jnp.asarray(logprobs).astype(jnp.float32)
  ref = jax.lax.stop_gradient(jnp.asarray(ref_logprobs).astype(jnp.float32))
  return jnp.clip(lp - ref, -_BOUND, _BOUND)


def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """``k1 = log π_θ - log π_ref`` (unbiased, high variance, can be negative)."""
  return _log_ratio(logprobs, ref_logprobs)


def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """``k2 = (log π_θ - log π_ref)² / 2`` (biased, low variance, gradient = the KL gradient)."""
  x = _log_ratio(logprobs, ref_logprobs)
  return 0.5 * x * x


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """``k3 = π_ref/π_θ - log(π_ref/π_θ) - 1`` (unbiased, non-negative; GRPO's KL)."""
  x = _log_ratio(logprobs, ref_logprobs)
  return jnp.expm1(-x) + x


def kl_abs(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """``|log π_θ - log π_ref|``."""
  return jnp.abs(_log_ratio(logprobs, ref_logprobs))


def kl_low_var(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """verl's ``low_var_kl``: ``k3`` clamped to ``[-10, 10]``."""
  return jnp.clip(kl_k3(logprobs, ref_logprobs), -10.0, 10.0)


@jax.custom_jvp
def _value_with_grad_of(value: jax.Array, surrogate: jax.Array) -> jax.Array:
  """Returns ``value`` exactly; its derivative is that of ``surrogate``."""
  return value


@_value_with_grad_of.defjvp
def _value_with_grad_of_jvp(primals, tangents):
  return primals[0], tangents[1]


def _straight_through(fn: Callable[[jax.Array, jax.Array], jax.Array]):
  def estimator(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    return _value_with_grad_of(fn(logprobs, ref_logprobs), kl_k2(logprobs, ref_logprobs))

  estimator.__doc__ = f"Straight-through: forward value of ``{fn.__name__}``, gradient of ``k2``."
  estimator.__name__ = f"{fn.__name__}_st"
  return estimator


KL: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
    "low_var_kl": kl_low_var,
    "k1+": _straight_through(kl_k1),
    "k3+": _straight_through(kl_k3),
    "abs+": _straight_through(kl_abs),
    "low_var_kl+": _straight_through(kl_low_var),
}
"""Per-token KL estimators ``KL[name](logprobs [B, T], ref_logprobs [B, T]) -> [B, T]`` float32."""


def _estimator(name: str):
  if name not in KL:
    raise ValueError(f"unknown KL estimator {name!r}; valid: {sorted(KL)}")
  return KL[name]


def kl_loss(
    *,
    logprobs: jax.Array,  # [B, T]
    ref_logprobs: jax.Array,  # [B, T]
    loss_weights: jax.Array,  # [B, T]
    estimator: str = "k3",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""KL regulariser in the loss: ``Σ_{b,t} w · KL[estimator](log π_θ, log π_ref)``.

  Add ``β · kl_loss`` to a policy objective (GRPO's ``-β D_KL[π_θ‖π_ref]`` term with ``k3``). Tokens
  with ``w == 0`` never contribute.

  Args:
    logprobs: ``[B, T]`` log π_θ (differentiable).
    ref_logprobs: ``[B, T]`` log π_ref (data).
    loss_weights: ``[B, T]`` aggregation weights.
    estimator: a key of :data:`KL`.

  Returns:
    ``(loss, {"kl": loss})``.

  References: Shao et al. 2024, "DeepSeekMath" (GRPO) eq. 4.
  """
  fn = _estimator(estimator)
  w = jax.lax.stop_gradient(jnp.asarray(loss_weights).astype(jnp.float32))
  valid = w != 0
  lp = jnp.where(valid, jnp.asarray(logprobs).astype(jnp.float32), 0.0)
  ref = jnp.where(valid, jnp.asarray(ref_logprobs).astype(jnp.float32), 0.0)
  loss = jnp.sum(jnp.where(valid, w * fn(lp, ref), 0.0))
  return loss, {"kl": jax.lax.stop_gradient(loss)}


def kl_penalized_rewards(
    rewards: jax.Array,  # [B] or [B, T]
    logprobs: jax.Array,  # [B, T]
    ref_logprobs: jax.Array,  # [B, T]
    response_mask: jax.Array,  # [B, T]
    *,
    kl_coef: float | jax.Array,
    estimator: str = "k1",
) -> tuple[jax.Array, jax.Array]:
  r"""Folds a KL penalty into per-token rewards: ``r'_t = r_t - β · KL_t``.

  A sequence reward ``[B]`` is placed on the last response token of its row first (the RLHF/PPO
  convention, Ziegler et al. 2019). The result is stop-gradient (rewards are data).

  Args:
    rewards: ``[B]`` sequence rewards or ``[B, T]`` token rewards.
    logprobs: ``[B, T]`` log π of the sampling policy.
    ref_logprobs: ``[B, T]`` log π_ref.
    response_mask: ``[B, T]``.
    kl_coef: β (e.g. from a :class:`KLController`).
    estimator: a key of :data:`KL`.

  Returns:
    ``(token_rewards [B, T], kl [B, T])``, both 0 off the mask.

  References: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" eq. 2;
  Ouyang et al. 2022 (InstructGPT).
  """
  fn = _estimator(estimator)
  mask = jnp.asarray(response_mask).astype(jnp.float32)
  valid = mask > 0
  sg = jax.lax.stop_gradient
  lp = jnp.where(valid, sg(jnp.asarray(logprobs).astype(jnp.float32)), 0.0)
  ref = jnp.where(valid, sg(jnp.asarray(ref_logprobs).astype(jnp.float32)), 0.0)
  kl = jnp.where(valid, fn(lp, ref), 0.0)
  rewards = sg(jnp.asarray(rewards).astype(jnp.float32))
  if rewards.ndim == 1:
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # [B]
    onehot = (jnp.arange(t)[None, :] == last[:, None]) & jnp.any(valid, axis=1, keepdims=True)
    rewards = jnp.where(onehot, rewards[:, None], 0.0)
  else:
    rewards = jnp.where(valid, rewards, 0.0)
  beta = sg(jnp.asarray(kl_coef, jnp.float32))
  return rewards - beta * kl, kl


class KLControllerState(NamedTuple):
  """State of a KL coefficient controller: the current coefficient β (float32 scalar)."""

  coef: jax.Array


class KLController(NamedTuple):
  """An optax-style pair of pure functions.

  ``init() -> KLControllerState`` and ``update(state, current_kl, n_steps=1) -> KLControllerState``.
  """

  init: Callable[[], KLControllerState]
  update: Callable[..., KLControllerState]


def fixed_kl_controller(init_coef: float) -> KLController:
  """A constant coefficient: ``update`` returns the state unchanged.

  Args:
    init_coef: β.

  Returns:
    A :class:`KLController`.
  """

  def init() -> KLControllerState:
    return KLControllerState(coef=jnp.asarray(init_coef, jnp.float32))

  def update(state: KLControllerState, current_kl=None, n_steps=1) -> KLControllerState:
    del current_kl, n_steps
    return state

  return KLController(init=init, update=update)


def adaptive_kl_controller(init_coef: float, *, target: float, horizon: float) -> KLController:
  r"""Ziegler et al.'s proportional controller that steers the measured KL towards a target.

  ``e = clip(KL / KL_target - 1, -0.2, 0.2)``; ``β ← β · (1 + e · n_steps / horizon)``.

  Args:
    init_coef: initial β.
    target: target KL per sequence (or whatever unit ``current_kl`` is measured in).
    horizon: the controller's time constant in samples/steps.

  Returns:
    A :class:`KLController`; ``update`` is jit-safe.

  References: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" §2.2.
  """
  if target <= 0 or horizon <= 0:
    raise ValueError(f"adaptive_kl_controller: target and horizon must be > 0, got {target!r}, {horizon!r}")

  def init() -> KLControllerState:
    return KLControllerState(coef=jnp.asarray(init_coef, jnp.float32))

  def update(state: KLControllerState, current_kl, n_steps=1) -> KLControllerState:
    err = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    mult = 1.0 + err * jnp.asarray(n_steps, jnp.float32) / horizon
    return KLControllerState(coef=state.coef * mult)

  return KLController(init=init, update=update)
