"""KTO on labelled singles in ``jaxrl dpo``: one step's loss against a float64 numpy recomputation from the
model's own log-probs, the KL sequences, and bad records."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import pref

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                                        "dtype": "float32", "param_dtype": "float32"}}
BETA, LAMBDA_D, LAMBDA_U = 0.5, 1.3, 0.7


def _singles(path, n_pairs=4):
  """Labelled singles from the built-in pairs: the chosen answer desirable, the rejected one not."""
  pairs = pref.arithmetic_pairs(n_pairs, split="train", seed=5, task=data_lib.ArithmeticConfig.level(2))
  with open(path, "w") as f:
    for p in pairs:
      for completion, label in ((p["chosen"], True), (p["rejected"], False)):
        f.write(json.dumps({"prompt": p["prompt"], "completion": completion, "label": label}) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
  """A KTO trainer after one update (so the policy differs from its frozen reference)."""
  tmp = tmp_path_factory.mktemp("kto")
  path = _singles(tmp / "singles.jsonl")
  cfg = config_lib.from_dict(pref.DPOConfig, {
      "model": TINY, "data": {"train": [path], "heldout": [path], "builtin": None}, "pairs": 8,
      "packing": {"seq_len": 256, "global_rows": 8},
      "loss": {"name": "kto", "beta": BETA, "desirable_weight": LAMBDA_D, "undesirable_weight": LAMBDA_U},
      "optim": {"lr": 3e-2, "warmup_steps": 0, "schedule": "constant"}, "steps": 1, "eval": {"every": 0},
      "out_dir": str(tmp / "run"), "export_hf": False, "tensorboard": False})
  trainer = pref.DPOTrainer(cfg)
  trainer.update(trainer.batch(list(range(8))))
  return trainer


def _logp64(model, seqs) -> np.ndarray:
  """``[N]``: Σ over each sequence's completion tokens of log p(token | prefix), log-softmax in float64. Each
  sequence is its own row from position 0, right-padded (causal: the padding changes no earlier logit)."""
  n, width = len(seqs), max(len(s["tokens"]) for s in seqs)
  tokens = np.zeros((n, width), np.int32)  # [N, W]
  for i, s in enumerate(seqs):
    tokens[i, :len(s["tokens"])] = s["tokens"]
  logits = np.asarray(model(tokens, positions=np.tile(np.arange(width), (n, 1)),
                            segment_ids=np.ones((n, width), np.int32)), np.float64)  # [N, W, V]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  out = []
  for i, s in enumerate(seqs):
    length = len(s["tokens"])
    scored = np.asarray(s["loss_mask"], bool)[1:]  # target t + 1 is a completion token
    out.append(logp[i, np.arange(length - 1), tokens[i, 1:length]][scored].sum())
  return np.asarray(out)


def test_kto_eval_loss_equals_float64_numpy(stepped):
  """ℓ = λ_D(1 - σ(β(r - z0))) for desirable, λ_U(1 - σ(β(z0 - r))) for undesirable, r = log π - log π_ref,
  z0 = max(0, mean over the batch of the KL sequences' log π - log π_ref): the trainer's held-out loss and
  accuracy equal this recomputation from each sequence scored alone."""
  policy = stepped.current_model()
  reference = nnx.merge(stepped.graphdef, stepped.ref_inputs[0])
  units = stepped.heldout_pairs
  seqs = [u.chosen for u in units] + [u.rejected for u in units]
  d = _logp64(policy, seqs) - _logp64(reference, seqs)
  r, kl = d[:len(units)], d[len(units):]
  desirable = np.array([u.desirable for u in units])
  z0 = max(0.0, kl.mean())
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  losses = np.where(desirable, LAMBDA_D * (1 - sig(BETA * (r - z0))), LAMBDA_U * (1 - sig(BETA * (z0 - r))))
  ev = stepped.evaluate()
  assert np.abs(r).max() > 1e-2  # the policy has moved off its reference
  np.testing.assert_allclose(ev["eval_loss"], losses.mean(), rtol=1e-5)
  assert ev["eval_accuracy"] == pytest.approx(np.mean(np.where(desirable, r > 0, r < 0)))
  np.testing.assert_allclose(ev["eval_chosen_reward"], np.mean(desirable * BETA * r), rtol=1e-4, atol=1e-7)


def test_kl_sequence_is_the_prompt_with_the_previous_records_completion(stepped):
  units = stepped.train_pairs
  assert [u.desirable for u in units] == [True, False] * 4
  for j in range(len(units)):
    prev, kl = units[j - 1].chosen, units[j].rejected
    answer = lambda s: np.asarray(s["tokens"])[np.asarray(s["loss_mask"], bool)]
    np.testing.assert_array_equal(answer(kl), answer(prev))
    n_prompt = int(np.argmax(np.asarray(units[j].chosen["loss_mask"], bool)))
    np.testing.assert_array_equal(kl["tokens"][:n_prompt], units[j].chosen["tokens"][:n_prompt])


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": "a", "completion": "b", "label": "yes"}', "'label' must be true or false"),
    ('{"prompt": "a", "label": true}', "missing field(s) ['completion']")])
def test_bad_single_is_one_line_error_with_file_and_line(tmp_path, line, reason):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "a", "completion": "b", "label": true}\n' + line + "\n")
  with pytest.raises(data_lib.DataError, match=rf"bad.jsonl:2: .*{re.escape(reason)}"):
    pref.read_kto_units((str(path),), None)
