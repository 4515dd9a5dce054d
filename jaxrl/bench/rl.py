"""``jaxrl bench rl``: one GRPO step of jaxrl's ``RLTrainer`` against TRL's ``GRPOTrainer`` and Tunix's
``GRPOLearner``, side by side.

The workload (issue 20): one tiny Qwen2 HF directory (vocab 4096, d 128, 4 layers, float32) and one
word-level tokenizer, written once and loaded by every framework; 8 prompts × 8 samples, 32 prompt
tokens + exactly 64 new tokens (the tokenizer's EOS is never emitted: jaxrl's sampler is given no
EOS id, TRL gets ``min_new_tokens``, Tunix's sampler the EOS list ``[-1]``), temperature 1, one
PPO-clip update over the whole batch, token-mean loss, no KL, AdamW. The reward is a cheap text
function, the same in every framework.

Each framework runs in its own process (peers in their own virtualenvs, see ``--setup``) and
speaks a small JSON-lines protocol on stdin/stdout: ``{"cmd": "setup", ...}`` → ``{"ok": true}``,
``{"cmd": "step"}`` → ``{"step_s", "generate_s", "train_s", "tokens"}``, ``{"cmd": "quit"}``.
Steps are interleaved (one step of each framework in turn) so background load hits all alike.
Reported per framework: the first step (compilation included), the median steady-state step,
generate and train time, and generated tokens/s; for jaxrl also the cost of one sampling call on
``[64, 4096]`` logits and of a whole decode step, greedy against temperature 1 without filters.

Prints a table and writes JSON. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 8, 8, 32, 64
TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32)
LR = 1e-5
PEERS = {
    # name: (worker file next to this module, pinned requirements of its virtualenv)
    "trl": ("_rl_trl.py", ["torch==2.13.0", "trl==1.16.0", "transformers==5.24.0", "accelerate==1.16.0",
                           "datasets==5.2.0"]),
    # The Tunix pins are the versions its 0.1.7 resolves to next to jaxrl's own jax/flax.
    "tunix": ("_rl_tunix.py", ["google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
                               "optax==0.2.8", "qwix==0.1.8", "transformers==5.12.1", "safetensors==0.7.0",
                               "numpy==2.4.6"]),
}
VENV_ROOT_ENV = "JAXRL_BENCH_VENVS"


def venv_root() -> Path:
  """Where peer virtualenvs live: ``$JAXRL_BENCH_VENVS`` or ``~/.cache/jaxrl/bench`` (never the repo)."""
  return Path(os.environ.get(VENV_ROOT_ENV) or Path.home() / ".cache" / "jaxrl" / "bench")


def peer_python(name: str) -> Path:
  return venv_root() / name / "bin" / "python"


def setup_peer(name: str) -> None:
  """Creates ``<venv_root>/<name>`` with the peer's pinned requirements (needs PyPI)."""
  root = venv_root() / name
  if not root.exists():
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
  pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q"]
  reqs = PEERS[name][1]
  torch = [r for r in reqs if r.startswith("torch==")]
  if torch:
    subprocess.run(pip + torch, check=True)  # the CPU build first
  subprocess.run(pip + reqs, check=True)


# --------------------------------------------------------------------------------------------------
# The shared workload


def bench_reward(prompt: str, completion: str, **_: Any) -> float:
  """Fraction of completion words whose id is even (``w12`` → 12): cheap, text-only, varies per sample."""
  del prompt
  words = completion.split()
  return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)


def write_tokenizer(out_dir: Path, vocab: int) -> None:
  """A word-level tokenizer ``<pad>``, ``<eos>``, ``w2`` … ``w{vocab-1}`` (whitespace split, no added
  tokens) whose chat template is the message content verbatim, so a prompt's ids are the same whether
  a framework applies the template (jaxrl) or not (TRL, for a plain-text prompt)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
  tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
  fast.save_pretrained(out_dir)


def write_workload(root: Path, *, model: dict[str, int] | None = None, seed: int = 0) -> dict[str, str]:
  """The shared HF model directory, tokenizer directory and prompts file; returns their paths. (The
  tokenizer has its own directory: next to a ``qwen2`` config.json, ``AutoTokenizer`` would take it
  for a Qwen2 BPE tokenizer.)"""
  from jaxrl import models
  cfg = models.ModelConfig.qwen2p5_0p5b(**{**TINY, **(model or {})}, dtype="float32", param_dtype="float32")
  hf_dir = root / "model"
  models.save_pretrained(models.init_model(cfg, seed=seed), hf_dir)
  write_tokenizer(root / "tokenizer", cfg.vocab_size)
  import numpy as np
  rng = np.random.default_rng(seed)
  prompts = root / "prompts.jsonl"
  with prompts.open("w") as f:
    for _ in range(PROMPTS):
      ids = rng.integers(2, cfg.vocab_size, size=PROMPT_TOKENS)
      f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in ids)}) + "\n")
  return {"hf_dir": str(hf_dir), "tokenizer": str(root / "tokenizer"), "prompts": str(prompts)}


# --------------------------------------------------------------------------------------------------
# jaxrl worker


class JaxrlWorker:
  """One GRPO step of :class:`jaxrl.rl.RLTrainer` per ``step`` command."""

  def setup(self, **spec: Any) -> dict[str, Any]:
    from jaxrl import config as config_lib
    from jaxrl import rl, sampling
    data = {
        "model": {"hf_dir": spec["hf_dir"]}, "tokenizer": spec["tokenizer"],
        "data": {"train": [spec["prompts"]], "builtin": None, "max_prompt_tokens": PROMPT_TOKENS},
        "rollout": {"prompts_per_step": PROMPTS, "n": SAMPLES, "max_new_tokens": NEW_TOKENS, "temperature": 1.0},
        "reward": {"fn": "jaxrl.bench.rl:bench_reward", "runner": {"workers": 1}},
        "algorithm": {"advantage": "grpo", "objective": "ppo_clip", "aggregation": "token_mean",
                      "old_logprobs": "sampler", "kl_coef": 0.0, "mini_batches": 1, "ppo_epochs": 1},
        "micro_batch": {"token_budget": PROMPTS * SAMPLES * (PROMPT_TOKENS + NEW_TOKENS),
                        "row_len": PROMPT_TOKENS + NEW_TOKENS},
        "optim": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "clip_norm": 1.0},
        "steps": spec["steps"], "eval": {"every": 0}, "out_dir": spec["out_dir"], "tensorboard": False,
    }
    self.cfg = config_lib.from_dict(rl.RLConfig, data)
    self.trainer = rl.RLTrainer(self.cfg)
    t = self.trainer
    # Exactly NEW_TOKENS per sample, as in the peers: this sampler stops at no token.
    t.sampler = sampling.Sampler(t.current_model(), t.tokenizer, mesh=t.mesh, rules=t.rules,
                                 max_len=PROMPT_TOKENS + NEW_TOKENS, eos_token_ids=[], version=0)
    self.step_index = 0
    return {"ok": True, "versions": _versions("jax", "jaxlib", "flax", "optax")}

  def step(self) -> dict[str, Any]:
    self.step_index += 1
    t0 = time.perf_counter()
    rollout, metrics = self.trainer.collect(self.step_index)
    t1 = time.perf_counter()
    self.trainer.update(rollout, self.step_index)
    t2 = time.perf_counter()
    return {"step_s": t2 - t0, "generate_s": t1 - t0, "train_s": t2 - t1, "tokens": int(rollout.lengths.sum()),
            "reward": float(metrics["reward/mean"])}

  def sampling(self) -> dict[str, Any]:
    """Sampling cost, greedy vs temperature 1 (no filters): one call on [64, 4096] logits, and a decode step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.sampling import sample_logits
    rows, vocab = PROMPTS * SAMPLES, TINY["vocab_size"]
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), rows)
    fn = jax.jit(lambda x, k, t: sample_logits(x, k, temperature=t, top_k=jnp.zeros(rows, jnp.int32),
                                              top_p=jnp.ones(rows), min_p=jnp.zeros(rows)))
    out = {}
    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
      t = jnp.full((rows,), temp)
      jax.block_until_ready(fn(logits, keys, t))
      out[f"sample_call_ms_{name}"] = 1e3 * _median_time(lambda: jax.block_until_ready(fn(logits, keys, t)), 30)
    prompts = [p.tolist() for p in self.trainer.train_prompts.ids[:PROMPTS]]
    sampler = self.trainer.sampler
    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
      gen = lambda n_new: sampler.generate(prompts, n=SAMPLES, max_new_tokens=n_new, temperature=temp, seed=1)
      gen(1), gen(NEW_TOKENS)  # compile both lengths' buckets
      t_full = _median_time(lambda: gen(NEW_TOKENS), 3)
      t_one = _median_time(lambda: gen(1), 3)
      out[f"decode_step_ms_{name}"] = 1e3 * (t_full - t_one) / (NEW_TOKENS - 1)
    return out


def _median_time(fn, n: int) -> float:
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _versions(*names: str) -> dict[str, str]:
  from importlib import metadata
  return {n: metadata.version(n) for n in names}


def serve(worker) -> int:
  """The worker side of the protocol: JSON commands on stdin, one JSON answer per line on the real
  stdout (everything the libraries print goes to stderr)."""
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  for line in sys.stdin:
    msg = json.loads(line)
    cmd = msg.pop("cmd")
    if cmd == "quit":
      break
    try:
      t0 = time.perf_counter()
      ans = getattr(worker, cmd)(**msg) if msg else getattr(worker, cmd)()
      ans["wall_s"] = time.perf_counter() - t0
    except Exception as e:  # reported to the parent, which names the framework
      ans = {"error": f"{type(e).__name__}: {e}"}
    proto.write(json.dumps(ans) + "\n")
  return 0


# --------------------------------------------------------------------------------------------------
# Parent


class Peer:
  """A worker subprocess."""

  def __init__(self, name: str, argv: list[str]):
    self.name = name
    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
                                 if os.environ.get("JAXRL_BENCH_QUIET", "1") == "1" else None, text=True)

  def ask(self, cmd: str, **kw) -> dict[str, Any]:
    self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"bench rl: the {self.name} worker exited (rerun with JAXRL_BENCH_QUIET=0 to see why)")
    ans = json.loads(line)
    if "error" in ans:
      raise RuntimeError(f"bench rl: {self.name} {cmd}: {ans['error']}")
    return ans

  def close(self) -> None:
    try:
      self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
      self.proc.stdin.close()
      self.proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      self.proc.kill()


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
  first, rest = steps[0], steps[1:] or steps[:1]
  med = lambda k: statistics.median(s[k] for s in rest)
  return {"first_step_s": first["step_s"], "step_s": med("step_s"), "generate_s": med("generate_s"),
          "train_s": med("train_s"), "gen_tok_s": statistics.median(s["tokens"] / s["generate_s"] for s in rest),
          "step_tok_s": statistics.median(s["tokens"] / s["step_s"] for s in rest), "steps": len(steps)}


def run(work: Path, *, steps: int, peers: list[str], sampling: bool = True, model: dict[str, int] | None = None,
        log=print) -> dict[str, Any]:
  """Writes the workload under ``work`` (``model`` overrides :data:`TINY`), runs ``steps`` interleaved
  steps of jaxrl and each peer; returns the raw steps and their summary per framework."""
  work.mkdir(parents=True, exist_ok=True)
  spec = write_workload(work, model=model)
  workers = {"jaxrl": Peer("jaxrl", [sys.executable, "-m", "jaxrl.bench.rl", "--worker"])}
  here = Path(__file__).parent
  for name in peers:
    py = peer_python(name)
    if not py.exists():
      log(f"{name}: no virtualenv at {py.parent.parent} (create it with `jaxrl bench rl --setup {name}`); skipped")
      continue
    workers[name] = Peer(name, [str(py), str(here / PEERS[name][0])])
  results: dict[str, Any] = {"frameworks": {}}
  try:
    for name, w in workers.items():
      ans = w.ask("setup", **spec, steps=steps,
                  out_dir=str(work / f"out_{name}"), lr=LR)
      results["frameworks"][name] = {"versions": ans.get("versions", {}), "setup_s": ans["wall_s"], "steps_raw": []}
    for i in range(steps):
      for name, w in workers.items():
        s = w.ask("step")
        results["frameworks"][name]["steps_raw"].append(s)
        log(f"step {i + 1} {name}: {s['step_s']:.3f} s (generate {s['generate_s']:.3f}, train {s['train_s']:.3f})")
    if sampling:
      results["sampling"] = workers["jaxrl"].ask("sampling")
  finally:
    for w in workers.values():
      w.close()
  for name, r in results["frameworks"].items():
    r.update(_summary(r["steps_raw"]))
  return results


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench rl", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=6, help="steps per framework; the first is reported apart")
  p.add_argument("--peers", nargs="*", default=sorted(PEERS), choices=sorted(PEERS))
  p.add_argument("--setup", nargs="*", choices=sorted(PEERS), default=None,
                 help=f"create these peers' virtualenvs under ${VENV_ROOT_ENV} (default ~/.cache/jaxrl/bench) and exit")
  p.add_argument("--work-dir", default="runs/bench_rl", help="model, prompts and trainer outputs")
  p.add_argument("--json", default="runs/bench_rl.json")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ns = p.parse_args(argv)
  if ns.worker:
    return serve(JaxrlWorker())
  if ns.setup is not None:
    for name in ns.setup or sorted(PEERS):
      setup_peer(name)
      print(f"{name}: {peer_python(name)}")
    return 0
  if ns.steps < 2:
    p.error("--steps must be >= 2 (the first step is compilation)")
  results = run(Path(ns.work_dir), steps=ns.steps, peers=ns.peers)
  results.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 machine=f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
                 command="jaxrl bench rl " + " ".join(argv),
                 workload=dict(prompts=PROMPTS, samples=SAMPLES, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS,
                               model=TINY, lr=LR))
  print(format_table(results))
  Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
  Path(ns.json).write_text(json.dumps(results, indent=2))
  print(f"wrote {ns.json}")
  return 0


def format_table(results: dict[str, Any]) -> str:
  """Markdown table of the summary (what docs/benchmarks.md records)."""
  fw = results["frameworks"]
  lines = ["| framework | first step s | median step s | generate s | train s | generated tok/s | jaxrl speed-up |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  base = fw["jaxrl"]["step_s"]
  for name, r in fw.items():
    lines.append(f"| {name} | {r['first_step_s']:.2f} | {r['step_s']:.3f} | {r['generate_s']:.3f} | "
                 f"{r['train_s']:.3f} | {r['gen_tok_s']:,.0f} | {r['step_s'] / base:.2f}× |")
  s = results.get("sampling")
  if s:
    lines.append("")
    lines.append(f"sampling on [64, 4096] logits: greedy {s['sample_call_ms_greedy']:.2f} ms, temperature 1 "
                 f"{s['sample_call_ms_t1']:.2f} ms ({s['sample_call_ms_t1'] / s['sample_call_ms_greedy']:.2f}×); "
                 f"decode step: greedy {s['decode_step_ms_greedy']:.2f} ms, temperature 1 "
                 f"{s['decode_step_ms_t1']:.2f} ms ({s['decode_step_ms_t1'] / s['decode_step_ms_greedy']:.2f}×)")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
