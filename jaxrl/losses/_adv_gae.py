"""Critic-based advantages: GAE and T-PPO's extended GAE (EGAE), and their value targets.
Conventions: :mod:`jaxrl.losses._advantages`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._adv_base import (
    Metrics,
    _F32,
    _finish,
    _outcome_tokens,
    _psum,
    _rewards,
    _safe_div,
    register_advantage,
)


# ----------------------------------------------------------------------------------------------------
# Critic-based: GAE and T-PPO's extended GAE.


@jax.jit
def _gae_core(*, rewards, response_mask, values, gamma, lam, token_rewards, finished, bootstrap_values):
  """Reverse ``lax.scan`` GAE over valid tokens; returns (advantages [B, T], returns [B, T])."""
  m = response_mask > 0
  b = m.shape[0]
  v = jnp.asarray(values).astype(_F32)
  done = jnp.ones(b, bool) if finished is None else jnp.asarray(finished).astype(bool)
  outcome = jnp.where(done, _rewards(rewards), 0.0)
  tok = _outcome_tokens(outcome, response_mask)
  if token_rewards is not None:
    tok = tok + jnp.asarray(token_rewards).astype(_F32)
  boot = jnp.zeros(b, _F32) if bootstrap_values is None else _rewards(bootstrap_values)
  terminal = jnp.where(done, 0.0, boot)  # V after the last valid token: 0 if finished

  def step(carry, x):
    next_v, next_a = carry
    r_t, v_t, m_t = x
    delta = r_t + gamma * next_v - v_t
    a = delta + gamma * lam * next_a
    a = jnp.where(m_t, a, next_a)  # masked positions (padding, tool output) are skipped
    nv = jnp.where(m_t, v_t, next_v)
    return (nv, a), a

  init = (terminal, jnp.zeros(b, _F32))
  _, adv = jax.lax.scan(step, init, (tok.T, v.T, m.T), reverse=True)
  adv = jnp.where(m, adv.T, 0.0)
  returns = jnp.where(m, adv + v, 0.0)
  return adv, returns


def gae_returns(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    finished: jax.Array | None = None,  # [B] bool
    bootstrap_values: jax.Array | None = None,  # [B]
) -> jax.Array:  # [B, T]
  r"""Value targets :math:`\hat R_t = \hat A_t + V(s_t)` of :func:`gae` / :func:`egae` (λ-returns).

  Args:
    rewards, response_mask, values, gamma, lam, token_rewards: as in :func:`gae`.
    finished, bootstrap_values: as in :func:`egae` (default: every response finished).

  Returns:
    ``[B, T]`` float32 returns, zero outside the mask.

  References:
    Schulman et al. 2016 (GAE).
  """
  _, returns = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma,
                         lam=lam, token_rewards=token_rewards, finished=finished,
                         bootstrap_values=bootstrap_values)
  return returns


@register_advantage("gae")
def gae(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""Generalised advantage estimation over response tokens, a reverse ``lax.scan`` over time.

  .. math::

      \delta_t = r_t + \gamma V(s_{t+1}) - V(s_t),\qquad \hat A_t = \delta_t + \gamma\lambda \hat A_{t+1}

  ``values[:, t]`` is ``V(s_t)``, the value before token ``t``. The outcome reward ``R_i`` is added to
  the last valid token's ``r_t`` (plus optional dense ``token_rewards``, e.g. ``-β·KL``). The state
  after the last valid token is terminal (``V = 0``), so masks that end early are handled; masked
  positions inside a response (e.g. tool output in multi-turn rollouts) are skipped, i.e. the next
  valid token's value and advantage carry over them.

  Args:
    rewards: ``[B]`` outcome rewards.
    response_mask: ``[B, T]``.
    values: ``[B, T]`` critic values.
    gamma: discount ``γ``.
    lam: GAE ``λ``.
    token_rewards: ``[B, T]`` optional dense rewards.
    group_ids, num_groups, sample_mask: unused; accepted so that the options common to the registry
      can be passed to every estimator.
    axis_name: data-parallel mesh axis, only for the metrics.

  Returns:
    ``(advantages [B, T] float32, metrics)``; :func:`gae_returns` gives the matching value targets.

  References:
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".
  """
  del group_ids, num_groups, sample_mask
  adv, returns = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma,
                           lam=lam, token_rewards=token_rewards, finished=None, bootstrap_values=None)
  ret_mean = _safe_div(_psum(returns.sum(), axis_name),
                       _psum((response_mask > 0).sum(dtype=_F32), axis_name))
  return _finish(adv, response_mask, axis_name, returns_mean=ret_mean)


@register_advantage("egae")
def egae(
    *,
    rewards: jax.Array,  # [B]
    response_mask: jax.Array,  # [B, T]
    values: jax.Array,  # [B, T]
    finished: jax.Array,  # [B] bool
    bootstrap_values: jax.Array,  # [B]
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: jax.Array | None = None,  # [B, T]
    group_ids: jax.Array | None = None,  # [B], unused
    num_groups: int | None = None,
    sample_mask: jax.Array | None = None,  # [B] bool
    axis_name: str | None = None,
) -> tuple[jax.Array, Metrics]:
  r"""T-PPO extended GAE: advantages inside a truncated generation window, bootstrapped at its end.

  .. math::

      \hat A_t = \delta_t + (\gamma\lambda)\delta_{t+1} + \cdots + (\gamma\lambda)^{\ell-t-1}\delta_{\ell-1},
      \qquad \delta_{\ell-1} = r_{\ell-1} + \gamma V(s_\ell) - V(s_{\ell-1})

  with ``ℓ`` the window end (notes 003, T-PPO table). ``response_mask`` covers the window's tokens.
  For an unfinished response (``finished=False``) the window end is not terminal: ``V(s_ℓ)`` is
  ``bootstrap_values`` (the critic's value after the window's last token) and no outcome reward is
  added, since the response has none yet. Finished responses are plain :func:`gae`. For every token
  ``t`` in the window, ``A^{full}_t = Â_t + (γλ)^{ℓ-t} A^{full}_ℓ`` when the bootstrap value is the
  full sequence's ``V(s_ℓ)``.

  Args:
    rewards: ``[B]`` outcome rewards (used for finished rows only).
    response_mask: ``[B, T]`` the window's valid tokens.
    values: ``[B, T]`` ``V(s_t)`` for the window's tokens.
    finished: ``[B]`` bool, the response ended inside this window.
    bootstrap_values: ``[B]`` ``V(s_ℓ)`` for unfinished rows (ignored for finished rows).
    gamma, lam, token_rewards: as in :func:`gae`.
    group_ids, num_groups, sample_mask: unused; accepted so that the options common to the registry
      can be passed to every estimator.
    axis_name: data-parallel mesh axis, only for the metrics.

  Returns:
    ``(advantages [B, T] float32, metrics)``.

  References:
    Fan et al. 2025, "Truncated Proximal Policy Optimization" (T-PPO), EGAE; notes 003 §T-PPO.
  """
  del group_ids, num_groups, sample_mask
  adv, _ = _gae_core(rewards=rewards, response_mask=response_mask, values=values, gamma=gamma, lam=lam,
                     token_rewards=token_rewards, finished=finished, bootstrap_values=bootstrap_values)
  unfinished = _psum((~jnp.asarray(finished).astype(bool)).sum(dtype=_F32), axis_name)
  total = _psum(jnp.asarray(response_mask.shape[0], _F32), axis_name)
  return _finish(adv, response_mask, axis_name, unfinished_fraction=_safe_div(unfinished, total))
