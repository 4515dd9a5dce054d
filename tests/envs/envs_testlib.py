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
