"""One process of the multi-host trainer tests: ``jaxrl rl`` / ``jaxrl sft`` on a few fake CPU devices.

Run as ``python trainer_worker.py KIND NUM_PROCESSES PROCESS_ID LOCAL_DEVICES PORT UNTIL CONFIG [key=value ...]``
with KIND ``rl`` or ``sft``. ``UNTIL`` 0 runs the command line (``jaxrl.cli.main``); ``UNTIL`` > 0 stops
after that step as a pre-emption would (``Trainer.run(until=...)``). The last stdout line is JSON with
the prompt indices this process generated for, per round, and that round's tokens and log-probs (RL).
"""

import json
import sys

from multihost_testlib import configure_process

kind, num_processes, process_id, local_devices, port, until = sys.argv[1], *(int(a) for a in sys.argv[2:7])
config, overrides = sys.argv[7], sys.argv[8:]
configure_process(num_processes, process_id, local_devices, port)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxrl import cli, sharding  # noqa: E402
from jaxrl import config as config_lib  # noqa: E402
from jaxrl.rl import _source  # noqa: E402

rounds: list[list[int]] = []
rollouts: list[dict] = []
_generate = _source.EngineRollout.generate


def _recording_generate(self, sampler, idx, request_ids, **kwargs):
  rounds.append([int(i) for i in idx])
  rollout, info = _generate(self, sampler, idx, request_ids, **kwargs)
  rollouts.append({"tokens": rollout.tokens.tolist(), "logprobs": rollout.logprobs.tolist()})
  return rollout, info


_source.EngineRollout.generate = _recording_generate

if until == 0:
  rc = cli.main([kind, "--config", config, *overrides])
else:
  sharding.initialize()
  if kind == "rl":
    from jaxrl.rl import RLConfig as Config, RLTrainer as Trainer
  else:
    from jaxrl.sft import SFTConfig as Config, SFTTrainer as Trainer
  trainer = Trainer(config_lib.load(Config, config, overrides))
  try:
    trainer.run(until=until)
  finally:
    if hasattr(trainer, "close"):
      trainer.close()
  rc = 0
print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                  "rounds": rounds, "rollouts": rollouts, "rc": rc}), flush=True)
sys.exit(rc)
