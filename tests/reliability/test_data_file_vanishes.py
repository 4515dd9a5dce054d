"""A training data file that disappears after the run has indexed it: the run stops with an error
naming the file (``jaxrl sft`` prints it on one line, exit status 2)."""

import yaml

from jaxrl import data as data_lib
from jaxrl import sft

TINY = {"preset": "tiny", "overrides": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def _split_files(tmp_path):
  paths = data_lib.write_arithmetic_splits(tmp_path / "data", n_train=24, n_heldout=4, seed=0,
                                           config=sft.BuiltinData().task)
  lines = paths["train"].read_text().splitlines()
  first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
  first.write_text("\n".join(lines[:12]) + "\n")
  second.write_text("\n".join(lines[12:]) + "\n")
  return first, second


def _cfg(tmp_path, files):
  return {
      "model": TINY, "data": {"train": [str(f) for f in files]},
      "packing": {"seq_len": 64, "global_rows": 16, "buffer_size": 4},
      "steps": 2, "eval": {"every": 0, "exact_match": 0}, "export_hf": False, "tensorboard": False,
      "out_dir": str(tmp_path / "run")}


def test_a_data_file_deleted_mid_run_is_a_one_line_error_naming_it(tmp_path, capsys, monkeypatch):
  from jaxrl import cli
  first, second = _split_files(tmp_path)
  cfg_path = tmp_path / "sft.yaml"
  cfg_path.write_text(yaml.safe_dump(_cfg(tmp_path, [first, second])))
  batches = sft.SFTTrainer._batches

  def open_then_delete(self, paths, *, epochs):
    it = batches(self, paths, epochs=epochs)  # both files indexed, none read yet
    if second.exists():
      second.unlink()
    return it
  monkeypatch.setattr(sft.SFTTrainer, "_batches", open_then_delete)
  assert cli.main(["sft", "--config", str(cfg_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("jaxrl sft: ") and "error" in err[-1] and str(second) in err[-1], err[-3:]
