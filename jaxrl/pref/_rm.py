"""Bradley–Terry reward models: the sequence score, the export of trunk + head, and the batched scorer.

A reward model is :class:`jaxrl.models.ValueModel` (a decoder trunk and a scalar head ``[D] -> 1``, the
critic's construction); the reward of a sequence is the head's output at its **last token** (the end of the
answer's turn), as TRL's ``RewardTrainer`` and InstructGPT read it, or with ``pooling="mean"`` the mean of the
head over the answer's positions (the tokens whose next token is an answer token: the ``loss_mask`` of the
packed row), so a verdict formed at one step need not be carried to the end. In a packed row either reads one
``seq_ids`` run only, so a sequence's score does not depend on what else shares its row.

Export (``out_dir/hf`` of ``jaxrl dpo`` with ``loss.name: bradley_terry``): the trunk as a Hugging Face
directory (:func:`jaxrl.models.save_pretrained`; without ``lm_head.weight``, which the reward model does not
have) plus :data:`REWARD_HEAD_FILE`, a safetensors file with ``score.weight`` ``[1, D]`` and ``score.bias``
``[1]`` (float32; the names of ``transformers``' ``*ForSequenceClassification`` head, which has no bias):
``r = h_last · score.weight[0] + score.bias[0]``; the file's metadata ``pooling`` (absent: ``last``) says
which positions are read.

With ``logprob_feature`` (:class:`LogProbValueModel`) the reward model keeps its trunk's unembedding and the
value at each position adds ``α·log π(next token)``: with ``mean`` pooling the score is the head's mean plus
``α`` times the trunk's length-normalised log-likelihood of the answer. Its export adds ``lm_head.weight`` (an
untied trunk) and ``score.logprob_scale`` ``[1]`` (``α``) to the head's file.
"""

from __future__ import annotations

from collections.abc import Sequence
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

REWARD_HEAD_FILE = "reward_head.safetensors"
"""The reward head's file in an exported reward-model directory (module docstring)."""

POOLINGS = ("last", "mean")
"""Where a sequence's reward is read (module docstring): the last token, or the mean over the answer."""


def check_pooling(pooling: str, where: str = "pooling") -> str:
  """``pooling`` if it is one of :data:`POOLINGS`, else a ``ValueError`` naming ``where``."""
  if pooling not in POOLINGS:
    raise ValueError(f"{where} must be one of {list(POOLINGS)}, got {pooling!r}")
  return pooling


def last_token_mask(seq_ids: jax.Array) -> jax.Array:  # [R, T] bool
  """True at the last token of each sequence of packed rows (``seq_ids`` > 0, runs of one id per sequence)."""
  seq_ids = jnp.asarray(seq_ids)
  following = jnp.concatenate([seq_ids[:, 1:], jnp.zeros_like(seq_ids[:, :1])], axis=1)  # [R, T]
  return (seq_ids > 0) & (following != seq_ids)


def sequence_scores(values: jax.Array, seq_ids: jax.Array, num_sequences: int, *, pooling: str = "last",
                    answer_mask: jax.Array | None = None) -> jax.Array:  # [S]
  """The value at each sequence's last token, or (``pooling="mean"``) its mean over the ``answer_mask``
  positions, ``[S]`` (sequence ``j`` carries ``seq_ids == j + 1``; a sequence absent from the rows scores 0).

  Args:
    values: ``[R, T]`` per-token head outputs.
    seq_ids: ``[R, T]`` sequence ids (0 padding), as :func:`jaxrl.pref.pack_pairs` lays them out.
    num_sequences: ``S``.
    pooling: one of :data:`POOLINGS`.
    answer_mask: ``[R, T]`` the positions ``mean`` averages (the packed ``loss_mask``); needed for ``mean``.
  """
  seq_ids = jnp.asarray(seq_ids)
  if check_pooling(pooling) == "last":
    read = last_token_mask(seq_ids)  # [R, T]
  elif answer_mask is None:
    raise ValueError("pooling='mean' needs answer_mask")
  else:
    read = (jnp.asarray(answer_mask) > 0) & (seq_ids > 0)  # [R, T]
  idx = jnp.where(read, seq_ids - 1, num_sequences).reshape(-1)  # [R*T]
  total = jax.ops.segment_sum(jnp.where(read, values, 0.0).reshape(-1), idx, num_segments=num_sequences + 1)[:-1]
  if pooling == "last":
    return total
  count = jax.ops.segment_sum(read.reshape(-1).astype(values.dtype), idx, num_segments=num_sequences + 1)[:-1]
  return total / jnp.maximum(count, 1.0)


class LogProbValueModel(models.ValueModel):
  """A reward model whose value at position ``t`` is the head's plus ``α·log π(tokens[t+1] | tokens[≤t])``, the
  trunk's own log-prob of the next token (it keeps its unembedding; ``α`` a learnt scalar, starting at
  ``logprob_scale``).

  Read with ``pooling="mean"`` (the positions whose next token is an answer token of the same sequence) a
  sequence's score is ``mean_t(h_t·w + b) + α·(1/|y|)·Σ_t log π(y_t | x, y_<t)``: the head plus SimPO's
  length-normalised log-likelihood (Meng et al. 2024, with ``β = α``), the reward a model trained on good answers
  already carries. With the head at zero it ranks pairs as its start model's likelihood does, and training moves
  the head, ``α`` and the trunk together. The token after a row's last position is taken as 0 and a sequence's
  last token is followed by the next sequence's first; the mean over the answer reads neither.
  """

  def __init__(self, trunk, *, logprob_scale: float = 1.0, chunk_size: int = 1024):
    unembedding = trunk.lm_head  # None when tied: the embedding unembeds
    super().__init__(trunk)
    trunk.lm_head = unembedding
    self.logprob_scale = nnx.Param(jnp.asarray(logprob_scale, jnp.float32))
    self.chunk_size = chunk_size  # tokens per chunk of the log-softmax (jaxrl.losses.token_logprobs)

  def __call__(self, tokens: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
               rope_positions: jax.Array | None = None, images=None) -> jax.Array:  # [B, T] float32
    h = self.trunk(tokens, positions=positions, segment_ids=segment_ids, rope_positions=rope_positions,
                   images=images, return_hidden=True)  # [B, T, D]
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)  # [B, T]
    logp = losses.token_logprobs(h, self.trunk.unembed_matrix(), following, chunk_size=self.chunk_size)  # [B, T]
    return self.head(h) + self.logprob_scale[...] * logp


def reward_value_model(trunk, *, logprob_feature: bool = False, chunk_size: int = 1024) -> models.ValueModel:
  """The reward model on ``trunk`` with a zero head: :class:`jaxrl.models.ValueModel`, or with
  ``logprob_feature`` :class:`LogProbValueModel` (its log-softmax in chunks of ``chunk_size`` tokens)."""
  return LogProbValueModel(trunk, chunk_size=chunk_size) if logprob_feature else models.ValueModel(trunk)


def export_reward_model(vm: models.ValueModel, path: str | Path, *, tokenizer=None, pooling: str = "last") -> Path:
  """Writes the trunk (HF directory) and :data:`REWARD_HEAD_FILE` (with its ``pooling``) under ``path``; returns
  the head's path."""
  from safetensors.numpy import save_file  # lazy: safetensors is only needed to export

  path = Path(path)
  models.save_pretrained(vm.trunk, path, tokenizer=tokenizer)
  head = {"score.weight": vm.value_head[...].reshape(1, -1), "score.bias": vm.value_bias[...].reshape(1)}
  if isinstance(vm, LogProbValueModel):
    head["score.logprob_scale"] = vm.logprob_scale[...].reshape(1)
  head = sharding.to_host(head)
  if jax.process_index() == 0:
    save_file({k: np.asarray(v, np.float32) for k, v in head.items()}, str(path / REWARD_HEAD_FILE),
              metadata={"pooling": check_pooling(pooling)})
  return path / REWARD_HEAD_FILE


def load_reward_model(path: str | Path, *, mesh=None, rules=None, dtype: str | None = None) -> models.ValueModel:
  """The reward model exported by :func:`export_reward_model` (trunk + head), placed on ``mesh``.

  Raises:
    FileNotFoundError: naming the missing :data:`REWARD_HEAD_FILE`.
    ValueError: when the head's shapes do not match the trunk.
  """
  from safetensors.numpy import load_file  # lazy: safetensors is only needed to load a reward model

  path = Path(path)
  head_path = path / REWARD_HEAD_FILE
  if not head_path.is_file():
    raise FileNotFoundError(f"{head_path}: no reward head; a reward-model directory is the out_dir/hf of "
                            "`jaxrl dpo` with loss.name: bradley_terry (docs/pref.md)")
  head = load_file(str(head_path))
  shapes = {k: list(v.shape) for k, v in head.items()}
  scale = head.get("score.logprob_scale")
  if scale is not None and scale.shape != (1,):  # checked before the trunk is read
    raise ValueError(f"{head_path}: want score.logprob_scale [1], got {shapes}")
  if scale is None:  # the trunk has no unembedding; tying it makes the loader not ask for lm_head.weight
    vm = models.ValueModel(models.load_pretrained(path, mesh=mesh, rules=rules, dtype=dtype,
                                                  tie_word_embeddings=True))
  else:
    vm = LogProbValueModel(models.load_pretrained(path, mesh=mesh, rules=rules, dtype=dtype),
                           logprob_scale=float(scale[0]))
  d = vm.trunk.cfg.hidden_size
  w, b = head.get("score.weight"), head.get("score.bias")
  if w is None or b is None or w.shape != (1, d) or b.shape != (1,):
    raise ValueError(f"{head_path}: want score.weight [1, {d}] and score.bias [1], got {shapes}")
  vm.value_head[...] = jnp.asarray(w[0], jnp.float32)
  vm.value_bias[...] = jnp.asarray(b[0], jnp.float32)
  return models.place_value_model(vm, mesh=mesh, rules=rules)


def reward_pooling(path: str | Path) -> str:
  """The ``pooling`` of an exported reward model (its head file's metadata; ``last`` when absent)."""
  from safetensors import safe_open  # lazy: safetensors is only needed to load a reward model

  head_path = Path(path) / REWARD_HEAD_FILE
  with safe_open(str(head_path), "np") as f:
    pooling = (f.metadata() or {}).get("pooling", "last")
  return check_pooling(pooling, f"{head_path}: metadata pooling")


class RewardModel:
  """Scores ``(prompt, completion)`` batches with a reward model on a mesh: one jitted forward per
  ``[rows, seq_len]`` packed batch, no server.

  Each pair is encoded as the trainer encodes a preference pair's answer (:func:`jaxrl.pref.answer_messages`
  through the chat template), the sequences are packed (best fit) into batches of ``rows`` rows, and each
  score is the head's output at the sequence's last token or its mean over the answer (``pooling``,
  :func:`sequence_scores`).

  On a mesh over several processes each process scores its own pairs: it packs them into its
  ``rows / processes`` rows of each batch, the processes agree on the number of batches (the ones with fewer run
  batches of padding) and each reads back its own rows (:class:`jaxrl.pref._scoring.ProcessBatches`). Every
  process must call :meth:`score` the same number of times, with any number of pairs (none included).
  """

  def __init__(self, vm: models.ValueModel, tokenizer, *, rows: int = 8, seq_len: int = 512, mesh=None,
               rules=None, pooling: str = "last"):
    self.tokenizer, self.rows, self.seq_len = tokenizer, rows, seq_len
    self.pooling = check_pooling(pooling, "reward model pooling")
    self.mesh = mesh if mesh is not None else sharding.MeshConfig().build()
    self.rules = rules if rules is not None else sharding.LogicalRules.default()
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if rows % dp:
      raise ValueError(f"reward.model.rows={rows} must be a multiple of the data-parallel devices ({dp})")
    models.check_tokenizer(tokenizer, vm.trunk.cfg)
    self.graphdef, self.params = nnx.split(models.place_value_model(vm, mesh=self.mesh, rules=self.rules))
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self._batches = ProcessBatches(self.batch_sharding, rows=rows, seq_len=seq_len, key="reward.model")
    graphdef = self.graphdef

    def forward(params, batch):  # [R, T]
      return nnx.merge(graphdef, params)(batch["tokens"], positions=batch["positions"],
                                         segment_ids=batch["segment_ids"])
    self._forward = jax.jit(forward, out_shardings=self.batch_sharding)

  @classmethod
  def load(cls, path: str | Path, *, tokenizer=None, mesh=None, rules=None, **kwargs) -> RewardModel:
    """The exported reward model of ``path`` (its tokenizer and pooling by default); ``kwargs``: ``rows``,
    ``seq_len``."""
    mesh = mesh if mesh is not None else sharding.MeshConfig().build()  # loaded onto it: on several processes
    vm = load_reward_model(path, mesh=mesh, rules=rules)  # a process-local copy could not move to a global mesh
    kwargs.setdefault("pooling", reward_pooling(path))
    return cls(vm, tokenizer or models.load_tokenizer(path), mesh=mesh, rules=rules, **kwargs)

  def encode(self, prompt: Any, completion: Any, where: str = "sample") -> dict[str, np.ndarray]:
    """``tokens`` and ``loss_mask`` [L] of one scored sequence.

    Raises:
      ValueError: when the sequence is longer than ``seq_len`` (never truncated).
    """
    seq = data_lib.encode_chat(self.tokenizer, answer_messages(prompt, completion))
    if len(seq["tokens"]) > self.seq_len:
      raise ValueError(f"{where}: prompt + completion is {len(seq['tokens'])} tokens, longer than "
                       f"reward.model.seq_len={self.seq_len}")
    return {"tokens": seq["tokens"], "loss_mask": seq["loss_mask"]}

  def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> np.ndarray:  # [N] float32
    """The reward of each ``(prompt, completion)``; prompts are strings or chat-message lists. With several
    processes a collective call (class docstring): each process passes and gets its own pairs."""
    out = np.zeros(len(completions), np.float32)

    def prepare():  # raising here raises on every process (no process is left in a collective)
      if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
      return [self.encode(p, c, f"sample {i}") for i, (p, c) in enumerate(zip(prompts, completions))]
    for arrays in self._batches.batches(prepare, pad_id=self.tokenizer.pad_token_id or 0):
      batch = self._batches.put(arrays, ("tokens", "positions", "segment_ids"))
      values = self._batches.local(self._forward(self.params, batch))  # [R / processes, T] this process's rows
      if self.pooling == "last":
        rr, cc = np.nonzero(np.asarray(last_token_mask(arrays["seq_ids"])))
        out[arrays["seq_ids"][rr, cc] - 1] = values[rr, cc]
        continue
      ids = np.unique(arrays["seq_ids"][arrays["seq_ids"] > 0])
      scores = sequence_scores(jnp.asarray(values, jnp.float32), arrays["seq_ids"], len(out), pooling=self.pooling,
                               answer_mask=arrays["loss_mask"])
      out[ids - 1] = np.asarray(scores)[ids - 1]
    return out


def reward_model_score(prompt: str, completion: str, *, rm_score: float, **_) -> float:
  """The reward function of ``jaxrl rl`` under ``reward.model``: the score :class:`RewardModel` computed for the
  sample's whole batch before it reached the pool (passed as the sample field ``rm_score``)."""
  del prompt, completion
  return float(rm_score)
