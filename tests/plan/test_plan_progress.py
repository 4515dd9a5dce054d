"""``jaxrl plan`` is never silent for long: every phase and every compile says what it does (which program,
which of how many compiles, at how many layers) and how long the plan has run, each row is reported when it
is complete, and anything that runs longer than a minute says so again every minute.

With ``--layers K`` each program compiles twice (K and 2K layers); a real-shape train step takes minutes per
compile on a CPU, so a plan whose second pass was announced with the same line as the first looked hung
(issue 11: DeepCoder-14B on v5p-64 printed nothing for 10 minutes after the "last" compile)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from jaxrl import plan
from jaxrl.plan._progress import Progress

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_layers_plan_announces_every_compile_and_row_before_its_table(capsys):
  # grpo_tiny at 3 layers, one cheap program (the pi_old forward; no KL reference): --layers 1 compiles it
  # at 1 and 2 layers and extrapolates to 3.
  rc = plan.main(["--config", str(CONFIGS / "grpo_tiny.yaml"), "--target", "cpu", "--layers", "1",
                  "--attention", "reference", "--programs", "logprobs", "model.overrides.num_layers=3",
                  "micro_batch.token_budget=768", "algorithm.kl_coef=0.0"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  lines = [ln for ln in err.splitlines() if ln.startswith("plan [")]
  assert all(re.match(r"plan \[ *\d+ s\] ", ln) for ln in lines), lines  # elapsed seconds on every line
  text = "\n".join(lines)
  order = ["planning ", "cpu: 8 devices", "building the abstract model, train state and programs (logprobs) at 3 layers",
           "at 1 of 3 layers", "at 2 of 3 layers", "--layers 1: 2 compiles",
           "compile 1/2: logprobs_old[s0] at 1 of 3 layers", "compiled logprobs_old[s0] in",
           "compile 2/2: logprobs_old[s0] at 2 of 3 layers", "compiled logprobs_old[s0] in",
           "row logprobs_old[s0]: ok, peak", "plan of 1 programs done"]
  at = 0
  for phrase in order:  # in this order
    found = text.find(phrase, at)
    assert found >= 0, (phrase, text)
    at = found + len(phrase)
  assert "extrapolated from 1 and 2 of 3 layers" in out and "| logprobs_old[s0] | ok |" in out, out


def test_a_long_phase_says_it_is_still_running(capsys):
  progress = Progress(every=0.01)
  with progress.running("compiling something big"):
    deadline = time.monotonic() + 60  # waits for the heartbeat, whatever the machine's load
    while (not re.search(r"still running \(\d+ s\): compiling something big", capsys.readouterr().err)
           and time.monotonic() < deadline):
      time.sleep(0.01)
    assert time.monotonic() < deadline, "no heartbeat line while the block ran"
  capsys.readouterr()
  time.sleep(0.05)
  assert "still" not in capsys.readouterr().err  # the heartbeat stops with the block
  quiet = Progress(enabled=False, every=0.01)
  with quiet.running("nothing to say"):
    time.sleep(0.05)
  assert capsys.readouterr().err == ""
