"""Session fixtures for the sampler tests: the tiny HF fixture models and samplers, built once."""

import numpy as np
import pytest
from sampling_testlib import FIXTURE_NAMES, HF_FIXTURES

from jaxrl import models, sampling


@pytest.fixture(scope="session")
def fixture_models():
  return {name: models.load_pretrained(HF_FIXTURES / name, dtype="float32") for name in FIXTURE_NAMES}


@pytest.fixture(scope="session")
def qwen3_tokenizer():
  return models.load_tokenizer(HF_FIXTURES / "qwen3")


@pytest.fixture(scope="session")
def qwen3_sampler(fixture_models, qwen3_tokenizer):
  """No eos, so completions run to max_new_tokens like the reference (HF generate with eos_token_id=None)."""
  return sampling.Sampler(fixture_models["qwen3"], qwen3_tokenizer, max_len=64, eos_token_ids=[])


@pytest.fixture(scope="session")
def qwen3_reference():
  """HF greedy generate: ``prompt [2, 6]``, ``tokens [2, 16]``."""
  return dict(np.load(HF_FIXTURES / "qwen3" / "generate.npz"))
