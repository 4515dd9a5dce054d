"""Per-process host state in checkpoints: each process's data-iterator state and data-file fingerprint
are saved (``train.gather_process_states``) and each process restores its own
(``train.own_process_state``); a checkpoint from another process count restores only when the entries
agree; SFT refuses to checkpoint processes whose data positions or data files differ. The two-process
end-to-end run is ``test_multiprocess_fault.py`` (it also checks the saved layout)."""

import jax
import pytest

from jaxrl import data as data_lib
from jaxrl import train
from jaxrl.sft import _trainer as sft_trainer

A = {"parent": {"next_index": 5}, "emitted": 1, "counters": [3, 0, 0, [], []]}
B = {"parent": {"next_index": 7}, "emitted": 0, "counters": [4, 1, 0, [2], []]}


def _as_process(monkeypatch, index, count):
  monkeypatch.setattr(jax, "process_index", lambda: index)
  monkeypatch.setattr(jax, "process_count", lambda: count)


@pytest.mark.parametrize("index", [0, 1])
def test_each_process_restores_its_own_state(monkeypatch, index):
  _as_process(monkeypatch, index, 2)
  assert train.own_process_state([A, B], step=3, what="the data-iterator state") == [A, B][index]


def test_another_process_count_restores_only_agreeing_states(monkeypatch):
  _as_process(monkeypatch, 0, 1)
  assert train.own_process_state([A, A], step=3, what="x") == A
  _as_process(monkeypatch, 3, 4)
  assert train.own_process_state([B, B], step=3, what="x") == B
  with pytest.raises(train.CheckpointError, match=r"checkpoint step 3: the data-iterator state was saved by 2 "
                                                   r"processes and differs between them.*this run's 4; resume on 2"):
    train.own_process_state([A, B], step=3, what="the data-iterator state")
  # Fingerprints compare by contents (the paths differ per process with built-in data).
  files = [{"run/data/train.jsonl": [10, 1]}, {"run/processes/1/data/train.jsonl": [10, 1]}]
  assert train.own_process_state(files, step=3, what="f", key=lambda f: list(f.values())) == files[0]
  assert train.own_process_state(A, step=3, what="x") == A  # one state for all (older checkpoints)
  assert train.own_process_state(None, step=3, what="x") is None


def test_one_process_gathers_its_own_state_keeping_key_order():
  got = train.gather_process_states({"data": A, "files": {"b.jsonl": [1, 2], "a.jsonl": [3, 4]}})
  assert got == [{"data": A, "files": {"b.jsonl": [1, 2], "a.jsonl": [3, 4]}}]
  assert list(got[0]["files"]) == ["b.jsonl", "a.jsonl"]  # fingerprints are matched in order


def test_sft_refuses_to_checkpoint_processes_that_read_different_data():
  files = {"run/data/train.jsonl": [120, 0xABC]}
  mine = {"run/processes/1/data/train.jsonl": [120, 0xABC]}
  sft_trainer._check_same_data([{"data": A, "files": files}, {"data": A, "files": mine}], step=4)  # agree
  with pytest.raises(data_lib.DataError, match=r"step 4: process 1's data-iterator state differs from process 0's"):
    sft_trainer._check_same_data([{"data": A, "files": files}, {"data": B, "files": mine}], step=4)
  other = {"run/processes/1/data/train.jsonl": [121, 0xDEF]}
  with pytest.raises(data_lib.DataError, match=r"run/processes/1/data/train.jsonl: process 1's copy differs from "
                                               r"process 0's run/data/train.jsonl \(121 bytes"):
    sft_trainer._check_same_data([{"data": A, "files": files}, {"data": A, "files": other}], step=4)
  with pytest.raises(data_lib.DataError, match=r"step 4: process 1 reads 2 data file\(s\)"):
    sft_trainer._check_same_data([{"data": A, "files": files}, {"data": A, "files": {**mine, "x": [1, 2]}}], step=4)
