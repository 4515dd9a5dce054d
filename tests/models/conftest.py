"""Session fixtures for the model tests."""

import jax.numpy as jnp
import numpy as np
import pytest
from model_testlib import FIXTURE_NAMES, HF_FIXTURES, flat_arrays, logits_and_grads, o1_model, packed_batch

from jaxrl import models


@pytest.fixture(scope="session")
def fixture_models():
  """Each HF fixture loaded once in float32 (scanned layers)."""
  return {name: models.load_pretrained(HF_FIXTURES / name, dtype="float32") for name in FIXTURE_NAMES}


@pytest.fixture(scope="session")
def grad_reference():
  """TEST_CFG model on one device with its logits and gradients on :func:`packed_batch`."""
  model = o1_model()
  logits, grads = logits_and_grads(model, *map(jnp.asarray, packed_batch()))
  assert float(jnp.abs(logits).max()) > 1.0
  return model, np.asarray(logits), flat_arrays(grads)
