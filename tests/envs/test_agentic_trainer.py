"""The RL trainer driven by an environment: one ARPO step end to end, and config validation."""

import json

import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import envs

import envs_testlib


def _config(tmp_path, **over):
  base = {
      "model": {"preset": "tiny", "overrides": envs_testlib.TINY},
      "data": {"train": [str(tmp_path / "train.jsonl")], "builtin": None, "max_prompt_tokens": 32},
      "env": {"name": "scripted_tools", "kwargs": {"observations": 1}, "max_turns": 4, "max_turn_tokens": 8},
      "arpo": {"initial_samples": 2, "entropy_tokens": 3, "alpha": 1.0, "beta": 0.0, "branches": 2},
      "rollout": {"prompts_per_step": 2, "n": 4, "max_new_tokens": 48},
      "algorithm": {"advantage": "arpo_hard", "mini_batches": 1},
      "micro_batch": {"token_budget": 640, "row_len": 80},
      "optim": {"lr": 1e-3},
      "steps": 1,
      "eval": {"every": 0},
      "out_dir": str(tmp_path / "run"),
      "tensorboard": False,
  }
  (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}"}) + "\n" for i in range(8)))
  data = config_lib.apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in over.items()])
  return config_lib.from_dict(envs.AgenticRLConfig, data)


def test_one_arpo_step_trains_on_policy_tokens_only(tmp_path):
  trainer = envs.AgenticTrainer(_config(tmp_path))
  try:
    before = [np.asarray(x) for x in __import__("jax").tree.leaves(trainer.state.params)]
    trainer.run()
    after = [np.asarray(x) for x in __import__("jax").tree.leaves(trainer.state.params)]
  finally:
    trainer.close()
  h = trainer.history[-1]
  ro = trainer.last_rollout
  assert ro.num_samples == 8 and np.bincount(ro.group_ids).tolist() == [4, 4]  # M per question
  assert h["agent/tool_calls"] > 0 and h["agent/branch_paths"] == 4  # M − N per question, after tool calls
  assert (ro.prefix_ids >= 0).any()
  assert h["agent/policy_tokens_mean"] == pytest.approx(ro.policy_mask.sum() / ro.num_samples)
  assert np.isfinite(h["loss"]) and any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_engine_multi_turn_grpo_trains_on_policy_tokens_only(tmp_path):
  """Multi-turn GRPO end to end on the continuous-batching engine on the 8-device mesh: finite loss,
  every parameter moves, and the trainer's own packed batch gives a gradient that tool-output
  tokens do not touch (their targets, advantages and log-probs perturbed: the same gradient)."""
  import jax
  import jax.numpy as jnp

  from jaxrl.rl import make_loss_fn, make_prepare
  cfg = _config(tmp_path, **{"arpo": None, "algorithm.advantage": "grpo", "steps": 2,
                             "rollout.engine": {"num_slots": 8, "kv_cache_bytes": 1 << 16, "block_size": 16},
                             "micro_batch": {"token_budget": 1024, "row_len": 128}})
  trainer = envs.AgenticTrainer(cfg)
  try:
    assert trainer.mesh.size == 8
    before = jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, trainer.state.params))
    trainer.run()
    after = jax.tree.leaves(jax.tree.map(np.asarray, trainer.state.params))
    assert isinstance(trainer.sampler, __import__("jaxrl").sampling.Engine)
    ro = trainer.last_rollout
    packed, _ = trainer.pack(ro, 1)
    assert len(packed) == 1 and packed[0].shape[0] == 1
    batch = trainer._device(packed[0].interleaved())
    batch["old_logprobs"] = batch["sampler_logprobs"] - 0.05 * batch["loss_mask"]
    algo = cfg.algorithm
    prepare = make_prepare(algo, num_groups=cfg.rollout.prompts_per_step, max_len=cfg.rollout.max_new_tokens)
    loss_fn = make_loss_fn(trainer.graphdef, algo, temperature=cfg.rollout.temperature, num_micro=1)
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, prepare(b), jnp.asarray(False)), has_aux=True))
    tool, bad = envs_testlib.perturb_tool_tokens(batch)
    (l0, m0), g0 = grad(trainer.state.params, batch)
    (l1, m1), g1 = grad(trainer.state.params, bad)
  finally:
    trainer.close()
  assert tool.sum() > 0 and float(m0["loss_tokens"]) == float(m1["loss_tokens"]) == float(ro.policy_mask.sum())
  assert float(l0) == float(l1)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g0))
  assert ro.num_samples == 8 and (ro.policy_mask.sum(1) < ro.lengths).all()  # every row has tool tokens
  assert all(np.isfinite(h["loss"]) for h in trainer.history) and len(trainer.history) == 2
  assert trainer.history[-1]["agent/tool_calls"] > 0
  for (path, a), b in zip(before, after):
    assert not np.array_equal(a, b), f"parameter {jax.tree_util.keystr(path)} did not change"


def test_config_errors_name_the_key(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="arpo.initial_samples"):
    _config(tmp_path, **{"arpo.initial_samples": 5})
  with pytest.raises(config_lib.ConfigError, match="env.max_turns"):
    _config(tmp_path, **{"env.max_turns": 0})
  assert _config(tmp_path, **{"rollout.engine": {"num_slots": 8, "kv_cache_bytes": 1 << 20}}).arpo.branches == 2
  assert _config(tmp_path, **{"rollout.engine": {"num_slots": 8, "kv_cache_bytes": 1 << 20},
                              "arpo": None}).rollout.engine.num_slots == 8
  with pytest.raises(config_lib.ConfigError, match="unknown config key '(env|arpo)'"):
    config_lib.load(__import__("jaxrl").rl.RLConfig, "configs/agentic_calculator_tiny.yaml")
  cfg = config_lib.load(envs.AgenticRLConfig, "configs/agentic_calculator_tiny.yaml")
  assert cfg.env.name == "tools" and cfg.env.kwargs["tools"] == {"calculator": {}} and cfg.arpo is None
