"""``reward.implicit_prm``: implicit process rewards of the sampled responses as a dense RL reward.

A DPO-trained policy and its reference (:class:`jaxrl.pref.ImplicitPRM`, on the trainer's mesh) score the rollout's
own token ids (each prompt's ids followed by the sampled response ids: nothing is re-tokenised), giving
``q_t = β log π_θ(y_t|y_<t)/π_ref(y_t|y_<t)`` per response token and the step rewards ``r_k = Σ_{t∈k} q_t``
(steps: :func:`jaxrl.pref.step_ids` with ``step_delimiter``). The dense reward of a response is ``r_k`` at the
last token of each step ``k`` (:func:`jaxrl.pref.step_end_rewards`), 0 elsewhere. The trainer then

* with a critic (``gae``/``egae``): adds ``coef`` × the dense rewards to GAE's per-token rewards;
* without one: adds ``coef`` × PRIME's process advantage of the dense rewards (the return-to-go of their
  leave-one-out-baselined values, :func:`jaxrl.losses.prime_process_advantages`; Cui et al. 2025) to the outcome
  estimator's advantage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl import losses, pref
from jaxrl.rl._rollout import Rollout


def load_implicit_prm(section, *, mesh, rules, tokenizer, tokenizer_dir: str, chunk_size: int) -> pref.ImplicitPRM:
  """The scorer of ``reward.implicit_prm`` (``section``); refuses a PRM whose tokenizer is not the policy's."""
  prm = pref.ImplicitPRM.load(section.policy, section.reference, beta=section.beta, mesh=mesh, rules=rules,
                              rows=section.rows, seq_len=section.seq_len, chunk_size=chunk_size,
                              key="reward.implicit_prm")
  pref.check_same_tokenizer(prm.tokenizer, tokenizer, a=f"the PRM's policy {section.policy}",
                            b=f"the trained policy (tokenizer {tokenizer_dir})", key="reward.implicit_prm.policy")
  return prm


def rollout_process_rewards(prm: pref.ImplicitPRM, rollout: Rollout, *,
                            delimiter: str | None) -> tuple[np.ndarray, dict[str, float], dict[str, Any]]:
  """``(dense [N, L] float32, metrics, detail)`` of ``rollout`` (module docstring; before ``coef``).

  Metrics: ``reward/prm_mean`` (the mean over samples of ``Σ_k r_k``) and ``reward/prm_min_step`` (of ``min_k r_k``,
  :func:`jaxrl.pref.min_step_reward`). ``detail``: per sample ``token_rewards``, ``step_ids``, ``step_rewards``.
  """
  if rollout.policy_mask is not None or rollout.prompt_images is not None:
    raise ValueError("reward.implicit_prm: rollouts with environment/tool tokens (policy_mask) or images are not "
                     "scored by the implicit PRM so far (a text-only policy and reference score text responses)")
  completions = [rollout.tokens[i, :int(n)] for i, n in enumerate(rollout.lengths)]
  q = prm.score_ids(rollout.prompt_ids, completions)
  steps = [pref.step_ids(prm.tokenizer, c, delimiter) for c in completions]
  dense = np.zeros(rollout.tokens.shape, np.float32)
  for i, (qi, si) in enumerate(zip(q, steps)):
    dense[i, :len(qi)] = pref.step_end_rewards(qi, si)
  per_step = pref.step_rewards(q, steps)
  metrics = {"reward/prm_mean": float(np.mean([r.sum() for r in per_step])) if per_step else 0.0,
             "reward/prm_min_step": float(np.mean([pref.min_step_reward(r) for r in per_step])) if per_step else 0.0}
  return dense, metrics, {"token_rewards": q, "step_ids": steps, "step_rewards": per_step}


def process_advantages(dense: np.ndarray, rollout: Rollout, *, coef: float) -> np.ndarray:  # [N, L] float32
  """``coef`` × PRIME's process advantage of the dense rewards over ``rollout``'s prompt groups."""
  adv = losses.prime_process_advantages(dense, rollout.response_mask(), rollout.group_ids,
                                        num_groups=max(rollout.num_groups, 1))
  return np.float32(coef) * np.asarray(adv, np.float32)
