"""The bad-input suite (issue 15, item 6): every bad input ends as a one-line error naming its file:line
or config key, or, where the config allows skipping (``data.max_bad_records`` for SFT records; RL's
``data.max_prompt_tokens``; ``packing.overlong``), as a counted skip listed in the end-of-run report.

Each case goes through the loader a run uses (``open_source`` under ``sft_samples``, RL's
``read_records`` / ``EncodedPrompts``, the typed config loader, the mesh builder, ``check_tokenizer``,
``encode_record``); one tiny SFT run checks the report in the summary and ``results.json``.
"""

import json
import re

import faultlib
import grain
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import data as data_lib
from jaxrl import models, rl, sft, sharding

GOOD = {"prompt": "1+1=?", "completion": "1+1=2. Answer: 2"}
TINY = faultlib.TINY


def _line(x) -> bytes:
  return x if isinstance(x, bytes) else (json.dumps(x) + "\n").encode()


def _write(path, lines):
  path.write_bytes(b"".join(_line(x) for x in lines))
  return path


# A bad SFT record on line 2: (case id, line, error message after "file:2: ", skip reason).
RECORDS = [
    ("malformed_json", b'{"prompt": "x", \n', "malformed JSON", "malformed JSON"),
    ("not_utf8", b'{"prompt": "\xff", "completion": "x"}\n', r"not valid UTF-8 \(byte 0xff", "not UTF-8"),
    ("not_an_object", b"[1, 2]\n", "record must be a JSON object, got list", "not a JSON object"),
    ("empty_record", b"{}\n", "record needs 'messages' or 'prompt'/'completion'", "missing field"),
    ("missing_completion", {"prompt": "q"}, "missing field 'completion'", "missing field"),
    ("empty_prompt", {"prompt": " ", "completion": "a"}, "'prompt' is empty", "empty prompt"),
    ("empty_prompt_messages", {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]},
     "the messages before the first trained turn", "empty prompt"),
    ("empty_completion", {"prompt": "q", "completion": ""}, "'completion' is empty", "empty completion"),
    ("completion_not_text", {"prompt": "q", "completion": 5}, "'completion' must be a string, got int", "wrong type"),
    ("unknown_role", {"messages": [{"role": "bot", "content": "q"}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\].role must be one of", "unknown role"),
    ("content_not_text", {"messages": [{"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\].content must be a string", "wrong type"),
    ("assistant_first", {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     "messages.0. is a trained assistant turn; a system or user message must come first", "bad chat order"),
    ("no_trained_turn", {"messages": [{"role": "user", "content": "q"}]}, "'messages' has no trained assistant turn",
     "no trained assistant turn"),
]


@pytest.mark.parametrize("line,message,reason", [c[1:] for c in RECORDS], ids=[c[0] for c in RECORDS])
def test_bad_sft_record_is_an_error_or_a_counted_skip(tmp_path, line, message, reason):
  path = _write(tmp_path / "train.jsonl", [GOOD, line, GOOD])
  with pytest.raises(data_lib.DataError, match=rf"^1 bad record \(max_bad_records=0\): {re.escape(str(path))}:2: {message}"):
    data_lib.open_source(path)  # the default: no bad record is allowed
  src = data_lib.open_source(path, max_bad_records=1)
  assert len(src) == 2 and [src.where(i) for i in range(2)] == [f"{path}:1", f"{path}:3"]
  report = data_lib.SkipReport()
  report.add_bad_records(src.bad_reasons)
  assert report.as_dict() == {"total": 1, "reasons": {reason: {"count": 1, "examples": [f"{path}:2"]}}}


# A bad RL prompt on line 2 (RL has no bad-record budget: each is an error naming file:line).
PROMPTS = [
    ("malformed_json", b'{"prompt": \n', "invalid JSON"),
    ("not_utf8", b'{"prompt": "\xfe"}\n', r"not valid UTF-8 \(byte 0xfe"),
    ("not_an_object", b'"just text"\n', "expected a JSON object, got str"),
    ("missing_prompt", {"answer": "2"}, r"record needs 'prompt' or 'messages'; has keys \['answer'\]"),
    ("empty_prompt", {"prompt": "", "answer": "2"}, "'prompt' is empty"),
    ("prompt_not_text", {"prompt": 7, "answer": "2"}, "'prompt' must be a non-empty list of messages"),
    ("unknown_role", {"prompt": [{"role": "human", "content": "q"}]}, r"prompt\[0\].role must be one of"),
    ("empty_messages", {"messages": [{"role": "system", "content": ""}, {"role": "assistant", "content": "a"}]},
     "'messages' has no non-empty prompt message"),
]


@pytest.mark.parametrize("line,message", [c[1:] for c in PROMPTS], ids=[c[0] for c in PROMPTS])
def test_bad_rl_prompt_is_an_error_naming_file_and_line(tmp_path, line, message):
  path = _write(tmp_path / "prompts.jsonl", [{"prompt": "1+1=?", "answer": "2"}, line])
  with pytest.raises(data_lib.DataError, match=rf"^{re.escape(str(path))}:2: {message}"):
    rl.read_records([path])


@pytest.fixture(scope="module")
def tokenizer():
  return models.load_tokenizer(data_lib.tiny_tokenizer_dir())


def test_rl_prompts_longer_than_the_limit_are_counted_skips_with_their_line(tmp_path, tokenizer):
  path = _write(tmp_path / "prompts.jsonl", [{"prompt": "1+1=?", "answer": "2"},
                                             {"prompt": "1+1=? " * 40, "answer": "2"},
                                             {"prompt": "2+2=?", "answer": "4"}])
  prompts = rl.EncodedPrompts(rl.read_records([path]), tokenizer, max_tokens=64)
  assert len(prompts) == 2 and prompts.skipped == 1
  assert prompts.skip_report().as_dict() == {"total": 1, "reasons": {
      "prompt longer than data.max_prompt_tokens=64": {"count": 1, "examples": [f"{path}:2"]}}}


class _UnstableTemplate:
  """A chat template that renders the last message first: not prefix-stable."""
  eos_token = "<eos>"

  def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
    text = "".join(f"<{m['role']}>{m['content']}" for m in reversed(messages))
    return text + ("<assistant>" if add_generation_prompt else "")


def _config_error(*overrides):
  return lambda: config_lib.load(sft.SFTConfig, None, list(overrides))


# Everything else in item 6: (case id, a callable that must raise, exception type, message regex).
OTHER = [
    ("config_unknown_key", _config_error("stpes=3"), config_lib.ConfigError, "unknown config key 'stpes'"),
    ("config_unknown_nested_key", _config_error("packing.seqlen=64"), config_lib.ConfigError,
     "packing.seqlen"),
    ("config_wrong_type", _config_error("steps=ten"), config_lib.ConfigError, "steps: expected an int"),
    ("config_bad_choice", _config_error("packing.overlong=wrap"), config_lib.ConfigError, "packing.overlong"),
    ("config_bad_budget", _config_error("data.max_bad_records=-1"), config_lib.ConfigError, "max_bad_records"),
    ("config_bad_spike_window", _config_error("guards.spike_window=2"), config_lib.ConfigError,
     "guards.spike_window must be 0"),
    ("mesh_incompatible_with_devices", lambda: sharding.MeshConfig(shape={"fsdp": 3, "data": -1}).build(),
     ValueError, r"8 devices are not divisible by the fixed axes' product 3"),
    ("mesh_unknown_axis", _config_error("mesh.shape.pipeline=2"), config_lib.ConfigError, "unknown axes"),
    ("vocab_mismatch",
     lambda: models.check_tokenizer(models.load_tokenizer(data_lib.tiny_tokenizer_dir()),
                                    models.ModelConfig(**{**TINY["overrides"], "vocab_size": 16})),
     ValueError, r"tokenizer has \d+ tokens .* vocab_size=16"),
    ("chat_template_not_prefix_stable",
     lambda: data_lib.encode_record(_UnstableTemplate(), {**GOOD, "_where": "train.jsonl:7"}),
     data_lib.DataError, "^train.jsonl:7: chat template is not prefix-stable at message 1"),
]


@pytest.mark.parametrize("call,exc,message", [c[1:] for c in OTHER], ids=[c[0] for c in OTHER])
def test_bad_config_or_model_input_is_a_one_line_error_naming_it(call, exc, message):
  with pytest.raises(exc, match=message) as info:
    call()
  assert "\n" not in str(info.value).strip()


def test_a_data_file_changed_after_indexing_is_an_error_naming_it(tmp_path):
  path = _write(tmp_path / "train.jsonl", [GOOD, GOOD])
  src = data_lib.open_source(path)
  assert src[0]["completion"] == GOOD["completion"]
  saved = src.fingerprint()
  moved = tmp_path / "moved.jsonl"
  moved.write_bytes(path.read_bytes())
  data_lib.check_fingerprint(saved, data_lib.open_source(moved).fingerprint())  # same bytes elsewhere: fine
  _write(path, [GOOD, {"prompt": "a much longer prompt than before", "completion": "x"}])
  with pytest.raises(data_lib.DataError, match=rf"^{re.escape(str(path))}: data file changed after it was indexed"):
    src[1]
  with pytest.raises(data_lib.DataError, match=rf"^{re.escape(str(path))}: data file changed since the checkpoint"):
    data_lib.check_fingerprint(saved, data_lib.open_source(path).fingerprint())


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_packing_skips_name_their_records_and_survive_a_resume(policy):
  """Packing keeps the source index of the first few distinct truncated / dropped samples (repeats read
  once more are counted, not listed again); the iterator's state carries them through a JSON round trip."""
  def sample(index, length, trained=True):
    mask = np.zeros(length, bool)
    mask[1:3] = trained
    return {"tokens": np.arange(1, length + 1, dtype=np.int32), "loss_mask": mask,
            "turn_id": mask.astype(np.int32), "sample_id": np.full(length, index, np.int32)}
  # index: length; 8 fits, 20, 30, 40, 50 are over seq_len=16; 11 is short with nothing trained; record 1
  # comes again (a second epoch); the last one keeps the final counts in a batch's stats.
  lengths = {0: 8, 1: 20, 2: 8, 3: 30, 4: 40, 5: 50, 6: 8}
  samples = [sample(i, n) for i, n in lengths.items()] + [sample(11, 6, trained=False), sample(1, 20), sample(7, 8)]
  cfg = data_lib.PackingConfig(seq_len=16, global_rows=2, buffer_size=3, overlong=policy)
  ds = data_lib.PackedBatchIterDataset(grain.MapDataset.source(samples).to_iter_dataset(), config=cfg)
  straight = [b.stats for b in ds]
  last = straight[-1]
  if policy == "truncate":  # 5 truncations of 4 distinct records; only the untrained sample is dropped
    assert (last.truncated, last.truncated_examples, last.dropped, last.dropped_examples) == (5, (1, 3, 4), 1, (11,))
  else:
    assert (last.truncated, last.dropped, last.dropped_examples) == (0, 6, (1, 3, 4))
  for k in range(1, len(straight)):  # stopped after batch k, resumed
    it = iter(ds)
    for _ in range(k):
      next(it)
    resumed = iter(ds)
    resumed.set_state(json.loads(json.dumps(it.get_state())))  # as the checkpoint's JSON item stores it
    assert [b.stats for b in resumed] == straight[k:], k


def test_sft_run_reports_every_skip_and_refuses_to_resume_on_changed_data(tmp_path, capsys):
  """Two bad records (within data.max_bad_records) and over-long samples: the run finishes, prints the
  skip table and writes ``skips`` to results.json; after the data file changes, resuming stops with
  an error naming it instead of reading other records from the saved position."""
  paths = data_lib.write_arithmetic_splits(tmp_path / "data", n_train=12, n_heldout=2, seed=0,
                                           config=sft.BuiltinData().task)
  train = tmp_path / "train.jsonl"
  lines = paths["train"].read_bytes().splitlines(keepends=True)
  long = _line({"prompt": "1+1=?", "completion": "2 " * 80})
  train.write_bytes(b"".join(lines[:3] + [b"{oops\n"] + lines[3:6] + [long, b'{"prompt": "\xff"}\n'] + lines[6:]))
  # The kill-and-resume tests' shapes (the compiled step comes from the persistent cache).
  cfg = dict(faultlib.sft_config(1), data={"train": [str(train)], "max_bad_records": 2}, export_hf=False,
             out_dir=str(tmp_path / "run"))
  results = sft.SFTTrainer(config_lib.from_dict(sft.SFTConfig, cfg)).run()
  reasons = results["skips"]["reasons"]
  assert reasons["malformed JSON"] == {"count": 1, "examples": [f"{train}:4"]}
  assert reasons["not UTF-8"] == {"count": 1, "examples": [f"{train}:9"]}
  truncated = reasons["over-long sample truncated to packing.seq_len=64"]
  assert truncated["count"] >= 1 and results["packing"]["truncated"] == truncated["count"]
  assert truncated["examples"] == [f"{train}:8"]  # the over-long record, however often it was read
  assert json.loads((tmp_path / "run" / "results.json").read_text())["skips"] == results["skips"]
  out = "".join(capsys.readouterr())  # the summary goes to stderr
  assert "skipped inputs" in out and "malformed JSON" in out and f"{train}:9" in out
  train.write_bytes(train.read_bytes().replace(b"{oops", b"{oops, again"))
  with pytest.raises(data_lib.DataError, match=rf"^{re.escape(str(train))}: data file changed since the checkpoint"):
    sft.SFTTrainer(config_lib.from_dict(sft.SFTConfig, dict(cfg, steps=2))).run()
  assert np.isfinite(results["losses"][0])
