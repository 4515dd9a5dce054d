"""``jaxrl plan`` traces every platform-dependent choice for its target, not for the CPU host it runs on
(``jaxrl._compile_target.compiling_for``): here the log-prob target logit, a gather of the logits on CPU and
an iota-select reduction on TPU and GPU, read from the lowered programs of a tiny recipe planned for three
targets in one process (so a trace made for one platform is never reused for another)."""

from __future__ import annotations

import re
from pathlib import Path

from jaxrl import plan
from jaxrl._compile_target import compile_platform
from plan_testlib import need

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB = 128  # configs/grpo_tiny.yaml's model


def _gathers_of_logits(text: str) -> int:
  """Gathers whose operand is ``[..., vocab]`` float32 logits (the embedding lookup's is ``[vocab, D]``)."""
  return len(re.findall(rf'"?stablehlo\.gather"?\(.*?: \(tensor<(?:\d+x)*{VOCAB}xf32>', text))


class _Recorded:
  """A program's jitted function whose ``lower`` keeps the lowered module's text."""

  def __init__(self, fn, texts: list[str]):
    self.fn, self.texts = fn, texts

  def lower(self, *args, **kwargs):
    lowered = self.fn.lower(*args, **kwargs)
    self.texts.append(lowered.as_text())
    return lowered


def test_plans_trace_the_target_logit_for_their_targets_platform(monkeypatch):
  """The train step (its loss reads ``token_logprobs``, as the log-prob programs do) of a TPU and an NVIDIA
  plan holds no gather of the logits; the CPU plan's does (its target logit is the gather), planned between
  the two; the host's platform is back after the plans."""
  need("v5p-8")
  need("h100x8")
  texts: dict[str, list[str]] = {}
  target = [""]

  def recording(builder):
    def build(ctx):
      progs = builder(ctx)
      for p in progs:
        p.fn = _Recorded(p.fn, texts.setdefault(target[0], []))
      return progs
    return build

  monkeypatch.setitem(plan.PROGRAMS, "train", recording(plan.PROGRAMS["train"]))
  cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"), ["micro_batch.token_budget=768"])
  for name in ("v5p-8", "cpu", "h100x8"):
    target[0] = name
    result = plan.plan_recipe(cfg, name, programs=("train",))
    assert [r.status for r in result.rows] == ["ok"], plan.format_plan(result)
  assert {name: [_gathers_of_logits(t) for t in ts] for name, ts in texts.items()} == {
      "v5p-8": [0], "cpu": [1], "h100x8": [0]}
  assert compile_platform() == "cpu"
