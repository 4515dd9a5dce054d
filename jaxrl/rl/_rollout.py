"""A step's rollout batch on the host: completions, rewards, masks, advantages; DAPO dynamic sampling.

Rows are samples ``i·n + j`` of prompt group ``i``; ``group_ids`` number the groups ``0..G-1``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import losses, models


@dataclasses.dataclass(frozen=True)
class Rollout:
  """Completions of ``G`` prompt groups (``N`` samples), with their rewards."""

  prompt_ids: tuple[np.ndarray, ...]  # N × [P_i] int32 prompt tokens
  tokens: np.ndarray  # [N, L] int32 response tokens (pad after lengths)
  logprobs: np.ndarray  # [N, L] float32 sampler log-probs (untruncated distribution at T)
  lengths: np.ndarray  # [N] int32 response lengths
  truncated: np.ndarray  # [N] bool: finish reason "length"
  group_ids: np.ndarray  # [N] int32 in [0, G)
  rewards: np.ndarray  # [N] float32 rewards used for advantages (task + penalties)
  task_rewards: np.ndarray  # [N] float32 the reward function's values
  texts: tuple[str, ...]
  policy_mask: np.ndarray | None = None  # [N, L] float32: 1 on policy tokens, 0 on environment/tool tokens
  prefix_ids: np.ndarray | None = None  # [N, L] int32 shared-prefix tree nodes (ARPO), -1 = not shared
  versions: np.ndarray | None = None  # [N, L] int32 policy version of each token (-1 past the length); None: current
  prompt_images: tuple | None = None  # VLM: N × None or {"pixel_values" [P, patch_dim], "grid_thw" [I, 3]}
  prompt_rope: tuple | None = None  # VLM: N × [P_i, 3] int32 M-RoPE positions of the prompt (mrope_positions)
  rope_deltas: np.ndarray | None = None  # VLM: [N] int32, response token at position p rotates by p + delta

  @property
  def num_samples(self) -> int:
    return len(self.lengths)

  @property
  def num_groups(self) -> int:
    return int(self.group_ids.max()) + 1 if self.num_samples else 0

  def response_mask(self) -> np.ndarray:  # [N, L] float32
    return (np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]).astype(np.float32)

  def select_groups(self, groups: np.ndarray) -> Rollout:
    """The samples of ``groups`` (in that order), renumbered ``0..len(groups)-1``."""
    groups = np.asarray(groups, np.int64)
    rows = np.concatenate([np.flatnonzero(self.group_ids == g) for g in groups]) if len(groups) else (
        np.zeros((0,), np.int64))
    new_id = np.empty(max(self.num_groups, 1), np.int32)
    new_id[groups] = np.arange(len(groups), dtype=np.int32)
    return Rollout(
        prompt_ids=tuple(self.prompt_ids[r] for r in rows), tokens=self.tokens[rows], logprobs=self.logprobs[rows],
        lengths=self.lengths[rows], truncated=self.truncated[rows], group_ids=new_id[self.group_ids[rows]],
        rewards=self.rewards[rows], task_rewards=self.task_rewards[rows], texts=tuple(self.texts[r] for r in rows),
        policy_mask=None if self.policy_mask is None else self.policy_mask[rows],
        prefix_ids=None if self.prefix_ids is None else self.prefix_ids[rows],
        versions=None if self.versions is None else self.versions[rows],
        prompt_images=None if self.prompt_images is None else tuple(self.prompt_images[r] for r in rows),
        prompt_rope=None if self.prompt_rope is None else tuple(self.prompt_rope[r] for r in rows),
        rope_deltas=None if self.rope_deltas is None else self.rope_deltas[rows])


def vision_fields(cfg, prompt_ids, images) -> dict[str, Any]:
  """A VLM rollout's :class:`Rollout` fields for samples with prompts ``prompt_ids`` and ``images`` (one
  entry per sample, None for a text prompt): the images, each prompt's M-RoPE positions and its decode
  delta (:func:`jaxrl.models.mrope_positions`, exactly what the sampler rotated by)."""
  rope, deltas = [], []
  for ids, img in zip(prompt_ids, images):
    tokens = np.asarray(ids, np.int64)[None]
    grid = np.zeros((0, 3), np.int64) if img is None else img["grid_thw"]
    r, d = models.mrope_positions(tokens, np.ones_like(tokens), grid, cfg)
    rope.append(r[0])
    deltas.append(d[0, 0])
  return dict(prompt_images=tuple(images), prompt_rope=tuple(rope), rope_deltas=np.asarray(deltas, np.int32))


def sample_records(rollout: Rollout, tokenizer, *, step: int, limit: int) -> list[dict[str, Any]]:
  """The first ``limit`` samples of ``rollout`` as JSON rows (``log_samples``): step, group, the prompt decoded with
  its special tokens (a run of one repeated special token, e.g. an image's placeholders, written once as
  ``<|image_pad|>×N``), the completion text, reward, task reward, length and whether it was cut at the budget."""
  rows = []
  for i in range(min(limit, rollout.num_samples)):
    prompt = tokenizer.decode([int(t) for t in rollout.prompt_ids[i]], skip_special_tokens=False)
    prompt = re.sub(r"(<\|[^|<>\s]+\|>)(?:\1)+", lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", prompt)
    rows.append({"step": step, "group": int(rollout.group_ids[i]), "prompt": prompt, "completion": rollout.texts[i],
                 "reward": float(rollout.rewards[i]), "task_reward": float(rollout.task_rewards[i]),
                 "length": int(rollout.lengths[i]), "truncated": bool(rollout.truncated[i])})
  return rows


def concat_rollouts(parts: list[Rollout]) -> Rollout:
  """Rollouts side by side; group ids of later parts are shifted past earlier ones."""
  if len(parts) == 1:
    return parts[0]
  width = max(p.tokens.shape[1] for p in parts)
  pad = lambda a, fill: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)
  offsets = np.cumsum([0] + [p.num_groups for p in parts[:-1]])
  extra = {}  # multi-turn fields: policy mask (1 where absent) and prefix ids (made unique per part)
  if any(p.policy_mask is not None for p in parts):
    extra["policy_mask"] = np.concatenate([pad(p.policy_mask if p.policy_mask is not None else
                                               np.ones(p.tokens.shape, np.float32), 0.0) for p in parts])
  if any(p.prefix_ids is not None for p in parts):
    ids, base = [], 0
    for p in parts:
      x = p.prefix_ids if p.prefix_ids is not None else np.full(p.tokens.shape, -1, np.int32)
      ids.append(pad(np.where(x >= 0, x + base, -1).astype(np.int32), -1))
      base += int(x.max()) + 1 if x.size and x.max() >= 0 else 0
    extra["prefix_ids"] = np.concatenate(ids)
  if any(p.versions is not None for p in parts):
    if any(p.versions is None for p in parts):
      raise ValueError("concat_rollouts: every part or none carries per-token versions")
    extra["versions"] = np.concatenate([pad(p.versions, -1) for p in parts])
  if any(p.prompt_rope is not None for p in parts):
    if any(p.prompt_rope is None for p in parts):
      raise ValueError("concat_rollouts: every part or none carries prompt images and rope positions")
    extra.update(prompt_images=tuple(x for p in parts for x in p.prompt_images),
                 prompt_rope=tuple(x for p in parts for x in p.prompt_rope),
                 rope_deltas=np.concatenate([p.rope_deltas for p in parts]))
  return Rollout(
      prompt_ids=tuple(x for p in parts for x in p.prompt_ids),
      tokens=np.concatenate([pad(p.tokens, 0) for p in parts]),
      logprobs=np.concatenate([pad(p.logprobs, 0.0) for p in parts]),
      lengths=np.concatenate([p.lengths for p in parts]),
      truncated=np.concatenate([p.truncated for p in parts]),
      group_ids=np.concatenate([p.group_ids + o for p, o in zip(parts, offsets)]).astype(np.int32),
      rewards=np.concatenate([p.rewards for p in parts]),
      task_rewards=np.concatenate([p.task_rewards for p in parts]),
      texts=tuple(t for p in parts for t in p.texts), **extra)


def total_rewards(task: np.ndarray, lengths: np.ndarray, *, max_new: int, overlong_penalty=None) -> np.ndarray:
  """Task rewards ``[N]`` plus the DAPO overlong penalty of responses ``lengths`` ``[N]`` (``rollout.overlong_penalty``;
  its ``max_len`` defaults to ``max_new``), float32: the rewards advantages are computed from."""
  if overlong_penalty is None:
    return np.asarray(task, np.float32)
  return task + np.asarray(losses.dapo_overlong_penalty(
      lengths, max_len=overlong_penalty.max_len or max_new, cache_len=overlong_penalty.cache_len), np.float32)


def informative_groups(rewards: np.ndarray, group_ids: np.ndarray, num_groups: int) -> np.ndarray:
  """``[G]`` bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps these).

  A group with one member, or with ``max == min`` reward, gives every member a zero group-baselined
  advantage and no gradient; DAPO's filter ``0 < |{correct}| < G`` is this test for 0/1 rewards.
  """
  r = np.asarray(rewards, np.float64)
  g = np.asarray(group_ids, np.int64)
  hi = np.full(num_groups, -np.inf)
  lo = np.full(num_groups, np.inf)
  np.maximum.at(hi, g, r)
  np.minimum.at(lo, g, r)
  return hi > lo


def loss_mask(rollout: Rollout, *, overlong_filter: bool) -> np.ndarray:  # [N, L] float32
  """The response mask, with truncated responses removed when ``overlong_filter`` is on."""
  mask = rollout.response_mask()
  if rollout.policy_mask is not None:  # environment / tool tokens are never trained on nor counted
    mask = mask * rollout.policy_mask
  if overlong_filter:
    mask = np.asarray(losses.overlong_filter_mask(mask, rollout.truncated))
  return mask


def compute_advantages(rollout: Rollout, *, name: str, options: dict[str, Any]) -> tuple[np.ndarray, dict[str, float]]:
  """``ADVANTAGES[name]`` over the whole step batch; ``[N, L]`` token advantages and metrics.

  Every response takes part in the statistics (the mask passed is the full response mask): an
  overlong-filtered response still counts in its group's baseline while its loss tokens are masked
  (GRPO+). ``num_groups`` is passed to estimators that take it.
  """
  fn = losses.ADVANTAGES[name]
  kwargs = dict(options)
  params = inspect.signature(fn).parameters
  if "num_groups" in params and "num_groups" not in kwargs:
    kwargs["num_groups"] = max(rollout.num_groups, 1)
  if "prefix_ids" in params and "prefix_ids" not in kwargs:  # ARPO's shared-prefix tree (jaxrl.envs);
    tree = rollout.prefix_ids  # without branching no token is shared: arpo_hard / arpo_soft are GRPO
    kwargs["prefix_ids"] = np.asarray(tree if tree is not None else np.full(rollout.tokens.shape, -1, np.int32))
  arrays = {k: kwargs.pop(k) for k in list(kwargs) if isinstance(kwargs[k], (np.ndarray, jax.Array))}
  arrays.update(rewards=np.asarray(rollout.rewards), group_ids=np.asarray(rollout.group_ids),
                response_mask=np.asarray(rollout.response_mask()))
  adv, metrics = _advantage_program(fn, kwargs)(**arrays)
  return np.asarray(adv, np.float32), {f"advantage/{k}": float(v) for k, v in metrics.items()}


_PROGRAMS: dict[tuple, Any] = {}


def _advantage_program(fn, options: dict[str, Any]):
  """``fn`` with its non-array ``options`` fixed, as one compiled program.

  Called op by op, an estimator dispatches a few dozen small programs, each compiled on a process's
  first step (the persistent cache then reads them back one by one). An estimator that cannot be
  traced (it reads values on the host) runs eagerly as before; that is decided once per estimator.
  """
  key = (fn, repr(sorted(options.items())))
  if key not in _PROGRAMS:
    jitted = jax.jit(lambda **arrays: fn(**arrays, **options))

    def run(**arrays):
      try:
        return jitted(**arrays)
      except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
              jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
        _PROGRAMS[key] = lambda **a: fn(**{k: jnp.asarray(v) for k, v in a.items()}, **options)
        return _PROGRAMS[key](**arrays)

    _PROGRAMS[key] = run
  return _PROGRAMS[key]


def sequence_fields(rollout: Rollout, advantages: np.ndarray, mask: np.ndarray, *,
                    teacher_logprobs: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
  """Per sample: next-token training arrays over ``prompt + response[:-1]`` (length ``P + L - 1``).

  ``tokens[t]`` predicts ``targets[t] = seq[t+1]``; response token ``k`` is the target at
  ``t = P - 1 + k``, where ``loss_mask``, ``advantages``, ``sampler_logprobs`` and (given, ``[N, L]``: a
  ``distill.server`` teacher's log-probs of the response tokens) ``teacher_logprobs`` are placed.

  A VLM rollout (``prompt_rope`` set) also gives ``rope_positions [P + L - 1, 3]`` (the prompt's M-RoPE
  positions, then ``position + delta``: what the sampler rotated by; never ``mrope_positions`` over the
  response, whose sampled image-pad tokens are text) and, for a prompt with images, ``pixel_values`` and
  ``grid_thw`` (as :func:`jaxrl.data.encode_vl_record` gives a sample, for the VL packer); image embeddings
  replace the prompt's image tokens only.
  """
  out = []
  for i in range(rollout.num_samples):
    p = rollout.prompt_ids[i]
    n = int(rollout.lengths[i])
    seq = np.concatenate([p, rollout.tokens[i, :n]]).astype(np.int32)
    length = len(seq) - 1
    start = len(p) - 1

    def place(values, dtype):
      x = np.zeros((length,), dtype)
      x[start:start + n] = values[:n]
      return x

    out.append({
        "tokens": seq[:-1], "targets": seq[1:],
        "loss_mask": place(mask[i], np.float32), "advantages": place(advantages[i], np.float32),
        "sampler_logprobs": place(rollout.logprobs[i], np.float32),
        "group_ids": np.full((length,), rollout.group_ids[i], np.int32),
    })
    if teacher_logprobs is not None:
      out[-1]["teacher_logprobs"] = place(teacher_logprobs[i], np.float32)
    if rollout.prompt_rope is not None:
      tail = np.arange(len(p), len(seq), dtype=np.int32)[None]
      rope = np.concatenate([rollout.prompt_rope[i], models.decode_rope_positions(tail, rollout.rope_deltas[i:i + 1])[0]])
      out[-1]["rope_positions"] = rope[:-1].astype(np.int32)
      out[-1]["image_token_mask"] = (np.arange(length) < len(p)).astype(np.int32)  # prompt tokens only
      if rollout.prompt_images[i] is not None:
        out[-1].update(pixel_values=rollout.prompt_images[i]["pixel_values"],
                       grid_thw=np.asarray(rollout.prompt_images[i]["grid_thw"], np.int32))
  return out
