"""``jaxrl rs`` (rejection sampling for SFT) on the tiny local checkpoint: the written data set recomputed
independently from the records, its statistics, the SFT data pipeline reading it, a resumed rerun, and
``--then-sft`` training on it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from eval_testlib import read_jsonl

from jaxrl import data as data_lib
from jaxrl import eval as ev
from jaxrl import models
from jaxrl.cli import rs as _cli
from jaxrl.eval import _run

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3"
K = 8


def odd_length(prompt: str, completion: str, **_) -> float:
  """Accepts a deterministic subset: the completions of odd length (in characters)."""
  return float(len(completion) % 2 == 1)


def _args(data, out, *extra):
  return ["--model", str(MODEL), "--data", str(data), "--out", str(out), "--k", str(K), "--max-new-tokens", "3",
          "--max-prompt-tokens", "64", "--temperature", "0.3", "--top-p", "1.0", "--num-slots", "16", "--stop", " ",
          "--chunk", "2", "--task", "custom", "--reward", "test_rejection:odd_length", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One ``jaxrl rs`` run over 5 prompts (one a multi-turn ``messages`` record); its directory and stdout."""
  tmp = tmp_path_factory.mktemp("rs")
  data = tmp / "prompts.jsonl"
  rows = [{"prompt": f"Count to {i}.", "id": f"p{i}"} for i in range(4)]
  rows.append({"id": "chat", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                          {"role": "user", "content": "Say more."},
                                          {"role": "assistant", "content": "reference"}]})
  data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  out = tmp / "out"
  assert _cli.main(_args(data, out)) == 0
  return data, out


def _expected(records, cap=None):
  """The SFT samples recomputed from the records: accepted, not truncated, non-blank, first of each
  whitespace-normalised text, at most ``cap`` per prompt."""
  want = []
  for r in records:
    texts = []
    for ok, fin, text in zip(r["correct"], r["finish_reasons"], r["responses"]):
      norm = " ".join(text.split())
      if ok and fin != "length" and norm and norm not in {" ".join(t.split()) for t in texts}:
        texts.append(text)
    want += [(r["id"], t) for t in texts[:cap]]
  return want


def test_dataset_holds_exactly_the_accepted_deduplicated_samples(run):
  data, out = run
  records = read_jsonl(out / ev.RECORDS)
  written = read_jsonl(out / ev.DATASET)
  assert [(w["id"], w["messages"][-1]["content"]) for w in written] == _expected(records)
  for w in written:
    rec = next(r for r in records if r["id"] == w["id"])
    assert w["reward"] == 1.0 and len(w["messages"][-1]["content"]) % 2 == 1
    assert w["messages"][-1]["role"] == "assistant" and "train" not in w["messages"][-1]
    if w["id"] == "chat":  # the prompt is the conversation before the last assistant turn, that turn untrained
      assert w["messages"][:3] == [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello", "train": False},
                                   {"role": "user", "content": "Say more."}]
    else:
      assert w["messages"][:-1] == [{"role": "user", "content": f"Count to {rec['id'][1:]}."}]
  # the subset is neither empty nor everything, and dedup has work to do
  accepted = [c for r in records for c in r["correct"]]
  assert 0 < sum(accepted) < len(accepted)
  assert len(written) < sum(accepted)


def test_stats_are_consistent_with_the_records(run, capsys):
  _, out = run
  records = read_jsonl(out / ev.RECORDS)
  stats = json.loads((out / ev.STATS).read_text())
  written = read_jsonl(out / ev.DATASET)
  correct = [c for r in records for c in r["correct"]]
  fins = [f for r in records for f in r["finish_reasons"]]
  assert stats["prompts"] == 5 and stats["samples"] == 5 * K == len(correct)
  assert stats["accepted"] == sum(correct)
  assert stats["acceptance_rate"] == pytest.approx(sum(correct) / len(correct))
  assert stats["truncated"] == sum(f == "length" for f in fins)
  assert stats["dropped_truncated"] == sum(c and f == "length" for c, f in zip(correct, fins))
  assert stats["kept"] == len(written)
  assert stats["accepted"] == (stats["kept"] + stats["dropped_truncated"] + stats["dropped_empty"]
                               + stats["duplicates_removed"] + stats["capped"])
  assert stats["capped"] == 0 and stats["duplicates_removed"] > 0 and stats["dropped_truncated"] > 0
  assert stats["prompts_with_kept"] == len({w["id"] for w in written})
  lengths = {(r["id"], t): n for r in records for t, n in zip(r["responses"], r["response_tokens"])}
  assert stats["mean_kept_tokens"] == pytest.approx(np.mean([lengths[w["id"], w["messages"][-1]["content"]]
                                                             for w in written]))
  table = (out / ev.STATS_MD).read_text()
  assert f"| duplicates removed | {stats['duplicates_removed']} |" in table
  assert f"| acceptance rate | {100 * stats['acceptance_rate']:.2f} % |" in table


def test_the_sft_data_pipeline_reads_it(run):
  _, out = run
  written = read_jsonl(out / ev.DATASET)
  tokenizer = models.load_tokenizer(str(MODEL))
  samples = list(data_lib.sft_samples(data_lib.DataConfig(paths=(str(out / ev.DATASET),), shuffle=False),
                                      tokenizer, process_index=0, process_count=1))
  assert len(samples) == len(written)
  for sample, w in zip(samples, written):
    trained = tokenizer.decode(sample["tokens"][sample["loss_mask"] > 0].tolist())
    content = w["messages"][-1]["content"]
    assert trained.startswith(content) and trained[len(content):].strip() == "<|im_end|>"  # the sample and its turn end


def test_rerun_resumes_from_the_records_and_caps(run, tmp_path, monkeypatch):
  data, out = run
  again = tmp_path / "again"
  shutil.copytree(out, again)
  calls = []
  monkeypatch.setattr(_run, "_generate_and_score", lambda *a, **k: calls.append(a) or [])
  assert _cli.main(_args(data, again, "--keep-per-prompt", "1")) == 0
  assert not calls  # every prompt already recorded: nothing sampled
  records = read_jsonl(again / ev.RECORDS)
  assert records == read_jsonl(out / ev.RECORDS)
  written = read_jsonl(again / ev.DATASET)
  assert [(w["id"], w["messages"][-1]["content"]) for w in written] == _expected(records, cap=1)
  stats = json.loads((again / ev.STATS).read_text())
  full = json.loads((out / ev.STATS).read_text())
  assert stats["kept"] == stats["prompts_with_kept"] == full["prompts_with_kept"]
  assert stats["capped"] == full["kept"] - stats["kept"] > 0


def test_then_sft_trains_two_steps_on_the_written_file(run, tmp_path, capsys):
  data, out = run
  again = tmp_path / "again"
  shutil.copytree(out, again)
  config = tmp_path / "sft.yaml"
  config.write_text(json.dumps({
      "model": {"hf_dir": str(MODEL)}, "packing": {"seq_len": 64, "global_rows": 8, "buffer_size": 8}, "steps": 2,
      "optim": {"lr": 1e-3, "warmup_steps": 0}, "eval": {"every": 0, "exact_match": 0},
      "out_dir": str(tmp_path / "sft"), "export_hf": False, "tensorboard": False}), encoding="utf-8")
  assert _cli.main(_args(data, again, "--then-sft", str(config), "--sft-override", "optim.lr=0.002")) == 0
  results = json.loads((tmp_path / "sft" / "results.json").read_text())
  assert len(results["losses"]) == 2 and np.all(np.isfinite(results["losses"]))
  used = json.loads((tmp_path / "sft" / "config.json").read_text())
  assert used["data"]["train"] == [str(again / ev.DATASET)]
  assert used["optim"]["lr"] == 0.002 and used["steps"] == 2


def test_select_samples_counts_each_rule():
  rec = {"line": 1, "correct": [True, True, False, True, True, True, True, True],
         "finish_reasons": ["eos", "stop", "eos", "length", "eos", "eos", "eos", "eos"],
         "responses": ["a  b", " a b\n", "c", "d", "  ", "e", "a b", "f"],
         "response_tokens": [3, 4, 1, 9, 1, 2, 2, 5]}
  kept, stats = ev.select_samples([rec])
  assert kept == [[0, 5, 7]]  # 1 and 6: "a b" again; 2 rejected; 3 truncated; 4 blank
  assert {k: stats[k] for k in ("samples", "accepted", "truncated", "dropped_truncated", "dropped_empty",
                                "duplicates_removed", "capped", "kept", "prompts_with_kept")} == {
      "samples": 8, "accepted": 7, "truncated": 1, "dropped_truncated": 1, "dropped_empty": 1,
      "duplicates_removed": 2, "capped": 0, "kept": 3, "prompts_with_kept": 1}
  assert stats["acceptance_rate"] == 7 / 8 and stats["mean_kept_tokens"] == pytest.approx(10 / 3)
  kept, stats = ev.select_samples([rec], keep_per_prompt=2, keep_truncated=True)
  assert kept == [[0, 3]] and stats["capped"] == 2 and stats["duplicates_removed"] == 2  # 5, 7 over the cap
  with pytest.raises(ValueError, match="keep_per_prompt"):
    ev.select_samples([rec], keep_per_prompt=0)


def test_bad_options_are_one_line_errors(tmp_path, capsys):
  data = tmp_path / "p.jsonl"
  data.write_text('{"prompt": "1+1?"}\n', encoding="utf-8")
  assert _cli.main(_args(data, tmp_path / "o", "--keep-per-prompt", "0")) == 2
  assert capsys.readouterr().err.strip() == "jaxrl rs: error: --keep-per-prompt must be >= 1, got 0"
  assert _cli.main([*_args(data, tmp_path / "o")[:-4], "--task", "math"]) == 2  # math needs an answer column
  assert f"{data}:1: the task needs the field 'answer'" in capsys.readouterr().err
