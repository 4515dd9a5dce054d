"""Issue 21: a run killed after a checkpoint at the end of the prompt stream's epoch, or after its final
checkpoint, restarts and finishes (export, results) with the uninterrupted run's weights."""

import json

import numpy as np
import pytest
from rl_testlib import make_config
from safetensors.numpy import load_file

from jaxrl import models, rl


class Crash(Exception):
  pass


def _run(cfg, **kw):
  trainer = rl.RLTrainer(cfg)
  try:
    return trainer.run(**kw)
  finally:
    trainer.close()


def _weights(out_dir):
  return {k: v for f in sorted((out_dir / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_restart_after_the_epoch_boundary_and_after_the_final_checkpoint_finishes(tmp_path, monkeypatch):
  over = dict(steps=3, data={"builtin": {"n_train": 8, "n_heldout": 8, "difficulty": 2}, "max_prompt_tokens": 32},
              checkpoint={"every": 1, "keep": 3}, export_hf=True)
  _run(make_config(tmp_path / "a", **over))
  cfg = make_config(tmp_path / "b", **over)
  run_dir = tmp_path / "b" / "run"
  _run(cfg, until=2)  # killed right after step 2's checkpoint: 8 prompts, 4 per step = the epoch's end
  host = json.loads((run_dir / "checkpoints" / "2" / "host" / "metadata").read_text())
  assert host["prompts"]["index"] == 8 and host["prompts"]["epoch"] == 0, host

  def crash(*args, **kwargs):
    raise Crash("killed between the final checkpoint and the export")
  monkeypatch.setattr(models, "save_pretrained", crash)
  with pytest.raises(Crash):
    _run(cfg)  # resumes at 2, trains step 3 (next epoch), checkpoints it, then dies
  monkeypatch.undo()
  assert not (run_dir / "hf").exists()
  out = _run(cfg)  # resumes at the last step: nothing to train, the rest of the run's work is done
  assert out["start_step"] == 3 and out["steps"] == 3
  assert json.loads((run_dir / "results.json").read_text())["hf_dir"] == str(run_dir / "hf")
  want, got = _weights(tmp_path / "a" / "run"), _weights(run_dir)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
