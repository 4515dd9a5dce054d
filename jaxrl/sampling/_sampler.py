"""The KV-cache sampler: a jitted prefill and a jitted decode loop per shape bucket.

Layout. ``U`` distinct prompts are right-padded to ``P`` (a power of two) and prefilled once; their
cache rows are copied to the ``R = U·n`` sample rows (a sample is a row copy). Row ``r`` holds its
prompt in cache slots ``[0, p_r)`` and its ``i``-th generated token at slot ``p_r + i`` (position =
slot), so each row's valid cache is a contiguous prefix. The cache has ``S = P + G`` slots, ``G`` the
power-of-two bucket of ``max_new_tokens``; rows are padded to a power of two (and a multiple of the
data-parallel mesh size) with finished dummy rows.

Loop invariant: the cache holds every token of a row's sequence (prompt, then generated) except the
last, which is *pending* and is fed at the next step. After prefill the pending token is the last
prompt token, so the first decode step samples token 0 and sampling is compiled once, inside the
``lax.while_loop``, which exits as soon as every row has finished. The cache (with the rest of the
row state) is donated into the decode program.

Randomness: row keys are ``fold_in(fold_in(key(seed), request_id), sample)`` and step ``i`` folds in
``i``, so draws do not depend on the row slot, the batch, the bucket or how a generation is split
into interrupted chunks.

The jitted programs (prefill, decode, recompute, fork) live in :mod:`jaxrl.sampling._sampler_programs`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl import _compile_target, _host_memory, models
from jaxrl.sampling import _layers, _vision
from jaxrl.sampling._engine import Engine
from jaxrl.sampling._paged import blocks_for
from jaxrl.sampling._requests import (
    FINISH_REASONS,
    PromptArgs,
    Stops,
    build_stops,
    check_counts,
    check_token,
    encode_prompts,
    gather_prompts,
    length_bucket,
    next_pow2,
    per_prompt,
    prompt_args,
    special_tokens,
    stop_string_end,
)
from jaxrl.sampling._rows import SampleOutput, SamplerState, TopLogprobs, process_rows
from jaxrl.sampling._sampler_programs import sampler_programs
from jaxrl.sharding import LogicalRules, allgather_scalar, to_host


# --------------------------------------------------------------------------------------------------
# The sampler


def _own_arrays(params, source) -> list[jax.Array]:
  """The arrays of ``params`` that are not ``source``'s own (the copies the sampler made)."""
  given = {id(x) for x in jax.tree.leaves(nnx.state(source))}
  return [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and id(x) not in given]


class Sampler:
  """Batched, jitted sampling from a :class:`jaxrl.models.Transformer` with a KV cache.

  Example::

      sampler = sampling.Sampler(model, tokenizer, mesh=mesh, max_len=1024)
      out = sampler.generate(["1+1="], n=4, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=0)
      out.tokens, out.logprobs, out.lengths, out.finish_reason, out.texts

  Args:
    model: the model (split once here; parameters are passed to the jitted programs, so new weights
      of the same shapes never recompile).
    tokenizer: a transformers tokenizer (optional when prompts are token lists).
    mesh: the mesh the model lives on; the KV cache is sharded with ``rules`` (rows over
      ``cache_batch``, kv heads over ``cache_kv_heads``). ``None``: one device.
    rules: logical-axis rules (default :meth:`LogicalRules.default`).
    max_len: most tokens per row (prompt + completion); longer prompts are refused and completions cut.
    eos_token_ids: tokens that end a completion with ``"eos"``; default the tokenizer's eos id.
    pad_token_id: fills ``tokens`` after the end; default the tokenizer's pad id, else 0.
    cache_dtype: KV-cache dtype (default the model's compute dtype).
    decode_impl: ``"kernel"``: decode steps call :func:`jaxrl.kernels.decode_attention`, reading only
      each row's valid cache prefix; ``"model"``: the model's own cache path (attention over all slots,
      masked).
    min_bucket: smallest prompt / completion length bucket.
    add_special_tokens: passed to the tokenizer when encoding string prompts.
    version: policy version recorded for tokens generated with the current weights.
    unstack_layers: sample from a copy of a ``scan_layers`` model with one array per layer
      (:func:`jaxrl.sampling.unstack_layers`): on CPU a scanned decode step copies every layer's
      weight slice each step. Costs a copy of the block weights. Default: when compiling for CPU
      (:func:`jaxrl._compile_target.compile_platform`: this process's backend unless a plan says otherwise).
    paged: serve :meth:`generate` calls without ``max_steps`` / ``return_state`` on the rollout engine
      (:class:`jaxrl.sampling.Engine`: a paged cache sized to this call's rows, completions not rounded
      up past one block) instead of the whole-batch cache; resumable generations (``max_steps``,
      ``return_state``, :meth:`resume`, :meth:`fork`) and ``decode_impl="model"`` keep the whole-batch
      path. Same contract and draws; floating-point results differ by XLA's rounding (~1 ulp).
  """

  def __init__(self, model, tokenizer=None, *, mesh: Mesh | None = None, rules: LogicalRules | None = None,
               max_len: int = 2048, eos_token_ids: Sequence[int] | None = None, pad_token_id: int | None = None,
               cache_dtype: str | None = None, decode_impl: str = "kernel", min_bucket: int = 8,
               add_special_tokens: bool = True, version: int = 0, unstack_layers: bool | None = None,
               paged: bool = False):
    if not isinstance(max_len, int) or max_len < 2:
      raise ValueError(f"max_len: must be an int >= 2, got {max_len!r}")
    if decode_impl not in ("kernel", "model"):
      raise ValueError(f"decode_impl: {decode_impl!r} is not one of ['kernel', 'model']")
    if not isinstance(paged, bool):
      raise ValueError(f"paged: must be a bool, got {paged!r}")
    self.paged = paged
    self._engine_programs: dict[int, object] = {}  # the engine programs paged calls used (compile_counts)
    self.cfg = model.cfg
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.rules = rules or LogicalRules.default()
    self.max_len = max_len
    self.min_bucket = min_bucket
    self.decode_impl = decode_impl
    self.add_special_tokens = add_special_tokens
    self.cache_dtype = jnp.dtype(cache_dtype or self.cfg.dtype)
    self.eos_token_ids, self.pad_token_id = special_tokens(
        tokenizer, eos_token_ids, pad_token_id, functools.partial(check_token, tokenizer, self.cfg.vocab_size))
    if unstack_layers is None:
      unstack_layers = _compile_target.compile_platform() == "cpu"
    self.unstack_layers = bool(unstack_layers)
    self.source_graphdef = nnx.graphdef(model)
    self.graphdef, self.params = nnx.split(self._placed(model))
    self._owned = _own_arrays(self.params, model)
    # What set_weights checks new weights against and places them with (kept when the weights are released).
    self._param_shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(self.params)]
    self._param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
    self.version = int(version)
    self._dp = models.cache_axes(self.cfg, mesh, self.rules).shards
    self._programs = sampler_programs(self.graphdef, nnx.merge(self.graphdef, self.params).cfg, mesh, self.rules,
                               self.cache_dtype, decode_impl)

  # ------------------------------------------------------------------------------------------------
  # Public API

  @property
  def compile_counts(self) -> collections.Counter[str]:
    """Traces (= compilations) per jitted program: ``prefill``, ``decode``, ``recompute``, ``fork``
    (with ``paged``, plus the engine programs its calls used: ``install``, ``copy``, ...).

    Programs are shared by samplers of the same model structure, mesh and options, so a second such
    sampler starts from the first one's compiled buckets.
    """
    if not self._engine_programs:
      return self._programs.counts
    total = collections.Counter(self._programs.counts)
    for programs in self._engine_programs.values():
      total.update(programs.counts)
    return total

  @property
  def copied_bytes(self) -> int:
    """Bytes of the weight arrays the sampler made itself (cast, placed or unstacked copies of the model it
    was given) and holds now; 0 when it reads the caller's arrays in place (or holds no weights)."""
    return sum(x.nbytes for x in self._owned if not x.is_deleted())

  @property
  def compile_count(self) -> int:
    """Total traces of all programs (see :attr:`compile_counts`)."""
    return sum(self.compile_counts.values())

  def set_weights(self, model, *, version: int | None = None) -> None:
    """Uses ``model``'s parameters from now on (same architecture); ``version`` defaults to +1.

    The sampler's previous copy is dropped before the new one is made (placed, cast or unstacked), so
    the two never coexist: on CPU, where the sampler holds an unstacked copy of the block weights, that
    copy is the size of the model's layers."""
    if nnx.graphdef(model) != self.source_graphdef:
      raise ValueError("set_weights: the new model's structure differs from the sampler's model")
    self._release(keep={id(x) for x in jax.tree.leaves(nnx.state(model))})  # not the arrays it is given
    params = nnx.state(self._placed(model))
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
    if shapes(params) != self._param_shapes:
      raise ValueError("set_weights: the new model's parameter shapes or dtypes differ from the sampler's")
    # Same placement as the first weights, so the compiled programs are reused.
    self.params = jax.device_put(params, self._param_shardings)
    self._owned = _own_arrays(self.params, model)
    self.version = self.version + 1 if version is None else int(version)

  def release_weights(self) -> None:
    """Drops the sampler's reference to its weights until the next :meth:`set_weights` (which every
    later :meth:`generate` or :meth:`resume` then needs). A trainer calls it before its update: the
    sampler's copy (unstacked on CPU, cast when the master weights are wider) is stale from then on,
    and freeing it leaves that memory to the train step's gradients and temporaries.

    The arrays the sampler made itself (cast or unstacked copies, not the caller's) are deleted here, not
    left to the garbage collector: the intermediate modules they were built through can sit in reference
    cycles and would keep them alive into the update."""
    if self._release(keep=set()):  # on CPU the copy was malloc'd block by block: give its pages back to the OS
      _host_memory.trim()

  def _release(self, *, keep: set[int]) -> bool:
    """Deletes the arrays the sampler made (not those in ``keep``); True if it deleted any. No trim here:
    :meth:`set_weights` allocates the new copy straight after, into the pages just freed."""
    freed = False
    for x in self._owned:
      if id(x) not in keep and not x.is_deleted():
        x.delete()
        freed = True
    self._owned = []
    self.params = None
    return freed

  def _weights(self):
    if self.params is None:
      raise RuntimeError("Sampler: its weights were released (release_weights); call set_weights first")
    return self.params

  def generate(self, prompts, *, n: int = 1, max_new_tokens: int = 64, temperature=1.0, top_p=1.0, top_k=0,
               min_p=0.0, seed: int = 0, request_ids: Sequence[int] | None = None,
               stop_token_ids: Sequence[int | str] = (), stop_strings: Sequence[str] = (),
               return_top_logprobs: int = 0, return_entropy: bool = False, max_steps: int | None = None,
               return_state: bool = False, thoughts=0, eot: int | str | None = None, images=None) -> SampleOutput:
    """Samples ``n`` completions per prompt: one jitted prefill, then one jitted decode loop.

    Log-prob contract (both ``[N, max_new]`` float32, 0 after the end):
      * ``logprobs[i, t] = log_softmax(logits_t / T)[token_t]`` of the full, *untruncated*
        distribution — exactly what a trainer recomputes from a forward pass over prompt + completion
        (with ``T = 1`` for greedy rows, ``T = 0``).
      * ``sampling_logprobs[i, t]`` = the log-prob under the truncated (top-k, top-p, min-p),
        renormalised distribution actually sampled from (0 for greedy rows).

    Args:
      prompts: strings or token-id lists (a single string or a flat list of ids is one prompt), or
        :func:`jaxrl.data.encode_vl_prompt` dicts (``tokens``, ``pixel_values``, ``grid_thw``) for a VLM.
      n: samples per prompt; they share one prefill. Output rows are ``prompt·n + sample``.
      max_new_tokens: most tokens per completion (fewer if ``prompt + max_new_tokens > max_len``).
      temperature: ``>= 0`` (0 = greedy); a scalar or one value per prompt. Likewise ``top_p``
        (``(0, 1]``), ``top_k`` (``>= 0``, 0 = off) and ``min_p`` (``[0, 1]``, 0 = off).
      seed: base of the per-row PRNG keys ``fold_in(fold_in(key(seed), request_id), sample)``.
      request_ids: one int per prompt (default ``0..len(prompts)-1``); with the seed it fixes a row's
        draws, whatever else is in the batch.
      stop_token_ids: extra ids (or single-token strings) that end a completion with ``"stop"``.
      stop_strings: strings that end a completion with ``"stop"``: matched on device against their
        tokenisation, and on the decoded text afterwards; the completion keeps the token that
        completes the string.
      return_top_logprobs: ``k > 0`` also returns the ``k`` most likely tokens per step.
      return_entropy: also return the per-token entropy of ``softmax(logits / T)``.
      max_steps: stop after this many tokens per row and return a resumable ``state``.
      return_state: return the state even when every row finished.
      thoughts: latent mode (Coconut, :mod:`jaxrl.latent`): continuous thoughts each prompt takes
        before its tokens, a scalar or one per prompt (``c·k`` at stage ``k``). Prompts end with
        ``<bot>`` (:func:`jaxrl.latent.prompt_ids`); the last hidden state is fed back as the next
        input embedding ``thoughts`` times, then ``eot`` is fed and tokens are sampled. At
        temperature 0 the tokens are :func:`jaxrl.sampling.latent_sample`'s. A row's cache then holds
        prompt, thoughts, ``<eot>``, completion, and ``prompt_lengths`` counts the thoughts and
        ``<eot>``. Needs ``eot``; a fixed count only (the ``<eot>`` classifier head and models
        trained without markers: :func:`jaxrl.sampling.latent_sample`). Runs on the whole-batch path
        (also with ``paged``); :meth:`resume` with new weights is refused (it would need the thoughts
        recomputed), :meth:`fork` and :meth:`resume` without new weights work.
      eot: the ``<eot>`` id (or token string) fed after the thoughts; given, latent mode is on (also
        with 0 thoughts: ``<bot><eot>``).
      images: a VLM's images, one entry per prompt: None or ``{"pixel_values" [P, patch_dim], "grid_thw"
        [I, 3]}`` (:class:`jaxrl.sampling.PromptImages`), matching the prompt's image placeholders. The
        tower runs once per prompt (its ``n`` samples share it); tokens rotate by M-RoPE positions
        (:func:`jaxrl.models.mrope_positions`), generated ones by ``position + delta``.

    Returns:
      A :class:`SampleOutput`.
    """
    prompts, images = _vision.split_prompts(prompts, images)
    ids = encode_prompts(self.tokenizer, prompts, vocab_size=self.cfg.vocab_size, max_len=self.max_len,
                         add_special_tokens=self.add_special_tokens)
    images = _vision.check_images(self.cfg, ids, images)
    procs = jax.process_count() if self.mesh is not None else 1
    if any(x is not None for x in images) and (procs > 1 or eot is not None):
      raise ValueError("images: prompts with images are not supported in latent mode (eot=) or across several "
                       "processes (generate on each process's own mesh)")
    self._check_counts(n=n, max_new_tokens=max_new_tokens, max_steps=max_steps,
                       return_top_logprobs=return_top_logprobs)
    args = prompt_args(len(ids), procs, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       request_ids=request_ids)
    stops, stop_strings = build_stops(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids, stop_token_ids,
                                      stop_strings)
    args = args._replace(thoughts=per_prompt("thoughts", thoughts, len(ids), np.int32,
                                             lambda x: x >= 0 and x == int(x)))
    latent = eot is not None
    ids = self._latent_prompts(ids, args.thoughts, eot)
    if self.paged and not latent and max_steps is None and not return_state and self.decode_impl == "kernel":
      return self._generate_paged(ids, procs=procs, n=n, max_new_tokens=max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=seed,
                                  request_ids=args.request_ids, stop_token_ids=stop_token_ids,
                                  stop_strings=stop_strings, return_top_logprobs=return_top_logprobs,
                                  return_entropy=return_entropy, images=images)
    return self._generate_dense(ids, args, procs=procs, n=n, max_new_tokens=max_new_tokens, seed=seed, stops=stops,
                                stop_strings=stop_strings, k_top=return_top_logprobs, want_entropy=return_entropy,
                                max_steps=max_steps, return_state=return_state, latent=latent, images=images)

  # ------------------------------------------------------------------------------------------------
  # generate's steps

  def _check_counts(self, *, n, max_new_tokens, max_steps, return_top_logprobs) -> None:
    """Refuses a bad ``n``, ``max_new_tokens``, ``max_steps`` or ``return_top_logprobs``."""
    check_counts(n=n, max_new_tokens=max_new_tokens)
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps <= 0):
      raise ValueError(f"max_steps: must be a positive int or None, got {max_steps!r}")
    if not isinstance(return_top_logprobs, int) or not 0 <= return_top_logprobs <= self.cfg.vocab_size:
      raise ValueError(f"return_top_logprobs: must be an int in [0, {self.cfg.vocab_size}], got "
                       f"{return_top_logprobs!r}")

  def _latent_prompts(self, ids: list[list[int]], n_thoughts: np.ndarray, eot) -> list[list[int]]:
    """``ids`` unchanged without ``eot``; in latent mode each prompt (ending with ``<bot>``) followed by a
    placeholder slot per thought and ``<eot>`` (left pending), refused when it leaves no room."""
    if n_thoughts.any() and eot is None:
      raise ValueError("thoughts: latent mode needs the <eot> id (eot=...); for a model trained without "
                       "markers use jaxrl.sampling.latent_sample")
    if eot is None:
      return ids
    eot = check_token(self.tokenizer, self.cfg.vocab_size, eot, "eot")
    ids = [x + [self.pad_token_id] * int(k) + [eot] for x, k in zip(ids, n_thoughts)]
    for i, x in enumerate(ids):
      if len(x) >= self.max_len:
        raise ValueError(f"prompts[{i}] with {n_thoughts[i]} thoughts and <eot> takes {len(x)} slots, but "
                         f"max_len={self.max_len} leaves no room for a completion; raise max_len")
    return ids

  def _generate_dense(self, ids: list[list[int]], args: PromptArgs, *, procs: int, n: int, max_new_tokens: int,
                      seed: int, stops: Stops, stop_strings, k_top: int, want_entropy: bool, max_steps: int | None,
                      return_state: bool, latent: bool, images: list) -> SampleOutput:
    """:meth:`generate` on the whole-batch cache: one prefill of every prompt, then one decode loop over
    all rows (at most ``max_steps`` tokens each)."""
    local_count = len(ids)
    if procs > 1:  # each process passed its own prompts: generate all of them together, return this process's rows
      ids, gathered = gather_prompts(ids, tuple(args))
      args = PromptArgs(*gathered)
    count = len(ids)
    lens = np.array([len(x) for x in ids], np.int32)
    row_max_new = np.minimum(max_new_tokens, self.max_len - lens)  # [count] completions cut at max_len
    g_bucket = length_bucket(int(row_max_new.max()), minimum=self.min_bucket)
    inputs, latent_kw = self._prefill_inputs(ids, args, n=n, row_max_new=row_max_new, latent=latent)
    self._vision_inputs(ids, images, inputs, n=n)
    budget = jnp.int32(g_bucket if max_steps is None else max_steps)
    rows = self._programs.prefill(self._weights(), jnp.uint32(seed % 2**32), **inputs, gen_len=g_bucket, k_top=k_top,
                                  want_entropy=want_entropy, **latent_kw)
    vision = None if inputs.get("images") is None else (inputs["prompt"], inputs["images"])
    rows = self._programs.decode(self._weights(), rows, stops, budget, jnp.int32(self.version))
    state = SamplerState(rows=rows, stops=stops, num_rows=count * n, max_new_tokens=max_new_tokens,
                         prompt_index=np.repeat(np.arange(count, dtype=np.int32), n), stop_strings=stop_strings,
                         latent=latent, vision=vision)
    out = self._finish(state, return_state=return_state)
    if procs > 1:
      out = process_rows(out, jax.process_index() * local_count, local_count, n)
    return out

  def _prefill_inputs(self, ids: list[list[int]], args: PromptArgs, *, n: int, row_max_new: np.ndarray,
                      latent: bool) -> tuple[dict, dict]:
    """The prefill program's inputs, placed: prompts right-padded to their length bucket, on ``U`` rows
    (a row bucket), and per sample row (``R = U·n``, a row bucket) its prompt, key parts and knobs; with
    the latent-mode keywords (thoughts per prompt, their static most)."""
    count = len(ids)
    lens = np.array([len(x) for x in ids], np.int32)
    n_thoughts = args.thoughts
    # Latent mode: a row with fewer thoughts than the longest still runs the whole thought loop, writing
    # invisible slots up to (its tokens) + max thoughts; without thoughts this is lens.max().
    p_bucket = length_bucket(int((lens - n_thoughts).max() + n_thoughts.max()), minimum=self.min_bucket)
    u_rows = self._row_bucket(count)
    r_rows = self._row_bucket(count * n)
    prompt_arr = np.zeros((u_rows, p_bucket), np.int32)  # [U, P]
    for i, x in enumerate(ids):
      prompt_arr[i, :len(x)] = x
    prompt_len = np.ones((u_rows,), np.int32)
    prompt_len[:count] = lens
    rows = np.arange(r_rows)
    real = rows < count * n
    src = np.where(real, rows // n, 0).astype(np.int32)  # [R] prompt of each sample row

    def per_row(a, fill):
      return np.where(real, a[src], fill).astype(a.dtype)

    max_new = per_row(row_max_new, 1).astype(np.int32)
    inputs = dict(
        prompt=prompt_arr, prompt_len=prompt_len, src=src, active=real,
        request=per_row(args.request_ids.astype(np.int32), 0), sample=np.where(real, rows % n, 0).astype(np.int32),
        temperature=per_row(args.temperature, 0.0), top_k=per_row(args.top_k, 0), top_p=per_row(args.top_p, 1.0),
        min_p=per_row(args.min_p, 0.0), max_new=max_new)
    inputs = {k: self._put_rows(v) if k not in ("prompt", "prompt_len") else jax.device_put(v)
              for k, v in inputs.items()}
    latent_kw = {}
    if latent:
      n_arr = np.zeros((u_rows,), np.int32)
      n_arr[:count] = n_thoughts
      latent_kw = dict(n_thoughts=jax.device_put(n_arr), max_thoughts=int(n_thoughts.max()))
    return inputs, latent_kw

  def _vision_inputs(self, ids: list[list[int]], images: list, inputs: dict, *, n: int) -> None:
    """A VLM's prefill inputs, added to ``inputs``: the prompts' rotary positions ``rope [U, P, 3]``, each
    sample row's ``rope_delta [R]``, and the prompts' images (``U`` rows, None without any)."""
    if not _vision.is_vlm(self.cfg):
      return
    u_rows, p_bucket = inputs["prompt"].shape
    r_rows = inputs["src"].shape[0]
    rope = np.broadcast_to(np.arange(p_bucket, dtype=np.int32)[None, :, None], (u_rows, p_bucket, 3)).copy()
    delta = np.zeros((u_rows,), np.int32)
    for i, (x, imgs) in enumerate(zip(ids, images)):
      rope[i, :len(x)], delta[i] = _vision.prompt_rope(self.cfg, x, imgs, where=f"prompts[{i}]")
    rows = np.arange(r_rows)
    row_delta = np.where(rows < len(ids) * n, delta[np.minimum(rows // n, u_rows - 1)], 0).astype(np.int32)
    inputs.update(rope=jax.device_put(rope), rope_delta=self._put_rows(row_delta))
    if any(x is not None for x in images):
      padded = list(images) + [None] * (u_rows - len(images))
      inputs["images"] = jax.device_put(_vision.vision_rows(self.cfg, padded, u_rows))

  def _generate_paged(self, ids: list[list[int]], *, procs: int, n: int, max_new_tokens: int, **kw) -> SampleOutput:
    """:meth:`generate` on a rollout engine sized to this call: a slot per row (the row bucket of the
    whole-batch path), blocks for every row at once (no preemption), the whole completion bucket in one
    decode call; the pool lives for the call only, the engine's compiled programs are shared."""
    total, longest = len(ids), max(len(x) for x in ids)
    if procs > 1:  # the engine is built alike on every process: the global count and longest prompt
      total, longest = len(ids) * procs, int(allgather_scalar(longest).max())
    rows = self._row_bucket(total * n)
    p_bucket = length_bucket(longest, minimum=self.min_bucket)
    g_bucket = length_bucket(max_new_tokens, minimum=self.min_bucket)
    max_len = min(self.max_len, p_bucket + g_bucket)
    block = min(16, next_pow2(max_len))
    engine = Engine(nnx.merge(self.graphdef, self._weights()), self.tokenizer, mesh=self.mesh, rules=self.rules,
                    num_slots=rows, max_len=max_len, block_size=block,
                    num_blocks=rows * (blocks_for(max_len, block) + 1), steps_per_call=g_bucket,
                    prefill_rows=min(next_pow2(total), 64), eos_token_ids=self.eos_token_ids,
                    pad_token_id=self.pad_token_id, cache_dtype=self.cache_dtype,
                    add_special_tokens=self.add_special_tokens, version=self.version, min_bucket=self.min_bucket,
                    max_top_logprobs=kw["return_top_logprobs"], entropy=kw["return_entropy"], placed=True)
    self._engine_programs[id(engine._programs)] = engine._programs
    return engine.generate(ids, n=n, max_new_tokens=max_new_tokens, **kw)

  def resume(self, state: SamplerState, new_model=None, *, version: int | None = None,
             max_steps: int | None = None, return_state: bool = False) -> SampleOutput:
    """Continues a paused generation; with ``new_model``, first recomputes its KV cache.

    With new weights (AReaL-style interruptible generation), the cache of every row is recomputed in
    one prefill over the prompt and all tokens generated so far, and the tokens generated from here
    on record ``version`` (default: the sampler's version + 1). Without, the state's cache is reused,
    so an interrupted and resumed run gives exactly the tokens of an uninterrupted one.

    Args:
      state: from :meth:`generate`, :meth:`fork` or an earlier :meth:`resume`; consumed (its cache is
        donated).
      new_model: a model of the same architecture with new weights (kept for later calls).
      version: policy version for the tokens generated from now on.
      max_steps: pause again after this many more tokens per row.
      return_state: return the state even when every row finished.

    Returns:
      A :class:`SampleOutput` over all tokens so far (not just the continuation).
    """
    self._check_state(state)
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps <= 0):
      raise ValueError(f"max_steps: must be a positive int or None, got {max_steps!r}")
    if new_model is not None and state.latent:
      raise ValueError("resume: a latent-mode state cannot take new weights (its continuous thoughts would "
                       "need recomputing with them); resume without new_model, or generate again")
    if new_model is not None:
      self.set_weights(new_model, version=version)
    elif version is not None:
      self.version = int(version)
    gen_len = state.rows.tokens.shape[1]
    budget = jnp.int32(gen_len if max_steps is None else max_steps)
    state.consumed = True
    rows = state.rows
    if new_model is not None:
      rows = self._programs.recompute(self._weights(), rows, state.vision)
    rows = self._programs.decode(self._weights(), rows, state.stops, budget, jnp.int32(self.version))
    new = dataclasses.replace(state, rows=rows, consumed=False)
    return self._finish(new, return_state=return_state)

  def fork(self, state: SamplerState, rows: Sequence[int], k: int) -> SamplerState:
    """``k`` independent continuations of each chosen row, sharing its prefix (ARPO-style branching).

    The chosen rows' KV cache, tokens, log-probs and versions are copied (no prefix recompute); child
    ``j`` of a row draws from ``fold_in(fold_in(row_key, tag), j)``. Continue with :meth:`resume`.

    Args:
      state: an unconsumed state; it stays valid.
      rows: indices of unfinished rows in ``state``.
      k: children per row.

    Returns:
      A new state with ``len(rows)·k`` rows, ordered ``row·k + child``.
    """
    self._check_state(state)
    rows = [int(r) for r in rows]
    if not rows:
      raise ValueError("fork: rows is empty")
    if not isinstance(k, int) or k < 1:
      raise ValueError(f"fork: k must be a positive int, got {k!r}")
    finished = state.finished
    for r in rows:
      if not 0 <= r < state.num_rows:
        raise ValueError(f"fork: row {r} is out of range [0, {state.num_rows})")
      if finished[r]:
        raise ValueError(f"fork: row {r} has already finished; only unfinished rows can branch")
    count = len(rows) * k
    r_rows = self._row_bucket(count)
    idx = np.arange(r_rows)
    real = idx < count
    src = np.where(real, np.asarray(rows)[np.minimum(idx // k, len(rows) - 1)], rows[0]).astype(np.int32)
    child = np.where(real, idx % k, 0).astype(np.int32)
    new_rows = self._programs.fork(state.rows, self._put_rows(src), self._put_rows(child), self._put_rows(real))
    return SamplerState(rows=new_rows, stops=state.stops, num_rows=count, max_new_tokens=state.max_new_tokens,
                        prompt_index=state.prompt_index[np.asarray(rows)].repeat(k),
                        stop_strings=state.stop_strings, latent=state.latent, vision=state.vision)

  # ------------------------------------------------------------------------------------------------
  # Input handling

  def _placed(self, model):
    """The model as the programs read it: compute-dtype weights (a copy cast on device when the master
    weights are stored wider), on the mesh with its placement, and unstacked when ``unstack_layers``."""
    model = models.cast_params(model, model.cfg.dtype)
    if self.unstack_layers:
      model = _layers.unstack_layers(model, mesh=self.mesh, rules=self.rules)
    return model if self.mesh is None else models.shard_model(model, self.mesh, self.rules)

  def _row_bucket(self, count: int) -> int:
    b = next_pow2(count)
    return -(-b // self._dp) * self._dp

  def _put_rows(self, x: np.ndarray) -> jax.Array:
    s = self._programs.row_sharding(np.ndim(x))
    return jax.device_put(x) if s is None else jax.device_put(x, s)

  def _check_state(self, state) -> None:
    if not isinstance(state, SamplerState):
      raise TypeError(f"expected a SamplerState, got {type(state).__name__}")
    if state.consumed:
      raise ValueError("this SamplerState was already resumed (its KV cache was donated); fork it before "
                       "resuming to keep a copy")

  # ------------------------------------------------------------------------------------------------
  # Host side

  def _finish(self, state: SamplerState, *, return_state: bool) -> SampleOutput:
    rows = state.rows
    fetch = dict(tokens=rows.tokens, logprobs=rows.logprobs, sampling_logprobs=rows.sampling_logprobs,
                 versions=rows.versions, n_gen=rows.n_gen, done=rows.done, reason=rows.reason,
                 prompt_len=rows.prompt_len, entropy=rows.entropy, top_ids=rows.top_ids,
                 top_values=rows.top_values)
    host = {k: None if v is None else np.array(v[:state.num_rows]) for k, v in to_host(fetch).items()}
    m = state.max_new_tokens
    lengths = host["n_gen"].astype(np.int32)
    reason = host["reason"].copy()
    done = host["done"].copy()
    if state.stop_strings and self.tokenizer is not None:
      for i in range(state.num_rows):
        cut = stop_string_end(self.tokenizer, host["tokens"][i, :lengths[i]], state.stop_strings)
        if cut is not None and (cut < lengths[i] or reason[i] != 2):
          lengths[i], reason[i], done[i] = cut, 2, True
      if not np.array_equal(lengths, host["n_gen"]) or not np.array_equal(done, host["done"]):
        upd = {}
        for name, head in (("n_gen", lengths), ("done", done), ("reason", reason.astype(np.int32))):
          old = getattr(rows, name)
          tail = to_host(old)[state.num_rows:]  # padding rows, unchanged
          upd[name] = jax.device_put(np.concatenate([head, tail]), old.sharding)
        state = dataclasses.replace(state, rows=rows._replace(**upd))
    valid = np.arange(host["tokens"].shape[1])[None, :] < lengths[:, None]  # [N, G]

    def clip(a, fill):
      if a is None:
        return None
      mask = valid.reshape(valid.shape + (1,) * (a.ndim - 2))
      a = np.where(mask, a, np.asarray(fill, a.dtype))[:, :m]
      if a.shape[1] < m:  # the bucket was cut by max_len: pad to max_new_tokens columns
        widths = [(0, 0), (0, m - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
        a = np.pad(a, widths, constant_values=fill)
      return a

    tokens = clip(host["tokens"], self.pad_token_id)
    texts = None
    if self.tokenizer is not None:
      texts = [self.tokenizer.decode(tokens[i, :lengths[i]].tolist(), skip_special_tokens=True)
               for i in range(state.num_rows)]
    top = None
    if host["top_ids"] is not None:
      top = TopLogprobs(ids=clip(host["top_ids"], self.pad_token_id), logprobs=clip(host["top_values"], 0.0))
    keep = return_state or not bool(done.all())
    return SampleOutput(
        tokens=tokens, logprobs=clip(host["logprobs"], 0.0), sampling_logprobs=clip(host["sampling_logprobs"], 0.0),
        lengths=lengths, finish_reason=[FINISH_REASONS[c] for c in reason], versions=clip(host["versions"], -1),
        prompt_lengths=host["prompt_len"].astype(np.int32), prompt_index=state.prompt_index.copy(), texts=texts,
        top_logprobs=top, entropy=clip(host["entropy"], 0.0), state=state if keep else None)
