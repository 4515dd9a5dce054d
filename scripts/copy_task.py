"""Can jaxrl's SFT trainer teach a tiny model to copy? Packed vs unpacked vs a plain PyTorch loop.

The task: ``copy: c e a h |`` → ``c e a h`` (4–10 random letters from ``--alphabet``). Three runs
from the same initial weights, same steps, learning-rate schedule and seed:

  jaxrl-packed    SFTTrainer, packing.method=best_fit (several samples per row)
  jaxrl-unpacked  SFTTrainer, packing.method=none (one sample per row)
  torch           the initial weights exported with ``save_pretrained``, loaded in ``transformers``,
                  trained on jaxrl-unpacked's batches (same tokens, targets and loss mask) with
                  torch AdamW, global-norm clipping and the same per-step learning rate.

Prints the loss curves and the greedy copy accuracy on held-out prompts for each.

  python scripts/copy_task.py OUT_DIR [--steps 200 --lr 3e-3 --hidden 128 --layers 2 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def copy_records(n: int, *, alphabet: str, lo: int, hi: int, seed: int) -> list[dict[str, str]]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    s = " ".join(rng.choice(list(alphabet), size=int(rng.integers(lo, hi + 1))))
    out.append({"prompt": f"copy: {s} |", "completion": s})
  return out


def sft_config(a, out_dir: Path, *, packed: bool):
  from jaxrl import config as config_lib
  from jaxrl import sft
  rows = a.rows // a.pack if packed else a.rows
  d = {
      "model": {"preset": "tiny", "seed": a.seed,
                "overrides": {"vocab_size": 128, "hidden_size": a.hidden, "intermediate_size": 3 * a.hidden,
                              "num_layers": a.layers, "num_heads": 4, "num_kv_heads": 2,
                              "dtype": "float32", "param_dtype": "float32"}},
      "data": {"train": [str(out_dir / "train.jsonl")], "builtin": None, "shuffle_seed": a.seed},
      "packing": {"seq_len": a.seq_len * (a.pack if packed else 1), "global_rows": rows,
                  "method": "best_fit" if packed else "none", "buffer_size": 64},
      "loss": {"mode": "global_token_mean"},
      "optim": {"lr": a.lr, "warmup_steps": a.warmup, "schedule": "cosine", "final_lr_ratio": 0.1,
                "weight_decay": a.weight_decay},
      "steps": a.steps, "eval": {"every": 0}, "checkpoint": {"every": 0},
      "out_dir": str(out_dir / ("packed" if packed else "unpacked")), "export_hf": False, "tensorboard": False,
  }
  return config_lib.from_dict(sft.SFTConfig, d)


def greedy_copy_accuracy_jax(model, tokenizer, records, max_new_tokens: int = 32) -> float:
  from jaxrl import data as data_lib
  from jaxrl import sampling
  prompts = [data_lib.encode_prompt(tokenizer, r).tolist() for r in records]
  sampler = sampling.Sampler(model, tokenizer, max_len=max(map(len, prompts)) + max_new_tokens)
  out = sampler.generate(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
  return float(np.mean([t.split("<|im_end|>")[0].strip() == r["completion"] for t, r in zip(out.texts, records)]))


def run_jaxrl(a, out_dir: Path, *, packed: bool, heldout, save_init: Path | None = None, keep_batches=False):
  from jaxrl import models, sft
  trainer = sft.SFTTrainer(sft_config(a, out_dir, packed=packed))
  if save_init is not None:
    models.save_pretrained(trainer.current_model(), save_init, tokenizer=trainer.tokenizer)
  batches = None
  if keep_batches:  # the same deterministic stream the trainer reads
    it = trainer._batches(trainer.train_paths, epochs=None)
    batches = [{k: np.asarray(v) for k, v in next(it).arrays.items()} for _ in range(a.steps)]
  res = trainer.run()
  acc = greedy_copy_accuracy_jax(trainer.current_model(for_sampling=True), trainer.tokenizer, heldout)
  return res["losses"], acc, batches, trainer


def run_torch(a, init_dir: Path, batches, schedule, heldout):
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  torch.manual_seed(a.seed)
  torch.set_num_threads(1)  # a small model: more threads only contend on a shared machine
  model = AutoModelForCausalLM.from_pretrained(str(init_dir), torch_dtype=torch.float32)
  tok = AutoTokenizer.from_pretrained(str(init_dir))
  opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
  losses = []
  model.train()
  for step, b in enumerate(batches):
    tokens = torch.tensor(b["tokens"], dtype=torch.long)
    targets = torch.tensor(b["targets"], dtype=torch.long)
    mask = torch.tensor(b["loss_mask"], dtype=torch.float32)
    attn = torch.tensor(b["segment_ids"] > 0, dtype=torch.long)
    logits = model(input_ids=tokens, attention_mask=attn).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").reshape(targets.shape)
    loss = (nll * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
      g["lr"] = float(schedule(step))
    opt.step()
    losses.append(float(loss))
  model.eval()
  hits = 0
  from jaxrl import data as data_lib
  with torch.no_grad():
    for r in heldout:
      ids = torch.tensor([data_lib.encode_prompt(tok, r).tolist()])
      out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                           pad_token_id=0)
      text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False).split("<|im_end|>")[0].strip()
      hits += text == r["completion"]
  return losses, hits / len(heldout)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out_dir")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--weight-decay", type=float, default=0.0)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--rows", type=int, default=16, help="samples per unpacked batch")
  p.add_argument("--pack", type=int, default=4, help="packed rows are this many times longer, this many times fewer")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--alphabet", default="abcdefgh")
  p.add_argument("--n-train", type=int, default=20000)
  p.add_argument("--n-heldout", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--runs", default="packed,unpacked,torch")
  p.add_argument("--torch-steps", type=int, default=None, help="train the torch reference for only this many steps")
  a = p.parse_args(argv)
  out = Path(a.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  recs = copy_records(a.n_train + a.n_heldout, alphabet=a.alphabet, lo=4, hi=10, seed=a.seed)
  heldout = recs[a.n_train:]
  (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:a.n_train]))
  runs = a.runs.split(",")
  report = {}
  if "unpacked" in runs or "torch" in runs:
    losses, acc, batches, trainer = run_jaxrl(a, out, packed=False, heldout=heldout, save_init=out / "init_hf",
                                              keep_batches="torch" in runs)
    report["jaxrl-unpacked"] = {"losses": losses, "copy_acc": acc}
    print("jaxrl-unpacked", acc, [round(x, 3) for x in losses[::10]], flush=True)
    if "torch" in runs:
      tl, tacc = run_torch(a, out / "init_hf", batches[:a.torch_steps], trainer.schedule, heldout)
      report["torch"] = {"losses": tl, "copy_acc": tacc}
      print("torch", tacc, [round(x, 3) for x in tl[::10]], flush=True)
  if "packed" in runs:
    losses, acc, _, _ = run_jaxrl(a, out, packed=True, heldout=heldout)
    report["jaxrl-packed"] = {"losses": losses, "copy_acc": acc}
    print("jaxrl-packed", acc, [round(x, 3) for x in losses[::10]], flush=True)
  (out / "report.json").write_text(json.dumps(report, indent=1))
  for k, v in report.items():
    ls = v["losses"]
    print(f"{k:15s} copy_acc={v['copy_acc']:.3f} loss[0]={ls[0]:.4f} loss[1]={ls[1]:.4f} "
          f"loss[-1]={ls[-1]:.4f}")
  return report


if __name__ == "__main__":
  main(sys.argv[1:])


def calculator_copy_probe(hf_dir: str, sft_jsonl: str, n: int = 64) -> dict[str, float]:
  """Teacher-forced argmax accuracy on the copied characters of the calculator demo's tool demonstrations.

  ``operands``: the ``a*b`` inside the tool call (copied from the question); ``result``: the digits after
  ``Answer: `` (copied from the tool's reply). Direct answers (no tool) give the no-copy baseline ``direct``.

    python -c "import scripts.copy_task as c; print(c.calculator_copy_probe('SFT/hf', 'DATA/sft.jsonl'))"
  """
  import jax.numpy as jnp
  from jaxrl import data as data_lib
  from jaxrl import models
  model = models.load_pretrained(hf_dir, dtype="float32")
  tok = models.load_tokenizer(hf_dir)
  recs = [json.loads(line) for line in Path(sft_jsonl).read_text().splitlines()[-4 * n:]]
  hits = {"operands": [], "result": [], "direct": []}
  for r in recs:
    msgs = r["messages"]
    e = data_lib.encode_record(tok, r)
    ids = e["tokens"]
    text = tok.decode(ids.tolist(), skip_special_tokens=False)
    if len(text) != len(ids):  # offsets below are character offsets of a 1-token-per-character text
      ids_chars = [tok.decode([i], skip_special_tokens=False) for i in ids.tolist()]
    else:
      ids_chars = list(text)
    starts = np.cumsum([0] + [len(c) for c in ids_chars])
    full = "".join(ids_chars)
    logits = np.asarray(model(jnp.asarray(ids[None]), positions=jnp.arange(len(ids))[None],
                              segment_ids=jnp.ones((1, len(ids)), jnp.int32)))[0]
    pred = logits.argmax(-1)  # pred[t] predicts ids[t + 1]

    def acc(char_lo, char_hi):
      toks = [t for t in range(1, len(ids)) if char_lo <= starts[t] < char_hi]
      return [float(pred[t - 1] == ids[t]) for t in toks]

    q, ans = msgs[0]["content"], msgs[-1]["content"].split("Answer: ")[1]
    last = full.rfind("Answer: ") + len("Answer: ")
    if len(msgs) > 2:
      call = full.find('"expression":"') + len('"expression":"')
      hits["operands"] += acc(call, call + len(q))
      hits["result"] += acc(last, last + len(ans))
    else:
      hits["direct"] += acc(last, last + len(ans))
  return {k: float(np.mean(v)) if v else float("nan") for k, v in hits.items()}
