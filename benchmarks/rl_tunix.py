"""Tunix worker of ``jaxrl bench rl``: Tunix's ``GRPOLearner`` with its native ("vanilla") sampler.

Runs inside the Tunix virtualenv (``jaxrl bench rl --setup tunix``) as a plain script: it imports no
jaxrl module. Protocol and workload: see ``jaxrl/bench/rl.py``.

The model: Tunix's own Qwen2 (``tunix.models.qwen2``) built from the shared HF directory's
``config.json`` and loaded by Tunix's safetensors loader (``params.create_model_from_safe_tensors``),
so no weight copying happens here. One CPU device, a 1×1 ``(fsdp, tp)`` mesh shared by actor,
reference and rollout (colocated: the rollout shares the actor's weights, nothing is resharded).

The step: ``learner.train()`` runs the steps; ``rl_cluster.generate`` is wrapped to time generation,
and ``rl_cluster.update_actor`` to answer each ``step`` command when the update is done and wait
there for the next command. Exactly 64 new tokens: the sampler is given an EOS id no token has
(``-1``), so it never stops early.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 8, 8, 32, 64


def bench_reward(prompts, completions, **_):
  """Same as ``jaxrl.bench.rl.bench_reward``: fraction of completion words whose id is even."""
  del prompts
  out = []
  for text in completions:
    words = text.split()
    out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
  return out


def qwen2_config_kwargs(hf_config: dict) -> dict:
  """Tunix ``qwen2.ModelConfig`` keyword arguments from an HF Qwen2 ``config.json`` dict."""
  missing = [k for k in ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size",
                         "num_attention_heads") if k not in hf_config]
  if missing:
    raise ValueError(f"config.json: missing {', '.join(missing)}")
  heads = hf_config["num_attention_heads"]
  return dict(num_layers=hf_config["num_hidden_layers"], vocab_size=hf_config["vocab_size"],
              embed_dim=hf_config["hidden_size"], hidden_dim=hf_config["intermediate_size"], num_heads=heads,
              head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
              num_kv_heads=hf_config.get("num_key_value_heads", heads),
              rope_theta=int(hf_config.get("rope_theta", 1_000_000)), norm_eps=hf_config.get("rms_norm_eps", 1e-6),
              use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)))


def tunix_config_kwargs(settings: dict, *, n_prompts: int) -> dict:
  """The work-changing Tunix arguments for a ``jaxrl bench rl`` settings message: ``model`` (extra
  ``qwen2.ModelConfig`` fields, enum/dtype names), ``training`` (``RLTrainingConfig``), ``algo``
  (``GRPOConfig``). Tunix micro-batches count prompts (each with its ``samples`` completions)."""
  if n_prompts % settings["micro_batches"]:
    raise ValueError(f"settings: {n_prompts} prompts do not split into {settings['micro_batches']} micro-batches")
  if settings["loss"] != "token_mean" or settings["old_logprobs"] != "current":
    raise ValueError(f"settings: loss {settings['loss']!r} / π_old {settings['old_logprobs']!r} not mapped for Tunix")
  return {"model": dict(remat_config="BLOCK" if settings["remat"] else "NONE", dtype=settings["dtype"],
                        param_dtype=settings["dtype"]),
          "training": dict(mini_batch_size=n_prompts, train_micro_batch_size=n_prompts // settings["micro_batches"]),
          "algo": dict(beta=float(settings["kl_coef"]), loss_agg_mode="token-mean",
                       num_iterations=settings["ppo_epochs"])}


def tunix_applied(model_cfg, training, algo) -> dict:
  """The settings Tunix actually runs with, read back from its model, training and algorithm configs."""
  import numpy as np  # lazy: the module's pure helpers are tested without the Tunix virtualenv
  dtype, param_dtype = np.dtype(model_cfg.dtype).name, np.dtype(model_cfg.param_dtype).name
  return {"remat": getattr(model_cfg.remat_config, "name", model_cfg.remat_config) != "NONE",
          "threads": len(os.sched_getaffinity(0)), "dtype": dtype if dtype == param_dtype else "mixed",
          "kl_coef": float(algo.beta),
          "loss": "token_mean" if algo.loss_agg_mode == "token-mean" else algo.loss_agg_mode,
          "ppo_epochs": algo.num_iterations,
          "micro_batches": training.mini_batch_size // training.train_micro_batch_size,
          "old_logprobs": "current" if algo.num_iterations == 1 else "recompute"}


def pin_cpus(threads: int) -> None:
  """The first ``threads`` CPUs of this process's affinity (XLA sizes its CPU thread pool from it)."""
  cpus = sorted(os.sched_getaffinity(0))
  if threads > len(cpus):
    raise ValueError(f"settings: threads={threads} but this process may use only {len(cpus)} CPUs")
  os.sched_setaffinity(0, cpus[:threads])


class _Quit(Exception):
  pass


class Worker:
  def __init__(self, proto, commands):
    self.proto, self.commands = proto, commands

  def setup(self, hf_dir, tokenizer, prompts, steps, out_dir, lr, n_prompts=PROMPTS, samples=SAMPLES,
            prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS, settings=None):
    pin_cpus(settings["threads"])  # before jax starts its CPU client
    mapped = tunix_config_kwargs(settings, n_prompts=n_prompts)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    with open(os.path.join(hf_dir, "config.json")) as f:
      m = mapped["model"]
      cfg = qwen2_model.ModelConfig(**qwen2_config_kwargs(json.load(f)),
                                    remat_config=qwen2_model.RematConfig[m["remat_config"]],
                                    dtype=getattr(jnp, m["dtype"]), param_dtype=getattr(jnp, m["param_dtype"]))
    # Auto axis types (jax.make_mesh's default Explicit ones break Tunix's embedding gather).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = qwen2_params.create_model_from_safe_tensors(hf_dir, cfg, mesh=mesh)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    with open(prompts) as f:
      self.prompts = [json.loads(line)["prompt"] for line in f]
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0)),
        eval_every_n_steps=10**9, max_steps=steps, **mapped["training"], rollout_micro_batch_size=n_prompts,
        compute_logps_micro_batch_size=n_prompts,
        checkpoint_root_directory=None, pbar_description=None)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens, max_prompt_length=prompt_tokens, temperature=1.0, top_p=1.0, top_k=None,
        kv_cache_size=prompt_tokens + new_tokens + 8, eos_tokens=[-1])
    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh}, rollout_engine="vanilla",
        offload_to_cpu=False, training_config=training, rollout_config=rollout)
    self.cluster = rl_cluster_lib.RLCluster(actor=model, reference=model, tokenizer=tok, cluster_config=cluster)
    algo = grpo_learner.GRPOConfig(num_generations=samples, epsilon=0.2, **mapped["algo"])
    self.learner = grpo_learner.GRPOLearner(rl_cluster=self.cluster, algo_config=algo, reward_fns=bench_reward)
    self._instrument()
    self.max_steps, self.np = steps, np
    return {"ok": True, "versions": {m: _version(m) for m in ("google-tunix", "jax", "flax", "optax")},
            "settings": tunix_applied(cfg, training, algo)}

  def _instrument(self):
    gen, update = self.cluster.generate, self.cluster.update_actor

    def timed_generate(*a, **kw):
      t0 = time.perf_counter()
      out = gen(*a, **kw)
      self.gen_time += time.perf_counter() - t0
      self.tokens += sum(len(t) for t in out.tokens)
      return out

    def answering_update(*a, **kw):
      out = update(*a, **kw)
      import jax
      from flax import nnx
      jax.block_until_ready(nnx.state(self.cluster.actor_trainer.model))  # the update is dispatched async
      step = time.perf_counter() - self.t0
      self.proto.write(json.dumps({"step_s": step, "generate_s": self.gen_time, "train_s": step - self.gen_time,
                                   "tokens": self.tokens, "wall_s": step}) + "\n")
      self.done += 1
      if self.done < self.max_steps:
        msg = json.loads(next(self.commands))
        if msg["cmd"] != "step":
          raise _Quit()
        self._start_step()
      return out

    self.cluster.generate, self.cluster.update_actor = timed_generate, answering_update

  def _start_step(self):
    self.t0, self.gen_time, self.tokens = time.perf_counter(), 0.0, 0

  def batches(self):
    while True:
      yield {"prompts": self.np.array(self.prompts)}  # the learner np.repeat's every leaf

  def run(self):
    self.done = 0
    for line in self.commands:
      msg = json.loads(line)
      cmd = msg.pop("cmd")
      if cmd == "quit":
        return
      if cmd == "setup":
        self.answer(lambda: self.setup(**msg))
      elif cmd == "step":
        self._start_step()
        try:
          self.learner.train(self.batches())  # returns after the last step; update_actor answers every step
        except _Quit:
          return
        except Exception as e:
          import traceback
          traceback.print_exc()
          self.proto.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
          return
      else:
        self.proto.write(json.dumps({"error": f"unknown command {cmd!r}"}) + "\n")

  def answer(self, fn):
    t0 = time.perf_counter()
    try:
      ans = fn()
      ans["wall_s"] = time.perf_counter() - t0
    except Exception as e:
      ans = {"error": f"{type(e).__name__}: {e}"}
    self.proto.write(json.dumps(ans) + "\n")


def _version(name: str) -> str:
  from importlib import metadata
  return metadata.version(name)


def main() -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the bench is a CPU comparison; skips TPU/GPU plugin probing
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  Worker(proto, iter(sys.stdin.readline, "")).run()
  os._exit(0)  # the learner's prefetch thread may still wait on the endless batch iterator


if __name__ == "__main__":
  sys.exit(main())
