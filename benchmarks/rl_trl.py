"""TRL worker of ``jaxrl bench rl``: TRL's ``GRPOTrainer`` (PyTorch CPU, transformers ``generate``).

Runs inside the TRL virtualenv (``jaxrl bench rl --setup trl``) as a plain script: it imports no
jaxrl module. Protocol and workload: see ``jaxrl/bench/rl.py``. ``trainer.train()`` runs the steps;
a callback answers each ``step`` command at the end of a step and waits there for the next one.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 64


def bench_reward(completions, **_):
  """Same as ``jaxrl.bench.rl.bench_reward``: fraction of completion words whose id is even."""
  out = []
  for text in completions:
    words = text.split()
    out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
  return out


def trl_config_kwargs(settings: dict, *, n_prompts: int, samples: int) -> dict:
  """The work-changing ``trl.GRPOConfig`` arguments for a ``jaxrl bench rl`` settings message."""
  rows = n_prompts * samples
  if rows % settings["micro_batches"]:
    raise ValueError(f"settings: {rows} rows do not split into {settings['micro_batches']} micro-batches")
  if settings["loss"] != "token_mean" or settings["old_logprobs"] != "current":
    raise ValueError(f"settings: loss {settings['loss']!r} / π_old {settings['old_logprobs']!r} not mapped for TRL")
  return dict(gradient_checkpointing=bool(settings["remat"]), bf16=settings["dtype"] == "bfloat16",
              beta=float(settings["kl_coef"]), loss_type="dapo", num_iterations=settings["ppo_epochs"],
              per_device_train_batch_size=rows // settings["micro_batches"],
              gradient_accumulation_steps=settings["micro_batches"], steps_per_generation=settings["micro_batches"])


def trl_applied(trainer, torch) -> dict:
  """The settings TRL actually runs with, read back from the built trainer, its model and torch."""
  args, model = trainer.args, trainer.model
  dtypes = {p.dtype for p in model.parameters()}
  old = "current" if (args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
                      and not getattr(trainer, "use_vllm", False)) else "recompute"
  return {"remat": bool(getattr(model, "is_gradient_checkpointing", False)), "threads": torch.get_num_threads(),
          "dtype": "bfloat16" if args.bf16 else str(next(iter(dtypes))).replace("torch.", "") if len(dtypes) == 1
          else "mixed", "kl_coef": float(args.beta), "loss": "token_mean" if args.loss_type == "dapo"
          else args.loss_type, "ppo_epochs": args.num_iterations, "micro_batches": args.gradient_accumulation_steps,
          "old_logprobs": old}


def pin_cpus(threads: int) -> None:
  """The first ``threads`` CPUs of this process's affinity (as the jaxrl worker does)."""
  cpus = sorted(os.sched_getaffinity(0))
  if threads > len(cpus):
    raise ValueError(f"settings: threads={threads} but this process may use only {len(cpus)} CPUs")
  os.sched_setaffinity(0, cpus[:threads])


class Worker:
  def __init__(self, proto, commands):
    self.proto, self.commands = proto, commands
    self.trainer = None
    self.pending_quit = False

  def setup(self, hf_dir, tokenizer, prompts, steps, out_dir, lr, n_prompts=PROMPTS, samples=SAMPLES,
            prompt_tokens=None, new_tokens=NEW_TOKENS, settings=None):
    del prompt_tokens  # the prompts file holds exactly that many words each
    pin_cpus(settings["threads"])
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(settings["threads"])
    torch.manual_seed(0)
    with open(prompts) as f:
      records = [json.loads(line) for line in f]
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in records] * steps)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, settings["dtype"]))
    args = trl.GRPOConfig(
        output_dir=out_dir, **trl_config_kwargs(settings, n_prompts=n_prompts, samples=samples),
        num_generations=samples, max_completion_length=new_tokens, temperature=1.0, top_p=1.0,
        generation_kwargs={"min_new_tokens": new_tokens}, epsilon=0.2, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=steps, logging_steps=10**6, report_to="none", save_strategy="no",
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, log_completions=False)
    self.trainer = trl.GRPOTrainer(model=model, reward_funcs=bench_reward, args=args, train_dataset=ds,
                                   processing_class=tok, callbacks=[_StepCallback(self)])
    self.gen_time = 0.0
    inner = self.trainer._generate_and_score_completions

    def timed(*a, **kw):
      t0 = time.perf_counter()
      out = inner(*a, **kw)
      self.gen_time += time.perf_counter() - t0
      self.tokens = int(out["completion_mask"].sum())
      return out

    self.trainer._generate_and_score_completions = timed
    self.max_steps = steps
    return {"ok": True, "versions": {m: __import__(m).__version__ for m in ("torch", "trl", "transformers")},
            "settings": trl_applied(self.trainer, torch)}

  def run(self):
    for line in self.commands:
      msg = json.loads(line)
      cmd = msg.pop("cmd")
      if cmd == "quit":
        return
      if cmd == "setup":
        self.answer(lambda: self.setup(**msg))
      elif cmd == "step":
        self.trainer.train()  # returns after the last step; the callback answers every step
        if self.pending_quit:
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


def _StepCallback(worker):
  import transformers

  class StepCallback(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      worker.gen_time = 0.0
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      step = time.perf_counter() - self.t0
      worker.proto.write(json.dumps({"step_s": step, "generate_s": worker.gen_time, "train_s": step - worker.gen_time,
                                     "tokens": worker.tokens, "wall_s": step}) + "\n")
      if state.global_step >= worker.max_steps:
        return control
      msg = json.loads(next(worker.commands))
      if msg["cmd"] != "step":  # anything else ends training early
        worker.pending_quit = True
        control.should_training_stop = True
      return control

  return StepCallback()


def main() -> int:
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  Worker(proto, iter(sys.stdin.readline, "")).run()
  return 0


if __name__ == "__main__":
  sys.exit(main())
