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

``--workload 0.5b``: the larger workload, Qwen2.5-0.5B shapes (random weights, float32, 494M
parameters) written once to a shared HF directory (``<venv root>/models``, no download) and reused
by later runs; 2 prompts × 4 samples, 16 prompt + exactly 16 new tokens. Its frameworks run one
after the other, not interleaved (three 0.5B models with AdamW state would not fit in memory
together); each does ``--steps`` steps (default 2: the first with compilation, then one steady).

Prints a table and writes JSON. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from jaxrl import _cache
from jaxrl import config as config_lib
from jaxrl import models, rl, sampling
from jaxrl.bench._harness import BENCHMARKS, harness
from jaxrl.bench.rl_settings import RLBenchSettings, check_applied, pin_cpus, jaxrl_applied, jaxrl_config
from jaxrl.sampling import sample_logits


PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 8, 8, 32, 64
TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32)
LR = 1e-5


@dataclasses.dataclass(frozen=True)
class Workload:
  """One benchmark workload: batch shape, model shape and how its frameworks are scheduled."""

  prompts: int
  samples: int
  prompt_tokens: int
  new_tokens: int
  model: dict[str, int]  # ModelConfig.qwen2p5_0p5b overrides
  steps: int  # default --steps
  interleave: bool  # one step of each framework in turn (else one framework after the other)
  shared_model: bool  # the HF directory lives under <venv root>/models and is written once
  # jaxrl holds one weight array per block (ModelConfig.scan_layers: false), as the peers do (a Python loop over
  # their blocks): the same arithmetic. Against the scanned model on CPU (issue 34): the train step writes no
  # stacked residual or gradient buffers, and the sampler decodes from the trainer's arrays in place instead of an
  # unstacked copy of the block weights made every step (0.77-0.95 s at 0.5B). 0.5B, one process, 4 steady steps:
  # update 6.8-7.3 s against 8.3-9.8 s, set_weights 0.09-0.18 s against 0.89-0.95 s, peak RSS 8.67 against 8.75 GiB.
  per_layer_weights: bool = True

  def batch(self) -> dict[str, int]:
    """What every worker's ``setup`` receives."""
    return dict(n_prompts=self.prompts, samples=self.samples, prompt_tokens=self.prompt_tokens,
                new_tokens=self.new_tokens)


WORKLOADS = {
    "tiny": Workload(PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, TINY, steps=6, interleave=True, shared_model=False),
    "0.5b": Workload(2, 4, 16, 16, {}, steps=2, interleave=False, shared_model=True),
}
PEERS = {
    # name: (worker script in the repository's benchmarks/, pinned requirements of its virtualenv)
    "trl": (BENCHMARKS / "rl_trl.py", ["torch==2.13.0", "trl==1.16.0", "transformers==5.24.0", "accelerate==1.16.0",
                           "datasets==5.2.0"]),
    # The Tunix pins are the versions its 0.1.7 resolves to next to jaxrl's own jax/flax.
    "tunix": (BENCHMARKS / "rl_tunix.py", ["google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
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


MODEL_MARKER = ".jaxrl_bench_complete"


def shared_model_dir(cfg, seed: int) -> Path:
  """``<venv root>/models/<shape>-seed<seed>``: where a shared workload's random model is kept."""
  name = (f"qwen2-v{cfg.vocab_size}-d{cfg.hidden_size}-f{cfg.intermediate_size}-l{cfg.num_layers}-"
          f"h{cfg.num_heads}-kv{cfg.num_kv_heads}-{cfg.param_dtype}-seed{seed}")
  return venv_root() / "models" / name


def _write_model(cfg, hf_dir: Path, seed: int) -> None:
  """Writes the random model once: into a temporary sibling, renamed when complete (so a killed run
  never leaves a half-written directory that a later run would take as done)."""
  if (hf_dir / MODEL_MARKER).exists():
    return
  import shutil
  tmp = hf_dir.with_name(hf_dir.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.parent.mkdir(parents=True, exist_ok=True)
  models.save_pretrained(models.init_model(cfg, seed=seed), tmp)
  (tmp / MODEL_MARKER).write_text("written by jaxrl bench rl\n")
  shutil.rmtree(hf_dir, ignore_errors=True)
  tmp.rename(hf_dir)


def write_workload(root: Path, *, model: dict[str, int] | None = None, seed: int = 0,
                   workload: Workload | None = None) -> dict[str, str]:
  """The HF model directory, tokenizer directory and prompts file of ``workload`` (default tiny);
  returns their paths. ``model`` overrides the workload's model shape (the model is then written
  under ``root``, never shared). (The tokenizer has its own directory: next to a ``qwen2``
  config.json, ``AutoTokenizer`` would take it for a Qwen2 BPE tokenizer.)"""
  wl = workload or WORKLOADS["tiny"]
  cfg = models.ModelConfig.qwen2p5_0p5b(**{**wl.model, **(model or {})}, dtype="float32", param_dtype="float32")
  hf_dir = shared_model_dir(cfg, seed) if wl.shared_model and not model else root / "model"
  _write_model(cfg, hf_dir, seed)
  root.mkdir(parents=True, exist_ok=True)
  write_tokenizer(root / "tokenizer", cfg.vocab_size)
  import numpy as np
  rng = np.random.default_rng(seed)
  prompts = root / "prompts.jsonl"
  with prompts.open("w") as f:
    for _ in range(wl.prompts):
      ids = rng.integers(2, cfg.vocab_size, size=wl.prompt_tokens)
      f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in ids)}) + "\n")
  return {"hf_dir": str(hf_dir), "tokenizer": str(root / "tokenizer"), "prompts": str(prompts)}


# --------------------------------------------------------------------------------------------------
# jaxrl worker


class JaxrlWorker:
  """One GRPO step of :class:`jaxrl.rl.RLTrainer` per ``step`` command."""

  def setup(self, *, n_prompts: int = PROMPTS, samples: int = SAMPLES, prompt_tokens: int = PROMPT_TOKENS,
            new_tokens: int = NEW_TOKENS, settings: dict[str, Any] | None = None, per_layer_weights: bool = False,
            **spec: Any) -> dict[str, Any]:
    settings = settings or RLBenchSettings().to_message()
    pin_cpus(settings["threads"])  # before the first JAX computation: XLA sizes its thread pool from it
    mapped = jaxrl_config(settings, n_prompts=n_prompts, samples=samples, prompt_tokens=prompt_tokens,
                          new_tokens=new_tokens)
    overrides = dict(mapped["model_overrides"], **({"scan_layers": False} if per_layer_weights else {}))
    data = {
        "model": {"hf_dir": spec["hf_dir"], "overrides": overrides}, "tokenizer": spec["tokenizer"],
        "data": {"train": [spec["prompts"]], "builtin": None, "max_prompt_tokens": prompt_tokens},
        "rollout": {"prompts_per_step": n_prompts, "n": samples, "max_new_tokens": new_tokens, "temperature": 1.0},
        "reward": {"fn": "jaxrl.bench.rl:bench_reward", "runner": {"workers": 1}},
        "algorithm": mapped["algorithm"], "micro_batch": mapped["micro_batch"],
        "optim": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "clip_norm": 1.0},
        "steps": spec["steps"], "eval": {"every": 0}, "out_dir": spec["out_dir"], "tensorboard": False,
    }
    self.cfg = config_lib.from_dict(rl.RLConfig, data)
    self.trainer = rl.RLTrainer(self.cfg)
    t = self.trainer
    # Exactly NEW_TOKENS per sample, as in the peers: this sampler stops at no token.
    t.sampler = sampling.Sampler(t.current_model(), t.tokenizer, mesh=t.mesh, rules=t.rules,
                                 max_len=prompt_tokens + new_tokens, eos_token_ids=[], version=0)
    self.step_index = 0
    return {"ok": True, "versions": _versions("jax", "jaxlib", "flax", "optax"),
            "settings": jaxrl_applied(self.cfg, t.current_model().cfg)}

  def step(self) -> dict[str, Any]:
    self.step_index += 1
    t0 = time.perf_counter()
    rollout, metrics = self.trainer.collect(self.step_index)
    t1 = time.perf_counter()
    copied = self.trainer.sampler.copied_bytes  # weights held twice while generating (the update frees them)
    self.trainer.update(rollout, self.step_index)
    t2 = time.perf_counter()
    return {"step_s": t2 - t0, "generate_s": t1 - t0, "train_s": t2 - t1, "tokens": int(rollout.lengths.sum()),
            "reward": float(metrics["reward/mean"]), "sampler_copied_bytes": copied}

  def sampling(self) -> dict[str, Any]:
    """Sampling cost, greedy vs temperature 1 (no filters): one call on [64, 4096] logits, and a decode step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

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
    sampler = self.trainer._sampler_for(self.step_index)  # the bench's sampler, given the current weights
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

  def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
    self.name = name
    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
                                 if os.environ.get("JAXRL_BENCH_QUIET", "1") == "1" else None, text=True,
                                 env=None if env is None else {**os.environ, **env})

  def ask(self, cmd: str, **kw) -> dict[str, Any]:
    cpu0 = _proc_cpu_s(self.proc.pid)
    self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"bench rl: the {self.name} worker exited (rerun with JAXRL_BENCH_QUIET=0 to see why)")
    ans = json.loads(line)
    if "error" in ans:
      raise RuntimeError(f"bench rl: {self.name} {cmd}: {ans['error']}")
    cpu1 = _proc_cpu_s(self.proc.pid)
    if cpu0 is not None and cpu1 is not None:
      ans["cpu_s"] = cpu1 - cpu0  # the worker's CPU seconds (all threads) over the command
    rss = _proc_peak_rss_gib(self.proc.pid)
    if rss is not None:
      ans["peak_rss_gib"] = rss
    return ans

  def close(self) -> None:
    try:
      self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
      self.proc.stdin.close()
      self.proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      self.proc.kill()


def _proc_cpu_s(pid: int) -> float | None:
  """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; ``None`` elsewhere). On a
  shared machine a step's CPU seconds move far less with background load than its wall time."""
  try:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None


def _proc_peak_rss_gib(pid: int) -> float | None:
  """Peak resident memory (``VmHWM``) of process ``pid`` in GiB (Linux ``/proc``; ``None`` elsewhere)."""
  try:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 2**20
  except (OSError, ValueError, IndexError):
    pass
  return None


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
  first, rest = steps[0], steps[1:] or steps[:1]
  med = lambda k: statistics.median(s[k] for s in rest)
  out = {"first_step_s": first["step_s"], "step_s": med("step_s"), "generate_s": med("generate_s"),
         "train_s": med("train_s"), "gen_tok_s": statistics.median(s["tokens"] / s["generate_s"] for s in rest),
         "step_tok_s": statistics.median(s["tokens"] / s["step_s"] for s in rest), "steps": len(steps)}
  if all("cpu_s" in s for s in steps):
    out.update(first_step_cpu_s=first["cpu_s"], step_cpu_s=med("cpu_s"))
  if any("peak_rss_gib" in s for s in steps):
    out["peak_rss_gib"] = max(s.get("peak_rss_gib", 0.0) for s in steps)
  return out


XLA_CACHE_ENV = "JAXRL_BENCH_XLA_CACHE"
"""Set for the jaxrl worker only by ``--xla-cache``: its persistent compilation cache directory."""


def run(work: Path, *, steps: int, peers: list[str], sampling: bool = True, model: dict[str, int] | None = None,
        workload: str = "tiny", xla_cache: str | None = None, settings: RLBenchSettings | None = None,
        log=print) -> dict[str, Any]:
  """Writes ``workload`` under ``work`` (``model`` overrides its model shape) and runs ``steps`` steps
  of jaxrl and each peer whose virtualenv exists: interleaved (one step of each in turn) or, for a
  workload too large to hold several frameworks in memory, one framework after the other. Returns the
  raw steps and their summary per framework (and jaxrl's sampling costs on the tiny workload).
  ``xla_cache``: a persistent compilation cache directory for the jaxrl worker (default none: every
  framework compiles cold). ``settings`` (default :class:`RLBenchSettings`): sent to every worker, which
  must answer with the same values read back from its configuration; every step must generate exactly
  ``prompts × samples × new_tokens`` tokens."""
  wl = WORKLOADS[workload]
  sent = (settings or RLBenchSettings()).to_message()
  spec = write_workload(work, model=model, workload=wl)
  argvs = {"jaxrl": [sys.executable, "-m", "jaxrl.bench.rl", "--worker"]}
  for name in peers:
    py = peer_python(name)
    if not py.exists():
      log(f"{name}: no virtualenv at {py.parent.parent} (create it with `jaxrl bench rl --setup {name}`); skipped")
      continue
    argvs[name] = [str(py), str(harness(PEERS[name][0]))]
  results: dict[str, Any] = {"frameworks": {}, "settings": sent}
  sampling = sampling and workload == "tiny"  # the sampling figures are the tiny model's

  def start(name: str, w: Peer) -> None:
    own = {"per_layer_weights": wl.per_layer_weights} if name == "jaxrl" else {}  # a jaxrl option, not a shared setting
    ans = w.ask("setup", **spec, **wl.batch(), **own, steps=steps, out_dir=str(work / f"out_{name}"), lr=LR,
                settings=sent)
    check_applied(name, sent, ans.get("settings"))
    results["frameworks"][name] = {"versions": ans.get("versions", {}), "setup_s": ans["wall_s"], "steps_raw": []}

  def step(i: int, name: str, w: Peer) -> None:
    s = w.ask("step")
    want = wl.prompts * wl.samples * wl.new_tokens
    if s["tokens"] != want:
      raise ValueError(f"bench rl: {name} generated {s['tokens']} tokens at step {i + 1}, not {want}")
    results["frameworks"][name]["steps_raw"].append(s)
    log(f"step {i + 1} {name}: {s['step_s']:.3f} s (generate {s['generate_s']:.3f}, train {s['train_s']:.3f})")

  groups = [list(argvs)] if wl.interleave else [[name] for name in argvs]
  for group in groups:
    workers = {}
    try:
      for name in group:
        env = {XLA_CACHE_ENV: str(xla_cache)} if name == "jaxrl" and xla_cache else None
        workers[name] = Peer(name, argvs[name], env) if env else Peer(name, argvs[name])
        start(name, workers[name])
      for i in range(steps):
        for name, w in workers.items():
          step(i, name, w)
      if sampling and "jaxrl" in workers:
        results["sampling"] = workers["jaxrl"].ask("sampling")
    except RuntimeError as e:
      if "jaxrl" in group:
        raise
      log(f"{e}; the other frameworks still run")  # one at a time: a failing peer costs only its own column
      results["frameworks"].setdefault(group[0], {"steps_raw": []})["error"] = str(e)
    finally:
      for w in workers.values():
        w.close()
  for name, r in results["frameworks"].items():
    if r["steps_raw"]:
      r.update(_summary(r["steps_raw"]))
  return results


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="jaxrl bench rl", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS),
                 help="tiny (default; steps interleaved) or 0.5b (Qwen2.5-0.5B shapes; frameworks in turn)")
  p.add_argument("--steps", type=int, default=None,
                 help="steps per framework (default 6 tiny, 2 for 0.5b); the first is reported apart")
  p.add_argument("--peers", nargs="*", default=sorted(PEERS), choices=sorted(PEERS))
  p.add_argument("--setup", nargs="*", choices=sorted(PEERS), default=None,
                 help=f"create these peers' virtualenvs under ${VENV_ROOT_ENV} (default ~/.cache/jaxrl/bench) and exit")
  p.add_argument("--work-dir", default=None, help="model, prompts and trainer outputs (default runs/bench_rl[_0.5b])")
  p.add_argument("--json", default=None, help="output (default runs/bench_rl[_0.5b].json)")
  p.add_argument("--xla-cache", default=None, metavar="DIR",
                 help="persistent compilation cache for the jaxrl worker (default: none, a cold compile like the "
                      "peers'); run twice with the same DIR to measure the cache-hit first step")
  p.add_argument("--threads", type=int, default=None,
                 help="CPU threads of every framework (workers pinned to that many CPUs; torch.set_num_threads); "
                      "default: all CPUs this process may use")
  p.add_argument("--remat", action="store_true",
                 help="rematerialise activations in all three (TRL gradient_checkpointing; default off in all)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ns = p.parse_args(argv)
  if ns.worker:
    if os.environ.get(XLA_CACHE_ENV):
      _cache.enable_compilation_cache(os.environ[XLA_CACHE_ENV])
    return serve(JaxrlWorker())
  if ns.setup is not None:
    for name in ns.setup or sorted(PEERS):
      setup_peer(name)
      print(f"{name}: {peer_python(name)}")
    return 0
  wl = WORKLOADS[ns.workload]
  steps = wl.steps if ns.steps is None else ns.steps
  if steps < 2:
    p.error("--steps must be >= 2 (the first step is compilation)")
  suffix = "" if ns.workload == "tiny" else f"_{ns.workload}"
  work_dir = Path(ns.work_dir or f"runs/bench_rl{suffix}")
  out = Path(ns.json or f"runs/bench_rl{suffix}.json")
  settings = RLBenchSettings(remat=ns.remat, **({} if ns.threads is None else {"threads": ns.threads}))
  load0 = os.getloadavg()[0]
  results = run(work_dir, steps=steps, peers=ns.peers, workload=ns.workload, xla_cache=ns.xla_cache,
                settings=settings)
  results.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 machine=f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load0:.1f} at the start, "
                         f"{os.getloadavg()[0]:.1f} at the end",
                 command="jaxrl bench rl " + " ".join(argv), workload=dict(name=ns.workload, **wl.batch(),
                                                                          model=wl.model, lr=LR,
                                                                          per_layer_weights=wl.per_layer_weights))
  print(format_table(results))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=2))
  print(f"wrote {out}")
  return 0


def format_table(results: dict[str, Any]) -> str:
  """Markdown table of the summary (what docs/benchmarks.md records)."""
  fw = results["frameworks"]
  lines = []
  if "settings" in results:
    st = RLBenchSettings.from_message(results["settings"])
    wl = results.get("workload", {})
    lines.append(st.header(wl.get("new_tokens", "?"), wl.get("n_prompts", 0) * wl.get("samples", 0) or "?"))
    if wl.get("per_layer_weights"):  # a jaxrl option, not a shared setting: printed beside the numbers
      lines.append("jaxrl only: one weight array per block (model scan_layers: false), as TRL and Tunix hold theirs; "
                   "its sampler decodes from the trainer's arrays")
    lines.append("")
  lines += ["| framework | first step s | median step s | generate s | train s | generated tok/s | jaxrl speed-up "
           "| step CPU s | peak RSS GiB |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  base = fw["jaxrl"]["step_s"]
  for name, r in fw.items():
    if "step_s" not in r:
      lines.append(f"| {name} | failed: {r.get('error', 'no step')} |")
      continue
    cpu = f"{r['step_cpu_s']:.2f}" if "step_cpu_s" in r else "–"
    rss = f"{r['peak_rss_gib']:.1f}" if "peak_rss_gib" in r else "–"
    lines.append(f"| {name} | {r['first_step_s']:.2f} | {r['step_s']:.3f} | {r['generate_s']:.3f} | "
                 f"{r['train_s']:.3f} | {r['gen_tok_s']:,.0f} | {r['step_s'] / base:.2f}× | {cpu} | {rss} |")
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
