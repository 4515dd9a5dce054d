"""The rollout backend built from the config, in one place: the engine's ``max_len`` rule and its construction.

Every engine built from settings goes through :func:`build_engine`: the synchronous trainer's rollouts and
evaluation (:func:`build_sampler`), the asynchronous trainer's rollout sub-mesh and ``jaxrl serve --backend
engine``. :func:`rollout_max_len` is the one ``max_len`` of a trainer's sampler or engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl import sampling
from jaxrl.rl._config import EngineConfig, RLConfig


def rollout_max_len(cfg: RLConfig, step: int, last: int | None = None) -> int:
  """The ``max_len`` (prompt + response tokens per row) of the sampler or engine at RL step ``step``.

  ``data.max_prompt_tokens`` plus the larger response budget of the step's context stage
  (``rollout.stage(step)``) and of evaluation (``eval.max_new_tokens``, default the stage's), so one
  sampler serves both. With ``last``: the largest over steps ``step .. last``, for an engine that serves every
  stage of them: the asynchronous trainer's rollout engine, built once, whose admission runs ahead into later
  stages (its evaluation runs on the trainer's own sampler, rebuilt per stage).
  """
  starts = [s.start_step for s in cfg.rollout.context_schedule if last is not None and step < s.start_step <= last]

  def at(k: int) -> int:
    max_new = cfg.rollout.stage(k)[1]
    return cfg.data.max_prompt_tokens + max(max_new, cfg.eval.max_new_tokens or max_new)
  return max(at(k) for k in [step, *starts])


def build_engine(model, tokenizer, settings: EngineConfig, *, max_len: int, mesh=None, rules=None,
                 num_slots: int | None = None, version: int = 0, entropy: bool = False, max_top_logprobs: int = 0,
                 stop_strings: Sequence[str] | None = None) -> sampling.Engine:
  """A :class:`jaxrl.sampling.Engine` over ``model`` with the knobs of ``settings`` (``rollout.engine``).

  Args:
    model: the policy (parameters in the compute dtype, placed on ``mesh``).
    tokenizer: its tokenizer (``None``: token ids in and out only).
    settings: slots, cache budget (``kv_cache_bytes``, ``kv_cache_fraction`` or ``num_blocks``), block
      size, decode steps per call, prefill rows and chunk.
    max_len: prompt + response tokens per row (:func:`rollout_max_len` for a trainer).
    mesh, rules: where the engine runs and the logical-axis rules (``None``: one device).
    num_slots: overrides ``settings.num_slots`` (each process's share on several processes).
    version: the policy version of ``model``.
    entropy: record each sampled token's entropy (ARPO's probe).
    max_top_logprobs: most top log-probs a request may ask for.
    stop_strings: engine-wide stop strings (``None``: none set).
  """
  engine = sampling.Engine(
      model, tokenizer, mesh=mesh, rules=rules, max_len=max_len,
      num_slots=settings.num_slots if num_slots is None else num_slots, kv_cache_bytes=settings.kv_cache_bytes,
      kv_cache_fraction=settings.kv_cache_fraction, num_blocks=settings.num_blocks, block_size=settings.block_size,
      steps_per_call=settings.steps_per_call, prefill_rows=settings.prefill_rows,
      prefill_chunk=settings.prefill_chunk, version=version, entropy=entropy, max_top_logprobs=max_top_logprobs)
  if stop_strings is not None:
    engine.set_stops((), stop_strings)
  return engine


def build_sampler(cfg: RLConfig, model, tokenizer, *, max_len: int, mesh=None, rules=None, version: int = 0,
                  entropy: bool = False) -> sampling.Sampler | sampling.Engine:
  """The synchronous trainer's sampler: the engine of ``rollout.engine`` (continuous batching, same
  ``generate`` contract) or, without that section, a whole-batch :class:`jaxrl.sampling.Sampler`
  (``rollout.decode_impl``)."""
  if cfg.rollout.engine is not None:
    return build_engine(model, tokenizer, cfg.rollout.engine, max_len=max_len, mesh=mesh, rules=rules,
                        version=version, entropy=entropy)
  return sampling.Sampler(model, tokenizer, mesh=mesh, rules=rules, max_len=max_len,
                          decode_impl=cfg.rollout.decode_impl, version=version)
