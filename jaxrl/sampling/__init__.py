"""KV-cache sampler and rollout engine (continuous batching over a paged KV cache) for RL rollouts.

Example::

    from jaxrl import models, sampling
    sampler = sampling.Sampler(model, tokenizer, mesh=mesh, max_len=1024)
    out = sampler.generate(prompts, n=4, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    out.tokens, out.logprobs, out.lengths, out.finish_reason, out.texts

    part = sampler.generate(prompts, max_new_tokens=64, max_steps=16)    # pause after 16 tokens
    out = sampler.resume(part.state, new_model=model2, version=1)         # recompute KV, continue
    branches = sampler.fork(part.state, rows=[0], k=4)                    # 4 continuations of row 0

    out = sampling.latent_sample(model, prompts_ending_in_bot, thoughts=2, eot=eot_id, eos=eos_id, pad=0,
                                 max_new_tokens=16, temperature=1.0)      # Coconut: continuous thoughts first
    out = sampler.generate(prompts_ending_in_bot, n=4, thoughts=2, eot=eot_id)  # the same, in the Sampler

    vl = data.encode_vl_prompt(tokenizer, record)                        # a VLM: tokens, pixel_values, grid_thw
    out = sampler.generate([vl], n=4, max_new_tokens=64)                  # the tower runs once per prompt

Layer (docs/design.md): may import ``losses``, ``data``, ``models``, ``kernels``, ``sharding``, ``config``;
nothing above.
"""

from jaxrl.models import cache_block_bytes, cache_shards
from jaxrl.sampling._decode import decode_step
from jaxrl.sampling._detok import IncrementalDetokenizer, TokenBytes
from jaxrl.sampling._engine import Engine
from jaxrl.sampling._engine_pool import budget_blocks, check_pool
from jaxrl.sampling._engine_programs import context_bucket, engine_programs, paged_impl_for, prefill_batch_rows
from jaxrl.sampling._engine_rows import Completion, EngineMetrics
from jaxrl.sampling._latent import LatentSample, Thought, decode_tokens, eot_logits, latent_sample, left_pad, think
from jaxrl.sampling._layers import unstack_layers
from jaxrl.sampling._logits import Sampled, entropy, sample_logits, top_logprobs, truncation_mask
from jaxrl.sampling._paged import blocks_for
from jaxrl.sampling._requests import FINISH_REASONS, Request, Stops, length_bucket
from jaxrl.sampling._rows import SampleOutput, SamplerState, TopLogprobs
from jaxrl.sampling._sampler import Sampler
from jaxrl.sampling._sampler_programs import sampler_programs
from jaxrl.sampling._vision import PromptImages

__all__ = [
    "Completion",
    "Engine",
    "EngineMetrics",
    "FINISH_REASONS",
    "IncrementalDetokenizer",
    "LatentSample",
    "PromptImages",
    "Request",
    "SampleOutput",
    "Sampled",
    "Sampler",
    "SamplerState",
    "Stops",
    "TokenBytes",
    "TopLogprobs",
    "blocks_for",
    "budget_blocks",
    "cache_block_bytes",
    "cache_shards",
    "check_pool",
    "context_bucket",
    "decode_step",
    "engine_programs",
    "entropy",
    "latent_sample",
    "length_bucket",
    "paged_impl_for",
    "prefill_batch_rows",
    "sample_logits",
    "sampler_programs",
    "top_logprobs",
    "truncation_mask",
    "unstack_layers",
    "Thought",
    "decode_tokens",
    "eot_logits",
    "left_pad",
    "think",
]
