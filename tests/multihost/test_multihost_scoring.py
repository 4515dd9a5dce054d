"""The reward model and the implicit PRM on two local processes × 4 CPU devices: each process scores its own
samples (3 on one, 11 on the other, so one process runs padding batches while the other still has samples),
and gets exactly the scores one process × 8 devices gives for the same samples of the same saved models; and
``jaxrl rl`` rewarded by both trains on two processes as on one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from multihost_testlib import ROOT, assert_same_metrics, free_port, wait_json, worker_env
from safetensors.numpy import load_file

from jaxrl import data as data_lib
from jaxrl import models, pref

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("scoring_worker.py")
TIMEOUT = 300  # a hang (a process left in a collective) fails here
TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "dtype": "float32", "param_dtype": "float32"}}


def _perturbed(model, seed: int, scale: float):
  """``model`` with every floating parameter moved by N(0, scale²) noise (a stand-in for a DPO-trained policy)."""
  graphdef, state = nnx.split(model)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A saved reward model (tiny trunk, random head) and a PRM's policy (perturbed) and reference."""
  root = tmp_path_factory.mktemp("scoring")
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  vm = models.ValueModel(models.ModelSource(**TINY).build())
  vm.value_head[...] = jnp.asarray(np.random.default_rng(1).normal(0, 1.0, vm.value_head[...].shape), jnp.float32)
  vm.value_bias[...] = jnp.asarray(-0.2, jnp.float32)
  pref.export_reward_model(vm, root / "rm", tokenizer=tok)
  reference = models.ModelSource(**TINY).build()
  models.save_pretrained(_perturbed(reference, seed=1, scale=0.05), root / "policy", tokenizer=tok)
  models.save_pretrained(reference, root / "reference", tokenizer=tok)
  return root


def _run(processes: int, model_dir) -> list[dict]:
  port, local = free_port(), 8 // processes
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(processes), str(i), str(local), str(port),
                             str(model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(), cwd=ROOT)
           for i in range(processes)]
  return wait_json(procs, TIMEOUT)


def _close(got, want, what):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-5, atol=1e-6,
                             err_msg=what)


def test_two_processes_with_different_sample_counts_score_like_one(model_dir):
  (single,) = _run(1, model_dir)
  pair = _run(2, model_dir)
  assert [r["processes"] for r in pair] == [2, 2] and all(r["devices"] == 8 for r in pair)
  assert single["local_rows"] == 8 and [r["local_rows"] for r in pair] == [4, 4]
  assert [len(r["rm_last"]) for r in pair] == [3, 11]
  assert [r["rm_batches"] for r in pair] == [1, 2], pair  # process 0 runs a padding batch
  for key in ("rm_last", "rm_mean", "rm_after_error"):
    assert np.std(single[key]) > 1e-3, key  # the scores differ between samples: a mix-up would show
    _close(pair[0][key] + pair[1][key], single[key], key)
  assert pair[0]["rm_none_or_all"] == []
  _close(pair[1]["rm_none_or_all"], single["rm_none_or_all"], "rm_none_or_all")
  _close(single["rm_none_or_all"], single["rm_last"], "one process: the same samples, the same scores")
  for key in ("prm_tokens", "prm_steps"):
    got, want = pair[0][key] + pair[1][key], single[key]
    assert [len(q) for q in got] == [len(q) for q in want], key
    _close(np.concatenate(got), np.concatenate(want), key)
    assert np.abs(np.concatenate(want)).max() > 1e-2, key  # the policy's perturbation shows
  # A sample that does not fit on process 1: it raises its own error, process 0 one naming process 1
  assert single["error"] is None
  assert "longer than reward.model.seq_len=80" in pair[1]["error"], pair[1]["error"]
  assert "process(es) [1] could not encode" in pair[0]["error"], pair[0]["error"]
  assert single["refused"] is None
  assert all("contiguous block of 8/2 rows" in r["refused"] for r in pair), pair[0]["refused"]


TRAINER = Path(__file__).with_name("trainer_worker.py")
RL = ["steps=1", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8", "data.builtin.n_train=8",
      "data.builtin.n_heldout=8", "micro_batch.token_budget=384", "micro_batch.row_len=48",
      "eval.every=1", "eval.prompts=5", "export_hf=true", "tensorboard=false", "checkpoint.every=0",
      "rollout.reward_overlap_chunks=2"]
"""configs/grpo_tiny.yaml shortened (as tests/multihost/test_multihost_trainers.py), rewarded by the saved reward model
plus the implicit PRM's dense reward, each rollout scored in two chunks (two reward-model calls a round), and 5
held-out prompts (an uneven split over the processes, scored by the reward model too)."""


def _rl(processes: int, out_dir, model_dir) -> list[dict]:
  port, local = free_port(), 8 // processes
  extra = [f"reward.model.path={model_dir / 'rm'}", "reward.model.rows=8", "reward.model.seq_len=128",
           f"reward.implicit_prm.policy={model_dir / 'policy'}",
           f"reward.implicit_prm.reference={model_dir / 'reference'}",
           "reward.implicit_prm.beta=0.5", "reward.implicit_prm.coef=0.7", "reward.implicit_prm.rows=8",
           "reward.implicit_prm.seq_len=48", f"out_dir={out_dir}"]
  procs = [subprocess.Popen([sys.executable, str(TRAINER), "rl", str(processes), str(i), str(local), str(port), "0",
                             str(ROOT / "configs" / "grpo_tiny.yaml"), *RL, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(), cwd=ROOT)
           for i in range(processes)]
  return wait_json(procs, 1200)


def test_rl_with_reward_model_and_implicit_prm_on_two_processes_trains_like_one(tmp_path, model_dir):
  """``jaxrl rl`` with ``reward.model`` and ``reward.implicit_prm``: two processes × 4 devices log the metrics and
  export the weights of one process × 8 devices."""
  _rl(1, tmp_path / "single", model_dir)
  pair = _rl(2, tmp_path / "pair", model_dir)
  assert all(r["processes"] == 2 and r["rc"] == 0 for r in pair)
  skip = ("time_", "tok_s/", "tok/s", "mfu", "train/micro_batches", "train/pack_efficiency", "padding")
  want = assert_same_metrics(tmp_path / "pair", tmp_path / "single", skip=skip)
  assert "reward/prm_mean" in want[1] and "eval/reward_mean" in want[1], want
  assert want[1]["reward/std"] > 1e-3  # the reward model's scores differ between samples
  a, b = (load_file(str(Path(d) / "hf" / "model.safetensors")) for d in (tmp_path / "pair", tmp_path / "single"))
  assert a.keys() == b.keys()
  for k in b:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
