"""Issue 21: an SFT run killed after its final checkpoint (before the export), or after a checkpoint taken
once the data iterator has wrapped into its next epoch, restarts, finishes and exports the uninterrupted
run's weights."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl import config as config_lib
from jaxrl import models, sft

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


class Crash(Exception):
  pass


def _cfg(out_dir):
  base = {
      "model": TINY,
      # 12 short records per epoch, 8 rows of 64 tokens per batch: every step wraps into a new epoch.
      "data": {"builtin": {"n_train": 12, "n_heldout": 4, "difficulty": 2, "seed": 0}},
      "packing": {"seq_len": 64, "global_rows": 8, "buffer_size": 4},
      "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine"},
      "steps": 4,
      "eval": {"every": 0, "exact_match": 0},
      "checkpoint": {"every": 2, "keep": 2},
      "out_dir": str(out_dir),
      "tensorboard": False,
  }
  return config_lib.from_dict(sft.SFTConfig, config_lib.apply_overrides(base, []))


def _weights(out_dir):
  return {k: v for f in sorted((out_dir / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_restart_after_an_epoch_wrapping_and_the_final_checkpoint_finishes(tmp_path, monkeypatch):
  straight = sft.SFTTrainer(_cfg(tmp_path / "a")).run()
  cfg = _cfg(tmp_path / "b")
  first = sft.SFTTrainer(cfg).run(until=2)  # killed right after step 2's checkpoint (past an epoch's end)
  assert first["stopped_at"] == 2

  def crash(*args, **kwargs):
    raise Crash("killed between the final checkpoint and the export")
  monkeypatch.setattr(models, "save_pretrained", crash)
  with pytest.raises(Crash):
    sft.SFTTrainer(cfg).run()  # resumes at 2, trains 3-4, checkpoints step 4, dies before exporting
  monkeypatch.undo()
  out = sft.SFTTrainer(cfg).run()  # resumes at the last step: no step left, the export and results remain
  assert out["start_step"] == 4 and out["steps"] == 4 and out["packing"] is None
  assert json.loads((tmp_path / "b" / "results.json").read_text())["hf_dir"] == str(tmp_path / "b" / "hf")
  np.testing.assert_allclose(first["losses"], straight["losses"][:2], rtol=1e-6)
  want, got = _weights(tmp_path / "a"), _weights(tmp_path / "b")
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
