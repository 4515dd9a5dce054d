"""Shared fixtures of the agentic-RL tests: the tiny tokenizer, a tiny random model and its sampler."""

import pytest

from jaxrl import data as data_lib
from jaxrl import models, sampling

import envs_testlib  # noqa: F401  registers the scripted environments


@pytest.fixture(scope="session")
def tiny_tokenizer():
  return models.load_tokenizer(str(data_lib.tiny_tokenizer_dir()))


@pytest.fixture(scope="session")
def tiny_model():
  return models.init_model(models.ModelConfig.tiny(**envs_testlib.TINY), seed=0)


@pytest.fixture(scope="session")
def tiny_sampler(tiny_model, tiny_tokenizer):
  # One prompt / completion bucket (64) for every context length below 128: few compilations.
  return sampling.Sampler(tiny_model, tiny_tokenizer, max_len=128, min_bucket=64)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model, tiny_tokenizer):
  # With entropies (ARPO's probe); 4 slots so continuous batching interleaves trajectories.
  return sampling.Engine(tiny_model, tiny_tokenizer, max_len=128, num_slots=4, num_blocks=40, block_size=16,
                         min_bucket=64, entropy=True)
