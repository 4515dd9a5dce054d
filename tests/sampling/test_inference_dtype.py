"""``jaxrl sample`` and ``jaxrl serve`` load weights in the compute dtype: no float32 master copy."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from sampling_testlib import HF_FIXTURES

from jaxrl import sampling
from jaxrl.cli import sample as sample_cli
from jaxrl.cli import serve as serve_cli


def _dtypes(model) -> set:
  return {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("cli", [sample_cli, serve_cli], ids=["sample", "serve"])
def test_inference_commands_store_weights_in_the_compute_dtype(cli, monkeypatch, capsys):
  seen = []

  class Stop(sampling.Sampler):  # records the model the command built, then stops the command
    def __init__(self, model, *args, **kwargs):
      seen.append(model)
      raise ValueError("stub sampler")

  monkeypatch.setattr(sampling, "Sampler", Stop)
  model_dir = str(HF_FIXTURES / "qwen3")
  args = ["--model", model_dir, "--dtype", "bfloat16"] + (["--prompt", "hi"] if cli is sample_cli else [])
  assert cli.main(args) == 2 and "stub sampler" in capsys.readouterr().err
  assert _dtypes(seen[0]) == {jnp.dtype(jnp.bfloat16)}
  assert cli.main(args + ["--param-dtype", "float32"]) == 2  # the user's override wins
  assert _dtypes(seen[1]) == {jnp.dtype(jnp.float32)} and seen[1].cfg.dtype == "bfloat16"
