"""Implicit process rewards: a DPO-trained policy and its reference score each token and step of a response.

Yuan et al. 2024, "Free Process Rewards without Process Labels" (seeds 003): with ``π_θ`` trained by DPO (or
any outcome objective of the form ``β log π_θ/π_ref``) from ``π_ref``, the reward of token ``t`` of a response is

    q_t = β · (log π_θ(y_t | y_<t) − log π_ref(y_t | y_<t))          (:func:`jaxrl.losses.implicit_prm_rewards`)

and the reward of step ``k`` is ``r_k = Σ_{t ∈ step k} q_t`` (:func:`jaxrl.losses.implicit_prm_step_rewards`);
best-of-N keeps the response whose *minimum* step reward is largest.

Steps (:func:`step_ids`): the completion's tokens are decoded one by one and the pieces concatenated; each
non-overlapping occurrence of the delimiter (left to right) ends a step at the token holding the delimiter's
last character, so that token (a newline for ``"\\n"``) is the last token of its step; the tokens after the last
delimiter form the final step (none when the completion ends with the delimiter). With no delimiter (``None``)
every token is a step. A completion's tokens are those the chat template marks as the assistant's (its
end-of-turn token included, in the last step) for text completions, or exactly the given ids.

:class:`ImplicitPRM` runs both models on a mesh: the sequences ``prompt + completion`` are packed (best fit)
into batches of ``rows × seq_len`` tokens (:func:`jaxrl.pref.pack_sequences`, as :class:`RewardModel` does) and
one jitted program per batch returns ``q`` of every completion token; nothing is truncated. On a mesh over
several processes each process scores its own completions in its ``rows / processes`` rows of every batch, the
processes agreeing on the number of batches (:class:`jaxrl.pref._scoring.ProcessBatches`), so every process
calls the scoring methods the same number of times, each with its own (any) number of completions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models, sharding
from jaxrl.pref._data import answer_messages
from jaxrl.pref._scoring import ProcessBatches


def step_ids(tokenizer, ids: Sequence[int], delimiter: str | None = "\n") -> np.ndarray:  # [L] int32, 1..K
  """The step (1-based) of each completion token ``ids`` (module docstring: how tokens map to steps)."""
  n = len(ids)
  if delimiter is None:
    return np.arange(1, n + 1, dtype=np.int32)
  if not delimiter:
    raise ValueError("step delimiter: an empty string; give a non-empty delimiter or None (every token a step)")
  pieces = tokenizer.batch_decode([[int(i)] for i in ids]) if n else []
  ends = np.cumsum([len(p) for p in pieces])  # [L] end (exclusive) of each token's characters
  text = "".join(pieces)
  last = np.zeros(n, bool)  # the token ends a step
  at = text.find(delimiter)
  while at >= 0:
    last[int(np.searchsorted(ends, at + len(delimiter) - 1, side="right"))] = True
    at = text.find(delimiter, at + len(delimiter))
  return (1 + np.concatenate([[0], np.cumsum(last)[:-1]])).astype(np.int32) if n else np.zeros(0, np.int32)


def step_rewards(token_rewards: Sequence[np.ndarray], steps: Sequence[np.ndarray]) -> list[np.ndarray]:
  """``r_k = Σ_{t ∈ step k} q_t`` of each completion, ``[K_i]`` float32 (one padded
  :func:`jaxrl.losses.implicit_prm_step_rewards` call)."""
  if not len(token_rewards):
    return []
  width = max(1, max(len(q) for q in token_rewards))
  q = np.zeros((len(token_rewards), width), np.float32)
  s = np.zeros((len(token_rewards), width), np.int32)
  for i, (qi, si) in enumerate(zip(token_rewards, steps)):
    q[i, :len(qi)], s[i, :len(si)] = qi, si
  counts = [int(si.max()) if len(si) else 0 for si in steps]
  got = np.asarray(losses.implicit_prm_step_rewards(q, s, num_steps=max(1, max(counts))))
  return [got[i, :k] for i, k in enumerate(counts)]


def min_step_reward(r: np.ndarray) -> float:
  """The best-of-N score of a completion with step rewards ``r``: ``min_k r_k`` (0 for a completion with no
  step, the sum over none of its tokens)."""
  return float(np.min(r)) if len(r) else 0.0


def step_end_rewards(token_rewards: np.ndarray, steps: np.ndarray) -> np.ndarray:  # [L] float32
  """Step rewards as a dense reward: ``r_k`` at the last token of step ``k``, 0 elsewhere (:func:`step_ids`
  numbers steps in token order, so a step's last token is where the next step starts, or the last token)."""
  steps = np.asarray(steps)
  out = np.zeros(len(steps), np.float32)
  if len(steps):
    r = step_rewards([np.asarray(token_rewards, np.float32)], [steps])[0]
    last = np.flatnonzero(np.append(steps[1:] != steps[:-1], True))
    out[last] = r[steps[last] - 1]
  return out


def check_same_tokenizer(tok_a, tok_b, *, a: str, b: str, key: str) -> None:
  """Refuses two tokenizers whose token ids differ (``get_vocab()``, added tokens included); ``a`` and ``b`` name
  them in the message, ``key`` is the config key it starts with."""
  va, vb = tok_a.get_vocab(), tok_b.get_vocab()
  if va != vb:
    diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])[:3]
    raise ValueError(f"{key}: the tokenizers of {a} and {b} differ ({len(va)} vs {len(vb)} tokens; e.g. {diff}); "
                     "the implicit reward log π_θ/π_ref of the sampled ids needs one tokenizer")


class ImplicitPRM:
  """A DPO-trained policy and its reference scoring completions token by token on a mesh (module docstring).

  Args:
    policy, reference: the two models (same vocabulary).
    tokenizer: their tokenizer.
    beta: β of the implicit reward (the DPO run's ``loss.beta``).
    rows, seq_len: the packed batch; a prompt + completion longer than ``seq_len`` is an error.
    chunk_size: positions per chunk of :func:`jaxrl.losses.token_logprobs`.
    key: the config key errors name.
  """

  def __init__(self, policy, reference, tokenizer, *, beta: float, rows: int = 8, seq_len: int = 512, mesh=None,
               rules=None, chunk_size: int = 1024, key: str = "implicit_prm"):
    if policy.cfg.vocab_size != reference.cfg.vocab_size:
      raise ValueError(f"{key}: policy and reference vocab sizes differ ({policy.cfg.vocab_size} vs "
                       f"{reference.cfg.vocab_size})")
    self.tokenizer, self.beta, self.rows, self.seq_len, self.key = tokenizer, float(beta), rows, seq_len, key
    self.mesh = mesh if mesh is not None else sharding.MeshConfig().build()
    self.rules = rules if rules is not None else sharding.LogicalRules.default()
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if rows % dp:
      raise ValueError(f"{key}.rows={rows} must be a multiple of the data-parallel devices ({dp})")
    if seq_len < 2:
      raise ValueError(f"{key}.seq_len={seq_len} must be >= 2")
    for m in (policy, reference):
      models.check_tokenizer(tokenizer, m.cfg)
    self.graphdef, params = nnx.split(models.shard_model(policy, self.mesh, self.rules))
    ref_graphdef, ref_params = nnx.split(models.shard_model(reference, self.mesh, self.rules))
    self.params = models.cast_params(params, policy.cfg.dtype)  # frozen: compute-dtype weights only
    self.ref_params = models.cast_params(ref_params, reference.cfg.dtype)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self._batches = ProcessBatches(self.batch_sharding, rows=rows, seq_len=seq_len, key=key)
    graphdef = self.graphdef

    def logps(gd, p, batch):  # [R, T] log-probs of the targets at temperature 1
      model = nnx.merge(gd, p)
      hidden = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                     return_hidden=True)
      return losses.token_logprobs(hidden, model.unembed_matrix(), batch["targets"], chunk_size=chunk_size)

    def forward(params, ref_params, batch):  # [R, T] q at each target position (0 off loss_mask)
      return losses.implicit_prm_rewards(logps(graphdef, params, batch), logps(ref_graphdef, ref_params, batch),
                                         batch["loss_mask"], beta=self.beta)
    self._forward = jax.jit(forward, out_shardings=self.batch_sharding)

  @classmethod
  def load(cls, policy: str | Path, reference: str | Path, *, beta: float, mesh=None, rules=None,
           key: str = "implicit_prm", **kwargs) -> ImplicitPRM:
    """The policy (e.g. ``out_dir/hf`` of ``jaxrl dpo``) and its reference (the DPO run's starting model) from
    Hugging Face directories; refuses tokenizers that differ. ``kwargs``: ``rows``, ``seq_len``, ``chunk_size``."""
    tok, ref_tok = models.load_tokenizer(policy), models.load_tokenizer(reference)
    check_same_tokenizer(tok, ref_tok, a=f"the policy {policy}", b=f"the reference {reference}", key=key)
    mesh = mesh if mesh is not None else sharding.MeshConfig().build()  # loaded onto the (global) mesh directly
    load = lambda path: models.load_pretrained(path, mesh=mesh, rules=rules)
    return cls(load(policy), load(reference), tok, beta=beta, mesh=mesh, rules=rules, key=key, **kwargs)

  # -- token ids --------------------------------------------------------------------------------------

  def score_ids(self, prompt_ids: Sequence[Any], completion_ids: Sequence[Any]) -> list[np.ndarray]:
    """``q_t`` of each completion token, ``[L_i]`` float32, for token-id prompts and completions (each prompt
    has at least one token: it conditions the first completion token). With several processes a collective
    call (module docstring): each process passes and gets its own completions.

    Raises:
      ValueError: naming the sample and ``<key>.seq_len`` when a prompt + completion does not fit a row (on the
        other processes: naming the process that refused).
    """
    return self._score(lambda: (prompt_ids, completion_ids))[0]

  def _score(self, ids: Callable[[], tuple[Sequence[Any], Sequence[Any]]]
             ) -> tuple[list[np.ndarray], Sequence[Any]]:
    """``(q of each completion token, completion ids)`` of the ``(prompt ids, completion ids)`` that ``ids()``
    gives: called inside the scorer, so that its errors (an encoding's) stop every process alike."""
    out: list[np.ndarray] = []
    got: list[Sequence[Any]] = []

    def prepare():  # raising here raises on every process (no process is left in a collective)
      prompt_ids, completion_ids = ids()
      got.append(completion_ids)
      if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
      seqs = []
      for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        p, c = np.asarray(p, np.int32).reshape(-1), np.asarray(c, np.int32).reshape(-1)
        if not len(p):
          raise ValueError(f"sample {i}: an empty prompt; the implicit PRM scores tokens given what precedes them")
        if len(p) + len(c) > self.seq_len:
          raise ValueError(f"sample {i}: prompt + completion is {len(p) + len(c)} tokens, longer than "
                           f"{self.key}.seq_len={self.seq_len}")
        seqs.append({"tokens": np.concatenate([p, c]), "loss_mask": np.arange(len(p) + len(c)) >= len(p)})
      out.extend(np.zeros(int(s["loss_mask"].sum()), np.float32) for s in seqs)
      return seqs
    for arrays in self._batches.batches(prepare, pad_id=self.tokenizer.pad_token_id or 0):
      keys = ("tokens", "positions", "segment_ids", "targets", "loss_mask")
      batch = self._batches.put(arrays, keys)
      q = self._batches.local(self._forward(self.params, self.ref_params, batch))  # [R / processes, T] own rows
      rr, cc = np.nonzero(arrays["loss_mask"] > 0)  # row-major: each sequence's tokens in order, in one row
      seq = arrays["seq_ids"][rr, cc] - 1
      order = np.argsort(seq, kind="stable")
      for j, vals in zip(*_split_by(seq[order], q[rr, cc][order])):
        out[j][:] = vals
    return out, got[0]

  # -- text -------------------------------------------------------------------------------------------

  def encode(self, prompt: Any, completion: Any, where: str = "sample") -> tuple[np.ndarray, np.ndarray]:
    """``(prompt ids, completion ids)`` of one ``(prompt, completion)`` through the chat template
    (:func:`jaxrl.pref.answer_messages`: the prompt's turns, then the completion as the assistant's); the
    completion is the template's trained (assistant) tokens, which must be one contiguous run."""
    seq = data_lib.encode_chat(self.tokenizer, answer_messages(prompt, completion))
    trained = np.flatnonzero(seq["loss_mask"])
    if not len(trained) or trained[-1] - trained[0] + 1 != len(trained):
      raise ValueError(f"{where}: the completion's assistant tokens are not one contiguous run (give one "
                       "assistant turn)")
    return seq["tokens"][:trained[0]], seq["tokens"][trained[0]:trained[-1] + 1]

  def _encode_all(self, prompts: Sequence[Any], completions: Sequence[Any]):
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    pairs = [self.encode(p, c, f"sample {i}") for i, (p, c) in enumerate(zip(prompts, completions))]
    return [p for p, _ in pairs], [c for _, c in pairs]

  def token_rewards(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[np.ndarray]:
    """``q_t`` ``[L_i]`` of each completion's tokens (:meth:`encode`); prompts are strings or chat messages."""
    return self._score(lambda: self._encode_all(prompts, completions))[0]

  def step_rewards(self, prompts: Sequence[Any], completions: Sequence[Any], *,
                   delimiter: str | None = "\n") -> list[np.ndarray]:
    """``r_k`` ``[K_i]`` of each completion's steps (:func:`step_ids` over its :meth:`encode` tokens)."""
    q, c_ids = self._score(lambda: self._encode_all(prompts, completions))
    return step_rewards(q, [step_ids(self.tokenizer, c, delimiter) for c in c_ids])

  def best_of_n(self, prompts: Sequence[Any], groups: Sequence[Sequence[Any]], *,
                delimiter: str | None = "\n") -> np.ndarray:  # [P] int
    """For each prompt, the index in its group of the completion with the largest minimum step reward
    (:func:`min_step_reward`; the first on ties). All completions are scored in the same batches."""
    if len(prompts) != len(groups):
      raise ValueError(f"{len(prompts)} prompts but {len(groups)} groups of completions")
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    scores = [min_step_reward(r) for r in self.step_rewards(flat_p, [c for g in groups for c in g],
                                                            delimiter=delimiter)]
    out, lo = [], 0
    for g in groups:
      if not len(g):
        raise ValueError(f"best_of_n: prompt {len(out)} has no completions")
      out.append(int(np.argmax(scores[lo:lo + len(g)])))
      lo += len(g)
    return np.asarray(out, np.int64)


def _split_by(keys: np.ndarray, values: np.ndarray):
  """``(unique keys, values split per key)`` of values sorted by ``keys``."""
  uniq, starts = np.unique(keys, return_index=True)
  return uniq, np.split(values, starts[1:])
