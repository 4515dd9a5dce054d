"""JSONL/Parquet sources: validation, errors naming file:line, the bad-record budget."""

import json

import pytest

from jaxrl.data import DataError, JsonlSource, ParquetSource, open_source

GOOD = [{"prompt": "1+1=?", "completion": "1+1=2. Answer: 2"},
        {"messages": [{"role": "user", "content": "2+2=?"}, {"role": "assistant", "content": "4"}]}]


def _write(path, lines):
  path.write_bytes(b"".join(x if isinstance(x, bytes) else (json.dumps(x) + "\n").encode() for x in lines))
  return path


def test_good_records_are_read_back_with_their_location(tmp_path):
  path = _write(tmp_path / "a.jsonl", [GOOD[0], b"\n", GOOD[1]])
  src = JsonlSource(path)
  assert len(src) == 2
  assert src[1]["messages"] == GOOD[1]["messages"]
  assert src[1]["_where"] == f"{path}:3" and src[1]["_index"] == 1


def test_malformed_json_line_is_an_error_naming_file_and_line(tmp_path):
  path = _write(tmp_path / "a.jsonl", [GOOD[0], GOOD[1], b'{"prompt": "x", \n'])
  with pytest.raises(DataError, match=rf"{path}:3: malformed JSON"):
    JsonlSource(path)


@pytest.mark.parametrize("record,reason", [
    ({"prompt": "1+1=?"}, "missing field 'completion'"),
    ({"prompt": "1+1=?", "completion": ""}, "'completion' is empty"),
    ({"text": "hello"}, "record needs 'messages' or 'prompt'/'completion'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' has no trained assistant turn"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\] is missing field 'content'"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a", "train": "no"}]},
     r"messages\[1\].train must be true or false"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, r"messages\[1\] is a trained assistant turn with empty content"),
])
def test_invalid_record_error_names_line_and_reason(tmp_path, record, reason):
  path = _write(tmp_path / "a.jsonl", [GOOD[0], record])
  with pytest.raises(DataError, match=rf"{path}:2: {reason}"):
    JsonlSource(path)


def test_non_utf8_bytes_are_an_error(tmp_path):
  path = _write(tmp_path / "a.jsonl", [GOOD[0], b'{"prompt": "\xff", "completion": "x"}\n'])
  with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8 \(byte 0xff at column 13\)"):
    JsonlSource(path)


def test_bad_records_within_budget_are_skipped_and_counted(tmp_path):
  path = _write(tmp_path / "a.jsonl", [GOOD[0], b"not json\n", GOOD[1], {"prompt": "x"}])
  src = JsonlSource(path, max_bad_records=2)
  assert len(src) == 2 and src.num_bad == 2
  assert [w for w, _ in src.bad_records] == [f"{path}:2", f"{path}:4"]
  assert src[1]["messages"] == GOOD[1]["messages"]


def test_bad_records_over_budget_error_names_count_and_first_offenders(tmp_path):
  lines = [GOOD[0]] + [b"{oops\n"] * 7
  path = _write(tmp_path / "a.jsonl", lines)
  with pytest.raises(DataError) as info:
    JsonlSource(path, max_bad_records=3)
  msg = str(info.value)
  assert msg.startswith("7 bad records (max_bad_records=3): ")
  assert f"{path}:2: malformed JSON" in msg and f"{path}:6:" in msg and f"{path}:7:" not in msg
  assert msg.endswith("(and 2 more)")


def test_several_files_are_one_source(tmp_path):
  a = _write(tmp_path / "a.jsonl", [GOOD[0]])
  b = _write(tmp_path / "b.jsonl", [GOOD[1], GOOD[0]])
  src = open_source([a, b])
  assert len(src) == 3 and src.where(2) == f"{b}:2"


def test_missing_file_is_an_error(tmp_path):
  with pytest.raises(DataError, match="not found"):
    JsonlSource(tmp_path / "nope.jsonl")


def test_source_pickles_without_open_files(tmp_path):
  import pickle
  src = JsonlSource(_write(tmp_path / "a.jsonl", GOOD))
  assert src[0]["prompt"] == "1+1=?"
  clone = pickle.loads(pickle.dumps(src))
  assert clone[1]["messages"] == GOOD[1]["messages"]


def test_parquet_source_reads_rows_or_says_pyarrow_is_missing(tmp_path):
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    with pytest.raises(ImportError, match="needs the 'pyarrow' package"):
      ParquetSource(tmp_path / "a.parquet")
    return
  path = tmp_path / "a.parquet"
  pq.write_table(pa.Table.from_pylist([GOOD[0], {"prompt": "2+2=?", "completion": ""}]), path)
  src = ParquetSource(path, max_bad_records=1)
  assert len(src) == 1 and src.bad_records[0][0] == f"{path}:row 2"
