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
* ``mode: gkd`` (Agarwal et al. 2024, TRL ``GKDTrainer`` with ``lmbda = 1``, i.e. only student-generated
  sequences): the loss adds ``coef · Σ w · JSD_β(teacher ‖ student)`` over the response tokens, with full-vocabulary
  distributions of both models (:func:`jaxrl.losses.token_generalized_jsd`, chunked over tokens: at most
  ``2 × logprob_chunk_size × V`` logits at once), aggregated with ``algorithm.aggregation``; the teacher's
  forward runs inside the update (no gradient, no stored activations).

Teacher and student must share the tokenizer (and, for ``gkd``, the vocabulary size); :func:`check_shared_vocab`
refuses otherwise, naming both sources. ``distill.server`` puts the teacher behind ``jaxrl serve`` instead
(``reverse_kl`` only): :class:`jaxrl.rl._distill_server.ServerTeacher`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models
from jaxrl.models import ModelSource
from jaxrl.rl._loss import make_logprob_fn


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
