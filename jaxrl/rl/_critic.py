"""PPO's critic: a value model, its GAE advantages and its clipped-value-loss updates.

Design (docs/design.md, "PPO's critic"): the critic is a separate model with the policy's
architecture whose unembedding is replaced by a scalar value head ``[D] -> 1`` (``value_head``, zero
initialised, so ``V ≡ 0`` before the first update: :class:`jaxrl.models.ValueModel`, which the reward
model of ``jaxrl.pref`` shares). Its trunk starts from the policy's initial weights (the ``model:``
section) or from ``critic.model``; it has its own optimizer (``critic.optim``), its own train step
(:func:`jaxrl.train.make_train_step`) and is sharded by the same logical rules.

Per RL step (:class:`Critic`):

1. The packed mini-batches go through the critic on device (a jitted scan over micro-batches):
   ``V(s_t)`` for every response token, at the same place as the token's log-prob (position ``t`` of
   the packed row holds the prefix that predicts response token ``t``).
2. On the host the values are unpacked per sample (:class:`ResponseMap`) and fed to the configured
   estimator (``gae`` or ``egae``) with the sequence reward at the last response token and, if
   ``critic.kl_reward_coef > 0``, the per-token penalty ``-β·KL(π_old‖π_ref)`` as dense rewards
   (:func:`gae_advantages`), plus any dense rewards the trainer passes (``reward.implicit_prm``: ``coef · r_k`` at
   the last token of each step k). The advantages (whitened over the batch by default), λ-returns and old
   values are written back into the packed batches.
3. After every actor update, the critic takes one update on the same mini-batch with the clipped
   value loss (:func:`jaxrl.losses.value_loss`), aggregated like the policy loss.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import losses, sharding, train
from jaxrl.models import ModelSource, VisionInputs, build_value_model

@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticConfig:
  """The ``critic:`` section: a value model trained alongside the policy (PPO with GAE)."""

  model: ModelSource | None = None
  "Where the critic's trunk comes from; default the policy's `model:` section (its initial weights)."
  optim: train.OptimConfig = dataclasses.field(default_factory=lambda: train.OptimConfig(lr=1e-5))
  "The critic's own optimizer; its schedule counts the same updates as the policy's."
  value_clip: float | None = 0.2
  "ε_v of the clipped value loss (V within V_old ± ε_v); null: plain squared error."
  aggregation: str | None = None
  "A jaxrl.losses.AGGREGATION_MODES entry for the value loss; default algorithm.aggregation."
  whiten_advantages: bool = True
  "Masked whitening (mean 0, std 1 over the step's response tokens) of the GAE advantages, as verl does."
  kl_reward_coef: float = 0.0
  "β of a per-token penalty -β·KL(π_old‖π_ref) added to the rewards GAE sees (needs the reference policy)."
  kl_reward_estimator: str = "k1"
  "A key of jaxrl.losses.KL for that penalty."

  def __post_init__(self):
    if self.value_clip is not None and self.value_clip <= 0:
      raise ValueError(f"critic.value_clip must be > 0 or null, got {self.value_clip!r}")
    if self.aggregation is not None and self.aggregation not in losses.AGGREGATION_MODES:
      raise ValueError(f"critic.aggregation: unknown {self.aggregation!r}; known: {list(losses.AGGREGATION_MODES)}")
    if self.kl_reward_coef < 0:
      raise ValueError(f"critic.kl_reward_coef must be >= 0, got {self.kl_reward_coef!r}")
    if self.kl_reward_estimator not in losses.KL:
      raise ValueError(f"critic.kl_reward_estimator: unknown {self.kl_reward_estimator!r}; "
                       f"known: {sorted(losses.KL)}")


# ----------------------------------------------------------------------------------------------------
# The value model


def critic_values(graphdef, params, mb) -> jax.Array:  # [B, T] float32
  """``V(s_t)`` of packed rows: position ``t`` is the state after ``tokens[: t + 1]``."""
  return nnx.merge(graphdef, params)(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                                     rope_positions=mb.get("rope_positions"),
                                     images=VisionInputs.from_batch(mb))


# ----------------------------------------------------------------------------------------------------
# Packed rows <-> per-sample response tokens


@dataclasses.dataclass(frozen=True)
class ResponseMap:
  """Where the response tokens of a packed mini-batch's samples sit.

  Entry ``k`` is response token ``token[k]`` of sample ``sample[k]``, at row ``row[k]`` of micro-batch
  ``micro[k]``, column ``col[k]``. Interleaved device arrays (``PackedBatch.interleaved``) put row ``r``
  of micro-batch ``m`` at row ``r·M + m``: a ``[R·M, T]`` array reshaped to ``[R, M, T]`` is indexed
  ``[row, micro, col]``.
  """

  micro: np.ndarray  # [K] int
  row: np.ndarray  # [K]
  col: np.ndarray  # [K]
  sample: np.ndarray  # [K]
  token: np.ndarray  # [K]
  shape: tuple[int, int, int]  # (M, R, T)

  def gather(self, interleaved: np.ndarray, out: np.ndarray) -> None:
    """Writes ``interleaved [R·M, T]`` at the response tokens into ``out[sample, token]``."""
    m, r, t = self.shape
    out[self.sample, self.token] = np.asarray(interleaved).reshape(r, m, t)[self.row, self.micro, self.col]

  def scatter(self, per_sample: np.ndarray) -> np.ndarray:  # [R·M, T]
    """``per_sample [N, L]`` placed at the response tokens of the interleaved layout (0 elsewhere)."""
    m, r, t = self.shape
    out = np.zeros((r, m, t), np.float32)
    out[self.row, self.micro, self.col] = per_sample[self.sample, self.token]
    return out.reshape(r * m, t)


def response_map(assignment: Sequence[Sequence[Sequence[int]]], samples: Sequence[int], *,
                 prompt_lens: np.ndarray, lengths: np.ndarray, shape: tuple[int, int, int]) -> ResponseMap:
  """The :class:`ResponseMap` of a packed mini-batch.

  Args:
    assignment: ``PackedBatch.assignment`` (indices into ``samples``).
    samples: rollout sample index of each packed sequence.
    prompt_lens: ``[N]`` prompt tokens per rollout sample.
    lengths: ``[N]`` response tokens per rollout sample.
    shape: ``(M, R, T)`` of the packed arrays.

  A packed sequence is ``prompt + response[:-1]`` (``P + L - 1`` tokens); response token ``k`` is
  predicted at column ``offset + P - 1 + k`` (:func:`jaxrl.rl.sequence_fields`).
  """
  parts: list[tuple[int, int, int, int, int]] = []
  cols = []
  for m, micro in enumerate(assignment):
    for r, row in enumerate(micro):
      offset = 0
      for j in row:
        i = int(samples[j])
        p, n = int(prompt_lens[i]), int(lengths[i])
        cols.append(offset + p - 1 + np.arange(n))
        parts.append((m, r, i, n, 0))
        offset += p + n - 1
  if not parts:
    z = np.zeros((0,), np.int64)
    return ResponseMap(z, z, z, z, z, shape)
  n_each = [q[3] for q in parts]
  rep = lambda k: np.repeat([q[k] for q in parts], n_each)
  token = np.concatenate([np.arange(n) for n in n_each])
  return ResponseMap(micro=rep(0), row=rep(1), col=np.concatenate(cols), sample=rep(2), token=token, shape=shape)


# ----------------------------------------------------------------------------------------------------
# GAE from the critic's values


def gae_advantages(*, name: str, options: dict[str, Any], rewards: np.ndarray, response_mask: np.ndarray,
                   values: np.ndarray, truncated: np.ndarray, token_rewards: np.ndarray | None = None,
                   whiten: bool = False, group_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
  """``(advantages [N, L], returns [N, L], metrics)`` of ``ADVANTAGES[name]`` (``gae``/``egae``) from values.

  Returns are the λ-returns ``Â + V`` *before* whitening (the value targets); whitening (masked mean
  and population std over ``response_mask``) then applies to the advantages only. ``egae``
  treats a truncated response (finish reason ``length``) as an unfinished window: no outcome reward,
  bootstrapped with the critic's value at its last response token (``V(s_{ℓ-1})``, the last state the
  packed sequence holds, standing in for ``V(s_ℓ)``).

  Args:
    name: ``gae`` or ``egae``.
    options: ``algorithm.advantage_kwargs`` (``gamma``, ``lam``).
    rewards: ``[N]`` sequence rewards, placed at the last response token.
    response_mask: ``[N, L]``.
    values: ``[N, L]`` ``V(s_t)`` of each response token.
    truncated: ``[N]`` bool.
    token_rewards: ``[N, L]`` dense rewards (e.g. ``-β·KL``) or None.
    whiten: whiten the advantages.
    group_ids: ``[N]`` passed through (unused by GAE).
  """
  fn = losses.ADVANTAGES[name]
  kw = dict(options)
  arrays = dict(rewards=jnp.asarray(rewards, jnp.float32), response_mask=jnp.asarray(response_mask, jnp.float32),
                values=jnp.asarray(values, jnp.float32))
  if token_rewards is not None:
    arrays["token_rewards"] = jnp.asarray(token_rewards, jnp.float32)
  ret_kw = {k: v for k, v in kw.items() if k in ("gamma", "lam")}
  if "finished" in inspect.signature(fn).parameters:
    last = np.maximum(np.asarray(response_mask).sum(-1).astype(np.int64) - 1, 0)
    boot = np.asarray(values)[np.arange(len(last)), last]
    arrays.update(finished=jnp.asarray(~np.asarray(truncated, bool)), bootstrap_values=jnp.asarray(boot, jnp.float32))
  if group_ids is not None and "group_ids" in inspect.signature(fn).parameters:
    arrays["group_ids"] = jnp.asarray(group_ids)
  adv, metrics = fn(**arrays, **kw)
  returns = losses.gae_returns(**{k: arrays[k] for k in ("rewards", "response_mask", "values")},
                               token_rewards=arrays.get("token_rewards"), finished=arrays.get("finished"),
                               bootstrap_values=arrays.get("bootstrap_values"), **ret_kw)
  adv, returns = np.asarray(adv, np.float64), np.asarray(returns, np.float32)
  mask = np.asarray(response_mask) > 0
  if whiten and mask.any():
    mu = adv[mask].mean()
    sd = adv[mask].std()
    adv = np.where(mask, (adv - mu) / (sd + 1e-8), 0.0)
  out = {f"advantage/{k}": float(v) for k, v in metrics.items()}
  return adv.astype(np.float32), returns, out


def explained_variance(values: np.ndarray, returns: np.ndarray, mask: np.ndarray) -> float:
  """``1 − Var(R − V) / Var(R)`` over masked tokens (0 when ``R`` is constant)."""
  m = np.asarray(mask) > 0
  if not m.any():
    return 0.0
  r = np.asarray(returns, np.float64)[m]
  v = np.asarray(values, np.float64)[m]
  var = r.var()
  return float(1.0 - (r - v).var() / var) if var > 0 else 0.0


# ----------------------------------------------------------------------------------------------------
# The critic inside the RL trainer


class Critic:
  """The critic's model, optimizer state and programs for :class:`jaxrl.rl.RLTrainer`.

  ``cfg`` is the trainer's ``RLConfig`` (with a ``critic`` section).
  """

  def __init__(self, cfg: Any, *, mesh, rules, batch_sharding):
    if jax.process_count() > 1:
      raise ValueError("critic: the value model runs on one process only so far (its values are read back "
                       "with addressable shards); remove `critic:` on several processes")
    self.cfg, self.ccfg = cfg, cfg.critic
    self.mesh, self.rules, self.batch_sharding = mesh, rules, batch_sharding
    self.aggregation = self.ccfg.aggregation or cfg.algorithm.aggregation
    vm = build_value_model(self.ccfg.model or cfg.model, mesh=mesh, rules=rules)
    self.graphdef, params = nnx.split(vm)
    total = cfg.steps * cfg.updates_per_step
    self.optimizer = train.make_optimizer(self.ccfg.optim, total)
    self.schedule = train.make_schedule(self.ccfg.optim, total)
    self.state = train.place_on_mesh(train.init_train_state(params, self.optimizer), mesh)
    self._maps: dict[int, ResponseMap] = {}
    self._steps: dict[tuple[int, int], Any] = {}
    self._value_programs: dict[int, Any] = {}
    self._raw: list[dict[str, jax.Array]] = []

  # -- values ---------------------------------------------------------------------------------------

  def note(self, pb, samples: Sequence[int], rollout) -> None:
    """Records where ``rollout``'s samples ``samples`` sit in packed mini-batch ``pb``."""
    prompt_lens = np.asarray([len(p) for p in rollout.prompt_ids], np.int64)
    self._maps[id(pb)] = response_map(pb.assignment, list(samples), prompt_lens=prompt_lens,
                                      lengths=rollout.lengths, shape=pb.shape)

  def _value_program(self, num_micro: int):
    if num_micro not in self._value_programs:
      keys = ("tokens", "positions", "segment_ids")
      fn = jax.jit(functools.partial(critic_values, self.graphdef))  # params enter the map body as arguments

      def run(params, batch):
        micro = train.split_micro_batches({k: batch[k] for k in keys}, num_micro, mesh=self.mesh, rules=self.rules)
        v = jax.lax.map(lambda mb: fn(params, mb), micro)  # [M, R, T]
        return jnp.swapaxes(v, 0, 1).reshape(batch["tokens"].shape)
      self._value_programs[num_micro] = jax.jit(run, out_shardings=self.batch_sharding)
    return self._value_programs[num_micro]

  def values(self, batch: dict[str, jax.Array], num_micro: int) -> jax.Array:  # [R·M, T] on device
    return self._value_program(num_micro)(self.state.params, batch)

  def fill(self, rollout, packed: Sequence[Any], batches: list[dict[str, jax.Array]],
           to_device: Callable[[np.ndarray], jax.Array], *,
           token_rewards: np.ndarray | None = None) -> dict[str, float]:
    """Computes the step's values and GAE; sets ``advantages``, ``returns``, ``old_values`` of ``batches``.
    ``token_rewards``: ``[N, L]`` dense rewards on the response tokens (e.g. ``reward.implicit_prm``'s step
    rewards), added to the KL penalty's."""
    algo = self.cfg.algorithm
    shape = rollout.tokens.shape
    values = np.zeros(shape, np.float32)
    kl = np.zeros(shape, np.float32) if self.ccfg.kl_reward_coef > 0 else None
    loss_mask = np.zeros(shape, np.float32)  # π_ref is only computed on loss tokens
    maps = [self._maps.pop(id(pb)) for pb in packed]
    self._maps.clear()
    for pb, batch, rmap in zip(packed, batches, maps):
      got = {"v": self.values(batch, pb.shape[0])}
      if kl is not None:
        est = losses.KL[self.ccfg.kl_reward_estimator]
        got["kl"] = est(batch["old_logprobs"], batch["ref_logprobs"])
        got["mask"] = batch["loss_mask"]
      got = sharding.to_host(got)
      rmap.gather(got["v"], values)
      if kl is not None:
        rmap.gather(got["kl"], kl)
        rmap.gather(got["mask"], loss_mask)
    mask = rollout.response_mask()
    if kl is not None:
      penalty = -self.ccfg.kl_reward_coef * kl * loss_mask
      token_rewards = penalty if token_rewards is None else token_rewards + penalty
    adv, returns, metrics = gae_advantages(
        name=algo.advantage, options=algo.advantage_kwargs, rewards=rollout.rewards, response_mask=mask,
        values=values, truncated=rollout.truncated, token_rewards=token_rewards,
        whiten=self.ccfg.whiten_advantages, group_ids=rollout.group_ids)
    for batch, rmap in zip(batches, maps):
      batch["advantages"] = to_device(rmap.scatter(adv))
      batch["returns"] = to_device(rmap.scatter(returns))
      batch["old_values"] = to_device(rmap.scatter(values))
    metrics["advantage/abs_mean"] = float(np.abs(adv).sum() / max(mask.sum(), 1.0))
    metrics["critic/explained_variance"] = explained_variance(values, returns, mask)
    metrics["critic/values_mean"] = float((values * mask).sum() / max(mask.sum(), 1.0))
    metrics["critic/returns_mean"] = float((returns * mask).sum() / max(mask.sum(), 1.0))
    if kl is not None:
      metrics["critic/kl_reward"] = float((kl * loss_mask).sum() / max(loss_mask.sum(), 1.0))
    return metrics

  # -- updates --------------------------------------------------------------------------------------

  def _step_fn(self, num_micro: int, max_len: int):
    key = (num_micro, max_len)
    if key not in self._steps:
      clip, mode = self.ccfg.value_clip, self.aggregation
      num_groups = self.cfg.rollout.prompts_per_step
      graphdef = self.graphdef

      def prepare(batch):
        w = losses.loss_weights(batch["loss_mask"], mode=mode, group_ids=batch["group_ids"], num_groups=num_groups,
                                segment_ids=batch["segment_ids"], max_len=max_len)
        return dict(batch, weights=w)

      def loss_fn(params, mb):
        v = critic_values(graphdef, params, mb)
        return losses.value_loss(values=v, returns=mb["returns"], old_values=mb["old_values"],
                                 loss_weights=mb["weights"], clip_range=clip)

      self._steps[key] = train.make_train_step(loss_fn, self.optimizer, micro_batches=num_micro, mesh=self.mesh,
                                               rules=self.rules, schedule=self.schedule, prepare=prepare)
    return self._steps[key]

  def train(self, batch: dict[str, jax.Array], num_micro: int, max_len: int) -> None:
    """One critic update on a mini-batch that :meth:`fill` completed (metrics kept for :meth:`metrics`)."""
    keys = ("tokens", "positions", "segment_ids", "loss_mask", "group_ids", "returns", "old_values")
    self.state, out = self._step_fn(num_micro, max_len)(self.state, {k: batch[k] for k in keys})
    self._raw.append(out)

  def metrics(self) -> dict[str, float]:
    """Means over the updates since the last call: value loss, value clip fraction, grad norm."""
    raw, self._raw = sharding.to_host(self._raw), []
    if not raw:
      return {}
    per = []
    for out in raw:
      ws = float(out["weight_sum"])
      norm = lambda k: float(out[k]) / ws if ws > 0 else 0.0
      per.append({"critic/value_loss": norm("value_loss"), "critic/value_clip_frac": norm("value_clip_frac"),
                  "critic/grad_norm": float(out["grad_norm"]), "critic/skipped": float(out["skipped"])})
    m = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
    m["critic/skipped"] = float(sum(p["critic/skipped"] for p in per))
    m["critic/lr"] = float(raw[-1]["lr"])
    return m


def checkpoint_state(actor_state, critic: Critic | None):
  """What the trainer checkpoints: the actor's train state, and the critic's with a critic."""
  return actor_state if critic is None else {"actor": actor_state, "critic": critic.state}


def restore_state(restored, critic: Critic | None):
  """The actor's train state from :func:`checkpoint_state`'s restored tree (the critic's is set in place)."""
  if critic is None:
    return restored
  critic.state = restored["critic"]
  return restored["actor"]
