"""``reward.model``: the RL trainer scores its samples with a Bradley–Terry reward model on its own mesh."""

import jax.numpy as jnp
import numpy as np
import pytest
from rl_testlib import TINY, make_config

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, pref, rl


@pytest.fixture(scope="module", params=[False, True], ids=["last", "mean-logprob"])
def rm_dir(request, tmp_path_factory):
  """An exported reward model (tiny trunk, random head; read at the last token, or with the log-prob feature at
  α = 0.5 averaged over the answer) and the model itself."""
  logprob = request.param
  vm = pref.reward_value_model(models.ModelSource(**TINY).build(), logprob_feature=logprob)
  rng = np.random.default_rng(1)
  vm.value_head[...] = jnp.asarray(rng.normal(0, 1.0, vm.value_head[...].shape), jnp.float32)
  vm.value_bias[...] = jnp.asarray(-0.2, jnp.float32)
  if logprob:
    vm.logprob_scale[...] = jnp.asarray(0.5, jnp.float32)
  path = tmp_path_factory.mktemp("rm") / "hf"
  pref.export_reward_model(vm, path, tokenizer=models.load_tokenizer(data_lib.tiny_tokenizer_dir()),
                           pooling="mean" if logprob else "last")
  return path, vm


def test_rl_rewards_are_the_reward_model_scores_of_a_direct_forward(tmp_path, rm_dir):
  """The rewards the trainer collects for a chunk of completions equal the reward model run on each
  (prompt, completion) alone: the prompt as its user turn, the completion as the assistant's."""
  path, vm = rm_dir
  cfg = make_config(tmp_path, reward={"model": {"path": str(path), "rows": 8, "seq_len": 64}})
  trainer = rl.RLTrainer(cfg)
  prompts = trainer.train_prompts
  idx, n = [0, 1, 2], 2
  texts = ["3+4=7. Answer: 7", "12", "x", "5*5=25. Answer: 25", "", "1+1=2"]
  got = trainer.rewards.collect(trainer._submit(prompts, idx, n, texts, offset=0)).rewards
  tok = trainer.reward_model.tokenizer
  want = []
  for k, text in enumerate(texts):
    record = prompts.records[idx[k // n]]  # built-in: [user, assistant]; the user turn is the prompt
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
    messages = pref.answer_messages(record["messages"][0]["content"], text)
    seq = data_lib.encode_chat(tok, messages)
    ids = jnp.asarray(seq["tokens"], jnp.int32)[None]
    v = np.asarray(vm(ids, positions=jnp.arange(ids.shape[1])[None], segment_ids=jnp.ones_like(ids))[0], np.float64)
    before_answer = np.asarray(seq["loss_mask"], bool)[1:]  # position t: token t + 1 is an answer token
    want.append(v[:-1][before_answer].mean() if isinstance(vm, pref.LogProbValueModel) else v[-1])
  assert np.std(want) > 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reward_model_and_fn_together_is_a_config_error(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="give reward.fn .* or reward.model, not both"):
    make_config(tmp_path, reward={"fn": "math", "model": {"path": "x"}})
