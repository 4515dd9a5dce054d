"""TRL worker of ``jaxrl bench dpo``: TRL's ``DPOTrainer`` (PyTorch CPU, float32).

Runs inside the TRL virtualenv (``jaxrl bench rl --setup trl``) as a plain script: it imports no jaxrl
module. Protocol, workload and the settings held equal: see ``jaxrl/bench/dpo.py``. ``trainer.train()``
runs the steps; a callback answers each ``step`` command at the end of a step and waits there for the next.
"""

from __future__ import annotations

import json
import os
import sys
import time


class Worker:
  def __init__(self, proto, commands):
    self.proto, self.commands = proto, commands
    self.trainer = None
    self.pending_quit = False

  def setup(self, hf_dir, tokenizer, pairs_file, pairs, seq_len, steps, out_dir, lr, beta):
    import datasets
    import torch
    import transformers
    import trl

    torch.manual_seed(0)
    if os.environ.get("JAXRL_BENCH_TORCH_FTZ") == "1":  # flush denormals to zero, as XLA's CPU code does
      torch.set_flush_denormal(True)
    with open(pairs_file) as f:
      records = [json.loads(line) for line in f]
    ds = datasets.Dataset.from_list(records)  # one epoch (all pairs) per step: the same pairs as jaxrl's
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    args = trl.DPOConfig(
        output_dir=out_dir, per_device_train_batch_size=pairs, gradient_accumulation_steps=1,
        loss_type=["sigmoid"], beta=beta, precompute_ref_log_probs=False, max_length=seq_len,
        gradient_checkpointing=False, padding_free=False, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=10**6,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    self.trainer = trl.DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                  callbacks=[_StepCallback(self)])
    if self.trainer.ref_model is None:
      raise RuntimeError("TRL built no reference model; the bench compares a frozen-copy reference")
    inner = self.trainer._compute_loss

    def counted(model, inputs, return_outputs):
      self.tokens = int(inputs["attention_mask"].sum())
      self.padding = float((inputs["attention_mask"] == 0).float().mean())
      out = inner(model, inputs, return_outputs)
      self.loss = float((out[0] if isinstance(out, tuple) else out).detach())
      return out

    self.trainer._compute_loss = counted
    self.max_steps = steps
    return {"ok": True, "versions": {m: __import__(m).__version__ for m in ("torch", "trl", "transformers")},
            "torch_threads": torch.get_num_threads()}

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
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      step = time.perf_counter() - self.t0
      worker.proto.write(json.dumps({"step_s": step, "tokens": worker.tokens, "padding": worker.padding,
                                     "loss": worker.loss, "wall_s": step}) + "\n")
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
