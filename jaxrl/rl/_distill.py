"""On-policy distillation in the RL trainer: a frozen teacher scores the student's own rollouts.

The ``distill:`` section of :class:`jaxrl.rl.RLConfig` turns the RL step into on-policy distillation; the rollout
path, packing, learner and checkpoints are the RL trainer's own. The student samples with its engine; the
teacher (a second model, frozen, on the trainer's mesh, any size, same tokenizer) runs over the same packed
micro-batches:

* ``mode: reverse_kl`` (Thinking Machines, "On-Policy Distillation", 2025; Qwen3's strong-to-weak
  distillation): the teacher's log-probs of the sampled tokens (the chunked log-prob program the trainer uses
  for π_old and π_ref), and each response token's advantage becomes
  ``reward_coef · A_task + coef · (log π_teacher(y_t) − log π_student(y_t))``
  (:func:`jaxrl.losses.reverse_kl_advantages`), trained with the configured policy objective (importance
  ratio and clipping as PPO's). Both log-probs come from the same program at the rollout parameters, so a
  teacher equal to the student gives exactly 0.
* ``mode: gkd`` (Agarwal et al. 2024, TRL ``GKDTrainer``): the loss adds ``coef · Σ w · JSD_β(teacher ‖ student)`` over the response tokens, with full-vocabulary
  distributions of both models (:func:`jaxrl.losses.token_generalized_jsd`, chunked over tokens: at most
  ``2 × logprob_chunk_size × V`` logits at once), aggregated with ``algorithm.aggregation``; the teacher's
  forward runs inside the update (no gradient, no stored activations). With ``lmbda < 1`` (GKD's λ) a step is
  on-policy with probability λ and otherwise trains on fixed completions of ``distill.data`` (e.g. the teacher's
  own samples): :class:`MixedRollout`.

Teacher and student must share the tokenizer (and, for ``gkd``, the vocabulary size); :func:`check_shared_vocab`
refuses otherwise, naming both sources. ``distill.server`` puts the teacher behind ``jaxrl serve`` instead
(``reverse_kl`` only): :class:`jaxrl.rl._distill_server.ServerTeacher`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models
from jaxrl.models import ModelSource
from jaxrl.rl._loss import make_logprob_fn
from jaxrl.rl._prompts import EncodedPrompts, PromptStream, read_records
from jaxrl.rl._rollout import Rollout
from jaxrl.rl._source import RolloutBatch, RolloutSource


def describe_source(source: ModelSource, tokenizer_dir: str) -> str:
  """``preset=tiny (tokenizer <dir>)`` / ``hf_dir=<dir> (tokenizer <dir>)``: a model source in error messages."""
  where = f"preset={source.preset}" if source.preset is not None else f"hf_dir={source.hf_dir}"
  return f"{where} (tokenizer {tokenizer_dir})"


def check_shared_vocab(student_tokenizer, teacher_tokenizer, *, student_vocab: int, teacher_vocab: int,
                       student: str, teacher: str, same_vocab_size: bool) -> None:
  """Refuses a teacher whose token ids do not mean what the student's mean.

  The tokenizers must have the same vocabulary (``get_vocab()``: every token string to the same id, added
  tokens included); with ``same_vocab_size`` (GKD compares full distributions) the models' embedding sizes must
  be equal too. ``student`` / ``teacher`` describe the two sources in the message.
  """
  a, b = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
  if a != b:
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
    raise ValueError(f"distill.teacher: the teacher's tokenizer differs from the student's ({len(b)} vs {len(a)} "
                     f"tokens; e.g. {diff}): student {student}, teacher {teacher}. On-policy distillation needs a "
                     "shared tokenizer")
  if same_vocab_size and student_vocab != teacher_vocab:
    raise ValueError(f"distill.teacher: mode gkd compares full next-token distributions but the vocab sizes differ "
                     f"(student {student_vocab}, teacher {teacher_vocab}): student {student}, teacher {teacher}")


class Teacher:
  """The frozen teacher on the trainer's mesh: its parameters (compute dtype), log-prob program and GKD term.

  Args:
    cfg: the run's :class:`jaxrl.rl.RLConfig` (``distill``, ``rollout.temperature``, ``algorithm``).
    student_tokenizer, student_cfg, student_tokenizer_dir: the student's tokenizer, model config and its dir.
    mesh, rules: the trainer's mesh and logical-axis rules.
  """

  def __init__(self, cfg, *, student_tokenizer, student_cfg, student_tokenizer_dir: str, mesh, rules):
    d = cfg.distill
    self.cfg = d
    tok_dir = data_lib.tokenizer_dir(d.tokenizer, d.teacher.hf_dir)
    teacher_cfg = d.teacher.config()  # config.json only: refuse before reading any weights
    check_shared_vocab(student_tokenizer, models.load_tokenizer(tok_dir), student_vocab=student_cfg.vocab_size,
                       teacher_vocab=teacher_cfg.vocab_size, same_vocab_size=d.mode == "gkd",
                       student=describe_source(cfg.model, student_tokenizer_dir), teacher=describe_source(d.teacher, tok_dir))
    model = d.teacher.build(mesh=mesh, rules=rules)
    models.check_tokenizer(student_tokenizer, model.cfg)
    self.graphdef, params = nnx.split(model)
    self.params = models.cast_params(params, model.cfg.dtype)  # frozen: compute-dtype weights only
    self.logprob_fn = make_logprob_fn(self.graphdef, temperature=cfg.rollout.temperature,
                                        chunk_size=cfg.algorithm.logprob_chunk_size)
    self.temperature = d.temperature or cfg.rollout.temperature
    self.chunk_size = cfg.algorithm.logprob_chunk_size

  def gkd_term(self, student_model, student_hidden, mb, teacher_params):
    """``(Σ w · JSD_β, {"distill/jsd": Σ w · JSD_β})`` of a micro-batch: the teacher's forward (no gradient) and the
    chunked JSD against the student's hidden states ``[B, T, D]``; ``w`` are the micro-batch's loss weights."""
    teacher = nnx.merge(self.graphdef, jax.lax.stop_gradient(teacher_params))
    hidden = teacher(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"], return_hidden=True)
    jsd = losses.token_generalized_jsd(student_hidden, student_model.unembed_matrix(), hidden,
                                       teacher.unembed_matrix(), beta=self.cfg.beta, temperature=self.temperature,
                                       chunk_size=self.chunk_size)  # [B, T]
    w = mb["weights"]
    term = jnp.sum(jnp.where(w != 0, w * jsd, 0.0))
    return self.cfg.coef * term, {"distill/jsd": jax.lax.stop_gradient(term)}


@jax.jit
def add_reverse_kl(advantages, student_lp, teacher_lp, mask, coef):
  """``advantages + reverse_kl_advantages(student, teacher, mask, coef)`` on device (all ``[R, T]`` arrays), with
  the sums ``(Σ mask·(log π_s − log π_t), Σ mask·|A|, Σ mask)`` for the step's metrics."""
  mask = mask.astype(jnp.float32)
  adv = advantages + losses.reverse_kl_advantages(student_lp, teacher_lp, mask, coef=coef)
  kl = jnp.sum(jnp.where(mask > 0, student_lp - teacher_lp, 0.0))
  return adv, (kl, jnp.sum(jnp.abs(adv) * mask), jnp.sum(mask))


class FixedCompletions:
  """``distill.data``'s completions, tokenised once, handed out in a seeded per-epoch shuffle.

  Each record is a ``messages`` conversation whose last turn is the one trained assistant answer, or a
  ``prompt``/``completion`` pair. Its prompt is tokenised as the trainer's prompts are (the chat template up to
  the generation prompt) and its completion as the student would emit it (the assistant turn through the end of
  turn), so a fixed row packs exactly like a sampled one. A prompt over ``max_prompt_tokens``, a completion over
  ``max_new`` or a record without exactly one answer raises a one-line error naming ``file:line``.
  """

  def __init__(self, paths, tokenizer, *, max_prompt_tokens: int, max_new: int, seed: int):
    self.prompts, self.completions, self.texts = [], [], []
    for rec in read_records(paths):
      where = rec["_where"]
      enc = data_lib.encode_record(tokenizer, rec)
      turn = enc["turn_id"]
      at = np.flatnonzero(turn > 0)
      if turn.max(initial=0) != 1 or len(at) == 0 or at[-1] - at[0] + 1 != len(at):
        raise data_lib.DataError(f"{where}: distill.data needs one assistant answer per record (the completion), "
                                 f"got {int(turn.max(initial=0))} trained assistant turns")
      prompt, completion = enc["tokens"][:at[0]], enc["tokens"][at]
      if len(prompt) > max_prompt_tokens:
        raise data_lib.DataError(f"{where}: prompt of {len(prompt)} tokens is over data.max_prompt_tokens="
                                 f"{max_prompt_tokens}")
      if len(completion) > max_new:
        raise data_lib.DataError(f"{where}: completion of {len(completion)} tokens is over the "
                                 f"{max_new} new tokens a rollout holds (rollout.max_new_tokens)")
      self.prompts.append(prompt.astype(np.int32))
      self.completions.append(completion.astype(np.int32))
      self.texts.append(data_lib.record_messages(rec)[-1]["content"])
    self.seed = seed
    self._epoch, self._order = -1, None  # the last epoch's order: a step's rows share it

  def __len__(self) -> int:
    return len(self.completions)

  def index(self, position: int) -> int:
    """The record at stream ``position`` (0, 1, ...): epoch ``position // len`` in its own seeded order."""
    epoch, k = divmod(position, len(self))
    if epoch != self._epoch:
      self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self))
    return int(self._order[k])

  def rollout(self, positions, *, width: int, n: int) -> Rollout:
    """The records at stream ``positions`` as a :class:`Rollout` of groups of ``n`` (zero rewards and sampler
    log-probs: pure distillation recomputes π_old), responses padded to ``width``."""
    rows = [self.index(p) for p in positions]
    lengths = np.asarray([len(self.completions[r]) for r in rows], np.int32)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :lengths[i]] = self.completions[r]
    zeros = np.zeros(len(rows), np.float32)
    return Rollout(prompt_ids=tuple(self.prompts[r] for r in rows), tokens=tokens,
                   logprobs=np.zeros(tokens.shape, np.float32), lengths=lengths,
                   truncated=np.zeros(len(rows), bool), group_ids=np.arange(len(rows), dtype=np.int32) // n,
                   rewards=zeros, task_rewards=zeros, texts=tuple(self.texts[r] for r in rows))


class MixedRollout:
  """GKD's mixture of on- and off-policy data (Agarwal et al. 2024, §3; TRL ``GKDTrainer``'s ``lmbda``).

  Step ``s`` is on-policy with probability ``lmbda``: the draw is ``flips[s]``, fixed by the seed for the whole
  run, so a resumed run makes the same choices. An on-policy step is ``inner``'s rollout; an off-policy one is
  the next ``prompts_per_step × n`` rows of ``fixed`` (every off-policy step before it has taken its rows; each
  process takes its contiguous share), so both kinds of step train on the same number of sequences. The
  metric ``distill/on_policy`` says which a step was.
  """

  def __init__(self, inner: RolloutSource, fixed: FixedCompletions, *, rollout, lmbda: float, seed: int,
               steps: int, procs: int = 1, pid: int = 0):
    self.inner, self.fixed, self.cfg = inner, fixed, rollout
    self.procs, self.pid = procs, pid
    self.flips = np.random.default_rng([seed, 0x676B64]).random(steps + 1) < lmbda  # flips[s]: step s on-policy
    self.flips[0] = True  # steps count from 1
    self.before = np.cumsum(~self.flips) - ~self.flips  # off-policy steps before each step

  def rollout(self, step: int, prompts: EncodedPrompts, stream: PromptStream) -> RolloutBatch:
    if self.flips[step]:
      batch = self.inner.rollout(step, prompts, stream)
      return dataclasses.replace(batch, metrics={**batch.metrics, "distill/on_policy": 1.0})
    _, max_new, n = self.cfg.stage(step)
    want = self.cfg.prompts_per_step * n
    per = want // self.procs
    start = int(self.before[step]) * want + self.pid * per
    ro = self.fixed.rollout(range(start, start + per), width=max_new, n=n)
    return RolloutBatch(rollout=ro, drawn=ro, metrics={"distill/on_policy": 0.0})

  def set_weights(self, model, *, version: int) -> None:
    self.inner.set_weights(model, version=version)

  def close(self) -> None:
    self.inner.close()
