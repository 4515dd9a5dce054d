"""The DPO trainer end to end on the tiny model: packing invariance, reference modes, resume, bad data."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, pref
from jaxrl.cli import main as cli_main

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "dtype": "float32", "param_dtype": "float32"}}


def _cfg(tmp_path, **over):
  base = {
      "model": TINY,
      "data": {"builtin": {"n_train": 200, "n_heldout": 16, "difficulty": 2, "seed": 0}},
      "pairs": 8,
      "packing": {"seq_len": 128, "global_rows": 8},
      "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine"},
      "steps": 4,
      "eval": {"every": 0},
      "out_dir": str(tmp_path / "run"),
      "export_hf": False,
      "tensorboard": False,
  }
  data = config_lib.apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in over.items()])
  return config_lib.from_dict(pref.DPOConfig, data)


@pytest.fixture(scope="module")
def tokenizer():
  return models.load_tokenizer(data_lib.tiny_tokenizer_dir())


def _pairs(tokenizer, n, seed=3):
  task = data_lib.ArithmeticConfig.level(2)
  return [pref.encode_pair(tokenizer, r, f"pairs:{i}")
          for i, r in enumerate(pref.arithmetic_pairs(n, split="train", seed=seed, task=task))]


def test_packing_two_ways_gives_the_same_loss_and_gradients(tokenizer):
  """8 pairs packed tightly into 4 rows of 256 (chosen and rejected mixed across rows, several per row) vs one
  sequence per row in 16 rows of 96: the loss and every gradient agree."""
  model = models.ModelSource(**TINY).build()
  graphdef, params = nnx.split(model)
  pairs = _pairs(tokenizer, 8)
  rng = np.random.default_rng(0)
  ref = rng.normal(-40.0, 3.0, size=(8, 2)).astype(np.float32)  # a reference unlike the policy
  loss_fn = pref.pref_loss_fn(graphdef, pref.PrefLoss(name="sigmoid", beta=0.1, chunk_size=32), "batch")
  grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, pref.pref_prepare(b))[0]))
  out = []
  for rows, seq_len, method in ((4, 256, "best_fit"), (16, 96, "none")):
    arrays = pref.pair_batch(pairs, micro_batches=1, rows=rows, seq_len=seq_len, method=method)
    if method == "best_fit":
      assert (arrays["segment_ids"].max(axis=1) >= 2).all()  # really packed (several sequences a row)
    arrays["ref_chosen"], arrays["ref_rejected"] = ref[:, 0], ref[:, 1]
    out.append(grad(params, {k: jnp.asarray(v) for k, v in arrays.items()}))
  (loss_a, grads_a), (loss_b, grads_b) = out
  assert abs(float(loss_a) - np.log(2.0)) > 1e-3  # not the trivial policy == reference value
  np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_nll_coef_adds_the_chosen_per_token_nll(tokenizer):
  """RPO: loss.nll_coef = α adds α·Σ_pairs w·(-log π(y_w) / |y_w|) to the DPO loss (w the pair weight)."""
  model = models.ModelSource(**TINY).build()
  graphdef, params = nnx.split(model)
  arrays = pref.pair_batch(_pairs(tokenizer, 8), micro_batches=1, rows=8, seq_len=128, method="best_fit")
  ref = np.random.default_rng(1).normal(-40.0, 3.0, size=(8, 2)).astype(np.float32)
  arrays["ref_chosen"], arrays["ref_rejected"] = ref[:, 0], ref[:, 1]
  batch = pref.pref_prepare({k: jnp.asarray(v) for k, v in arrays.items()})
  dpo, rpo = (pref.pref_loss_fn(graphdef, pref.PrefLoss(name="sigmoid", beta=0.1, chunk_size=32, nll_coef=a),
                                "batch")(params, batch)[0] for a in (0.0, 0.5))
  chosen, _ = pref.pair_logps(nnx.merge(graphdef, params), batch, 32)
  nll = -np.asarray(chosen) / np.asarray(arrays["chosen_lengths"])
  assert (nll > 0).all()
  expected = 0.5 * float(np.sum(np.asarray(batch["pair_weight"]) * nll))
  np.testing.assert_allclose(float(rpo) - float(dpo), expected, rtol=1e-5)


def test_nll_coef_is_refused_where_it_does_not_apply():
  for name in ("bradley_terry", "kto", "orpo"):
    with pytest.raises(ValueError, match="nll_coef"):
      pref.PrefLoss(name=name, nll_coef=0.1)
  with pytest.raises(ValueError, match="nll_coef"):
    pref.PrefLoss(name="sigmoid", nll_coef=-1.0)


def test_micro_batches_give_the_same_losses(tmp_path):
  """One global batch of 16 pairs, or two micro-batches of 8 (each packed into its own 8 rows): same losses,
  step 2 included (after one update)."""
  over = {"steps": 2, "pairs": 16, "packing": {"seq_len": 128, "global_rows": 16},
          "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}}
  one = pref.DPOTrainer(_cfg(tmp_path / "a", **over)).run()["history"]
  two = pref.DPOTrainer(_cfg(tmp_path / "b", micro_batches=2, **over)).run()["history"]
  # Step 1's gradient (its norm) agrees tightly; step 2's loss within Adam's first, sign-like update, which turns
  # float-rounding differences of near-zero gradient entries into whole-lr steps (measured: 1.5e-4 relative).
  np.testing.assert_allclose(one[0]["grad_norm"], two[0]["grad_norm"], rtol=1e-5)
  assert abs(one[1]["loss"] - np.log(2.0)) > 1e-3, one
  np.testing.assert_allclose(one[1]["loss"], two[1]["loss"], rtol=1e-3)


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora-base"])
def test_reference_in_step_and_precomputed_give_the_same_losses(tmp_path, lora):
  """Step 1 (policy = reference: log 2) and step 2 (after one update) agree between the live reference (a frozen
  copy; under LoRA the base with adapters off) and the reference precomputed once per pair."""
  over = {"steps": 2, "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}}
  if lora:
    over["lora"] = {"rank": 4, "alpha": 8.0}
  live = pref.DPOTrainer(_cfg(tmp_path / "a", reference="model", **over)).run()["losses"]
  cached = pref.DPOTrainer(_cfg(tmp_path / "b", reference="precompute", **over)).run()["losses"]
  np.testing.assert_allclose(live[0], np.log(2.0), rtol=1e-6)
  assert abs(live[1] - np.log(2.0)) > 1e-4, live  # the second step really differs from the reference
  np.testing.assert_allclose(live, cached, rtol=1e-5)


def test_resume_after_kill_matches_uninterrupted_run_bitwise(tmp_path):
  straight = pref.DPOTrainer(_cfg(tmp_path / "a", steps=4))
  straight.run()
  cfg = _cfg(tmp_path / "b", steps=4, checkpoint={"every": 2, "keep": 2})
  first = pref.DPOTrainer(cfg).run(until=2)
  assert first["stopped_at"] == 2
  resumed_trainer = pref.DPOTrainer(cfg)
  resumed = resumed_trainer.run()  # a fresh process would do exactly this: resume=auto
  assert resumed["start_step"] == 2
  for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed_trainer.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_jsonl_line_is_one_line_error_with_file_and_line(tmp_path, tokenizer, capsys):
  path = tmp_path / "pairs.jsonl"
  good = {"prompt": "1+1=?", "chosen": "1+1=2. Answer: 2", "rejected": "1+1=3. Answer: 3"}
  chat = {"prompt": [{"role": "user", "content": "2+2=?"}], "chosen": [{"role": "assistant", "content": "4"}],
          "rejected": "5"}
  path.write_text(json.dumps(good) + "\n" + json.dumps(chat) + "\n" + json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
  with pytest.raises(data_lib.DataError, match=rf"{path}:3: missing field\(s\) \['rejected'\]"):
    pref.read_pairs((str(path),), tokenizer)
  path.write_text(json.dumps(good) + "\n{not json\n")
  with pytest.raises(data_lib.DataError, match=rf"{path}:2: malformed JSON"):
    pref.read_pairs((str(path),), tokenizer)
  cfg_path = tmp_path / "dpo.yaml"
  cfg_path.write_text(json.dumps({"model": TINY, "data": {"train": [str(path)]}, "out_dir": str(tmp_path / "run"),
                                  "tensorboard": False}))
  assert cli_main(["dpo", "--config", str(cfg_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"{path}:2" in err[0], err


@pytest.mark.parametrize("seed", [0])
def test_dpo_lowers_the_loss_and_raises_reward_accuracy_on_its_pairs(tmp_path, seed):
  """The same 8 train pairs every step (n_train = pairs): DPO must fit them. Seeds 0, 1, 2 gave loss
  0.693 -> (mean of the last 3 steps) 0.0013 / 0.036 / 0.014 and reward accuracy 1.0 on each of the last 3
  steps (recorded in docs/pref.md);
  held-out reward accuracy of this random-init model stays near chance in so few steps, so it is not asserted."""
  cfg = _cfg(tmp_path, steps=10, data={"builtin": {"n_train": 8, "n_heldout": 16, "difficulty": 2, "seed": seed}},
             model=dict(TINY, seed=seed), optim={"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
             loss={"beta": 0.5})
  trainer = pref.DPOTrainer(cfg)
  out = trainer.run()
  rows = out["history"]
  assert np.mean(out["losses"][-3:]) < 0.3, out["losses"]
  assert np.mean([r["accuracy"] for r in rows[-3:]]) >= 0.75, rows
