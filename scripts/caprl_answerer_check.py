"""How well does a trained text answerer read captions? (docs/benchmarks.md, "Tiny CapRL with a text-model answerer")

Serves the answerer (`jaxrl serve` through ``judge.launch``) and asks it, at CapRL's sampling settings, the
held-out answerer prompts of a `jaxrl.rewards.CaptionAnswerTask` (the section of an answerer SFT config: held-out
scenes, reference and perturbed captions): letter accuracy against the exact caption reader
(`jaxrl.rewards.scene_answerer`), on unchanged and on perturbed captions and where the reader says "cannot be
answered". Then the CapRL reward itself on held-out caption-task records, with the model and with the rule as
the answerer, on the reference captions and on perturbed ones: mean reward and mean |difference|.

  python scripts/caprl_answerer_check.py --config configs/sft_caprl_answerer_tiny.yaml \
      --model runs/sft_caprl_answerer_tiny/hf --n 512 --captions 64
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

import numpy as np
import yaml

from jaxrl import data as data_lib
from jaxrl import rewards


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True, help="answerer SFT config with data.caption_answer_task")
  ap.add_argument("--model", required=True, help="the answerer's HF directory")
  ap.add_argument("--n", type=int, default=512, help="held-out answerer prompts")
  ap.add_argument("--captions", type=int, default=64, help="held-out caption-task records for the reward check")
  ap.add_argument("--concurrency", type=int, default=64)
  ap.add_argument("--out", default=None, help="write the numbers as JSON here")
  args = ap.parse_args()

  with open(args.config) as f:
    section = dict(yaml.safe_load(f)["data"]["caption_answer_task"])
  cap_cfg = rewards.CapRLConfig(**section.pop("answerer", {}))
  task = rewards.CaptionAnswerTask(**{**section, "n_heldout": args.n}, answerer=cap_cfg)
  judge = rewards.get_judge({"launch": {"model": args.model, "platform": "cpu"},
                             "max_concurrency": args.concurrency, "max_retries": 1})
  chat = rewards.as_chat(judge)
  t0 = time.time()

  records = task.records("heldout")
  reference = {r["caption"] for r in data_lib.generate_caption_task(
    min(task.scenes, max(args.n, 1)), seed=task.seed, split="heldout", config=task.task)}

  def ask(i_rec):
    i, rec = i_rec
    reply = chat(rec["messages"][:1], max_tokens=cap_cfg.max_tokens, temperature=cap_cfg.temperature, seed=i)
    n_opts = len(rec["messages"][0]["content"].split("Options:\n", 1)[1].split("\n\n", 1)[0].splitlines())
    return rewards.first_option_letter(reply, n_opts)

  with cf.ThreadPoolExecutor(args.concurrency) as pool:
    letters = list(pool.map(ask, enumerate(records)))
  right = np.array([got == rec["letter"] for got, rec in zip(letters, records, strict=True)])
  clean = np.array([rec["caption"] in reference for rec in records])
  unans = np.array([cap_cfg.unanswerable in next(line for line in rec["messages"][0]["content"].splitlines()
                                                  if line.startswith(rec["letter"] + ". ")) for rec in records])
  out = {"prompts": len(records), "letter_acc": float(right.mean()),
         "letter_acc_reference_captions": float(right[clean].mean()), "n_reference": int(clean.sum()),
         "letter_acc_perturbed_captions": float(right[~clean].mean()), "n_perturbed": int((~clean).sum()),
         "letter_acc_cannot_answer": float(right[unans].mean()), "n_cannot_answer": int(unans.sum()),
         "no_letter": int(sum(g is None for g in letters))}

  # The reward itself: model vs rule answerer on held-out caption records, reference and perturbed captions.
  caps = data_lib.generate_caption_task(args.captions, seed=task.seed + 1, split="heldout", config=task.task)
  rng = np.random.default_rng(0)
  for kind in ("reference", "perturbed"):
    texts = [c["caption"] if kind == "reference" else rewards.perturb_caption(c["caption"], rng) for c in caps]

    def score(i, answerer):
      return rewards.caprl_reward("", texts[i], questions=caps[i]["questions"], answerer=answerer,
                                  config=cap_cfg).value

    with cf.ThreadPoolExecutor(8) as pool:
      lm = np.array(list(pool.map(lambda i: score(i, chat), range(len(caps)))))
    rule = np.array([score(i, rewards.scene_answerer) for i in range(len(caps))])
    out[f"reward_{kind}_model"] = float(lm.mean())
    out[f"reward_{kind}_rule"] = float(rule.mean())
    out[f"reward_{kind}_mean_abs_diff"] = float(np.abs(lm - rule).mean())
  out["seconds"] = round(time.time() - t0, 1)
  rewards.close_judges()
  print("| metric | value |\n| --- | --- |")
  for k, v in out.items():
    print(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
