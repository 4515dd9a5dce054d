"""Scripted environments for the agentic-RL tests (importable by name, like ``rl_testlib``)."""

from jaxrl import envs

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}


@envs.register_env("scripted_tools")
class ScriptedTools(envs.Env):
  """Answers the first ``observations`` turns with a tool message whatever the policy wrote; then
  ends with a reward that depends on the last turn's text (so groups have spread)."""

  def __init__(self, *, observations: int = 2):
    self.observations = observations

  def reset(self, record):
    self.turn, self.calls = 0, 0
    return [{"role": "user", "content": record["prompt"]}]

  def step(self, turn):
    self.turn += 1
    if self.turn <= self.observations:
      self.calls += 1
      return envs.StepResult([{"role": "tool", "content": f"result {self.turn}"}], 0.0, False, {})
    return envs.StepResult(None, float(sum(map(ord, turn)) % 5) / 4.0, True, {})

  def metrics(self):
    return {"tool_calls": float(self.calls)}


class Hang:
  """A tool that never returns (writes its worker's pid first)."""

  name, description, parameters = "hang", "never returns", {"pid_file": (str, True)}

  def __call__(self, *, pid_file):
    import os
    import time
    with open(pid_file, "w") as f:
      f.write(str(os.getpid()))
    while True:
      time.sleep(1.0)


class Crash:
  """A tool that kills the process it runs in."""

  name, description, parameters = "crash", "exits its process", {}

  def __call__(self):
    import os
    os._exit(3)


def perturb_tool_tokens(batch: dict, seed: int = 0):
  """``(tool, bad)``: the tool-output positions of a packed batch (inside a sequence, not trained) and
  the batch with their per-token training signals perturbed (targets, advantages, sampler and old
  log-probs); their values as context for later policy tokens are the trajectory itself and stay."""
  import jax.numpy as jnp
  import numpy as np
  tool = (np.asarray(batch["segment_ids"]) > 0) & (np.asarray(batch["loss_mask"]) == 0)
  rng = np.random.default_rng(seed)
  noise = lambda: jnp.asarray(np.where(tool, rng.normal(size=tool.shape) * 10, 0), jnp.float32)
  bad = dict(batch, targets=jnp.where(tool, (batch["targets"] + 7) % 100, batch["targets"]),
             advantages=batch["advantages"] + noise(), sampler_logprobs=batch["sampler_logprobs"] + noise(),
             old_logprobs=batch["old_logprobs"] + noise())
  return tool, bad
