"""HF transformers worker of ``jaxrl bench sample --long-tail``: the same prompts and per-row lengths
through Hugging Face's own continuous batching.

Runs inside the TRL peer virtualenv (``jaxrl bench rl --setup trl``: torch CPU + transformers) as a
plain script that imports no jaxrl module: ``python benchmarks/sample_hf.py SPEC.json``, where the spec holds
``hf_dir``, ``prompts`` (token id lists), ``lengths`` (new tokens per prompt), ``n`` (samples per
prompt), ``slots`` (rows per forward, as the jaxrl engine's) and ``threads``. Prints one JSON line: ``method``, ``seconds``, ``real_tokens``, ``tok_s``.

With ``generate_batch`` in the installed transformers (continuous batching, paged cache), every row
is its own request with its own ``max_new_tokens`` and no EOS, through the continuous-batching
manager that ``generate_batch`` drives (its ``add_requests`` takes one length for all). Without it,
``generate`` runs the whole batch to the longest length (left-padded), and only each row's own
tokens count. Sampling at temperature 1. One untimed pass first (warm-up), then one timed pass.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run(spec: dict) -> dict:
  import torch
  import transformers

  torch.set_num_threads(int(spec.get("threads") or os.cpu_count() or 1))
  torch.manual_seed(int(spec.get("seed", 0)))
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
  model.eval()
  prompts, lengths, n = spec["prompts"], [int(k) for k in spec["lengths"]], int(spec["n"])
  if len(prompts) != len(lengths):
    raise ValueError(f"spec: {len(prompts)} prompts but {len(lengths)} lengths")
  rows = [(p, k) for p, k in zip(prompts, lengths) for _ in range(n)]
  real = sum(k for _, k in rows)
  longest = max(lengths)
  method = "generate_batch" if hasattr(model, "generate_batch") else "generate"

  def continuous() -> int:
    cfg = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=longest,
                                        eos_token_id=-1, pad_token_id=0)
    # Sized explicitly: left to itself the manager takes 80-90 % of the free memory for its cache (on
    # a CPU that is the machine's RAM). Capacity: every row at once in 16-token pages; at most
    # `slots` rows per forward, as the jaxrl engine's decode slots.
    page = 16
    blocks = sum(-(-(len(p) + k) // page) + 1 for p, k in rows)
    cb = transformers.ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=512,
                                               max_requests_per_batch=int(spec.get("slots") or 16),
                                               use_cuda_graph=False, auto_switch_to_flash=False)
    got = 0
    with model.continuous_batching_context_manager(generation_config=cfg, continuous_batching_config=cb, block=True,
                                                   timeout=30) as manager:
      ids = [manager.add_request(list(p), max_new_tokens=k, eos_token_id=-1) for p, k in rows]
      done = set()
      while len(done) < len(ids):
        res = manager.get_result(timeout=1)
        if res is not None and res.is_finished():
          done.add(res.request_id)
          got += len(res.generated_tokens)
        elif res is None and not manager.is_running():
          raise RuntimeError("transformers continuous batching: the generation thread stopped")
    return got

  def whole_batch() -> int:
    width = max(len(p) for p, _ in rows)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p, _ in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in rows])
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=longest, min_new_tokens=longest, eos_token_id=None, pad_token_id=0)
    return sum(min(k, out.shape[1] - width) for _, k in rows)

  fn = continuous if method == "generate_batch" else whole_batch
  fn()  # warm-up
  t0 = time.perf_counter()
  got = fn()
  seconds = time.perf_counter() - t0
  if got != real:
    raise RuntimeError(f"{method}: counted {got} generated tokens, expected {real}")
  return {"method": method, "seconds": seconds, "real_tokens": real, "tok_s": real / seconds,
          "versions": {m: __import__(m).__version__ for m in ("torch", "transformers")}}


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print("usage: sample_hf.py SPEC.json", file=sys.stderr)
    return 2
  with open(argv[0]) as f:
    spec = json.load(f)
  print(json.dumps(run(spec)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
