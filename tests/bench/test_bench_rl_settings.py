"""``jaxrl bench rl``'s equal settings: one settings object mapped onto each framework's configuration.

Each mapping is checked against what that framework's knob means (TRL ``gradient_checkpointing``,
``dapo`` = token mean, ``num_iterations``; Tunix ``RematConfig``, ``token-mean``; jaxrl's ``RLConfig`` built
from the mapped sections), with every work-changing setting flipped once so a mapping that ignores a
setting fails. The peers' own libraries are absent in CI: their scripts' pure helpers are loaded alone.
"""

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

from jaxrl import config as config_lib
from jaxrl import models, rl
from jaxrl.bench import rl as bench_rl
from jaxrl.bench import rl_settings

BATCH = dict(n_prompts=8, samples=8, prompt_tokens=32, new_tokens=64)
VARIANTS = [rl_settings.RLBenchSettings(threads=2),
            rl_settings.RLBenchSettings(threads=1, remat=True, dtype="bfloat16", kl_coef=0.04, micro_batches=2)]


def _script(name):
  spec = importlib.util.spec_from_file_location(f"_rl_{name}", bench_rl.PEERS[name][0])
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)  # stdlib imports only at module level
  return mod


def _jaxrl_cfg(msg, tmp_path):
  m = rl_settings.jaxrl_config(msg, **BATCH)
  data = {"model": {"preset": "tiny", "overrides": m["model_overrides"]},
          "data": {"max_prompt_tokens": BATCH["prompt_tokens"]},
          "rollout": {"prompts_per_step": BATCH["n_prompts"], "n": BATCH["samples"],
                      "max_new_tokens": BATCH["new_tokens"]},
          "algorithm": m["algorithm"], "micro_batch": m["micro_batch"], "out_dir": str(tmp_path)}
  cfg = config_lib.from_dict(rl.RLConfig, data)
  return cfg, cfg.model.config()


@pytest.mark.parametrize("st", VARIANTS, ids=["default", "flipped"])
def test_every_framework_maps_the_same_settings(st, tmp_path):
  msg = st.to_message()
  rows = BATCH["n_prompts"] * BATCH["samples"]
  # jaxrl: the RLConfig built from the mapped sections, read back, says the same as the message.
  cfg, model_cfg = _jaxrl_cfg(msg, tmp_path)
  assert model_cfg.remat == ("full" if st.remat else "none") and model_cfg.dtype == model_cfg.param_dtype == st.dtype
  assert cfg.algorithm.kl_coef == st.kl_coef and cfg.algorithm.aggregation == "token_mean"
  assert cfg.micro_batch.token_budget * st.micro_batches == rows * 96  # per micro-batch tokens
  if not st.remat:  # the log-prob head as one un-rematerialised chunk, as the peers' full logits
    assert cfg.algorithm.logprob_chunk_size >= cfg.micro_batch.token_budget
  applied = rl_settings.jaxrl_applied(cfg, model_cfg)
  rl_settings.check_applied("jaxrl", dict(msg, threads=applied["threads"]), applied)
  # TRL: the GRPOConfig arguments that carry each setting.
  trl = _script("trl").trl_config_kwargs(msg, n_prompts=BATCH["n_prompts"], samples=BATCH["samples"])
  assert trl["gradient_checkpointing"] is st.remat and trl["bf16"] is (st.dtype == "bfloat16")
  assert trl["beta"] == st.kl_coef and trl["loss_type"] == "dapo" and trl["num_iterations"] == 1
  assert trl["gradient_accumulation_steps"] == st.micro_batches == trl["steps_per_generation"]  # no π_old pass
  assert trl["per_device_train_batch_size"] * st.micro_batches == rows
  # Tunix: model remat/dtype, the micro-batch split of the prompts, the algorithm.
  tx = _script("tunix").tunix_config_kwargs(msg, n_prompts=BATCH["n_prompts"])
  assert tx["model"] == dict(remat_config="BLOCK" if st.remat else "NONE", dtype=st.dtype, param_dtype=st.dtype)
  assert tx["training"]["mini_batch_size"] // tx["training"]["train_micro_batch_size"] == st.micro_batches
  assert tx["algo"] == dict(beta=st.kl_coef, loss_agg_mode="token-mean", num_iterations=1)


def test_peer_read_back_of_their_configs():
  msg = VARIANTS[1].to_message()
  tunix = _script("tunix")
  model_cfg = SimpleNamespace(remat_config=SimpleNamespace(name="BLOCK"), dtype="bfloat16", param_dtype="bfloat16")
  training = SimpleNamespace(mini_batch_size=8, train_micro_batch_size=4)
  algo = SimpleNamespace(beta=0.04, loss_agg_mode="token-mean", num_iterations=1)
  got = tunix.tunix_applied(model_cfg, training, algo)
  rl_settings.check_applied("tunix", dict(msg, threads=got["threads"]), got)
  with pytest.raises(ValueError, match=r"the tunix worker runs with other settings: remat=False \(sent True\)"):
    model_cfg.remat_config = SimpleNamespace(name="NONE")
    rl_settings.check_applied("tunix", dict(msg, threads=got["threads"]), tunix.tunix_applied(model_cfg, training,
                                                                                              algo))


def test_check_applied_names_the_framework_and_key():
  msg = VARIANTS[0].to_message()
  rl_settings.check_applied("trl", msg, dict(msg))
  with pytest.raises(ValueError, match=r"^bench rl: the trl worker runs with other settings: threads=4 \(sent 2\)$"):
    rl_settings.check_applied("trl", msg, dict(msg, threads=4))
  with pytest.raises(ValueError, match="reported no applied settings"):
    rl_settings.check_applied("trl", msg, None)


def test_settings_reject_what_no_framework_maps():
  with pytest.raises(ValueError, match="ppo_epochs must be 1"):
    rl_settings.RLBenchSettings(ppo_epochs=2)
  with pytest.raises(ValueError, match="dtype must be"):
    rl_settings.RLBenchSettings(dtype="float16")
  st = VARIANTS[1]
  assert rl_settings.RLBenchSettings.from_message(st.to_message()) == st
  assert dataclasses.asdict(st).keys() <= st.to_message().keys()
  assert "remat on, 1 CPU threads, bfloat16" in st.header(64, 64)
