"""``jaxrl eval`` end to end on the tiny local checkpoint: records, summary numbers recomputed independently
from the records, and a resumed run that skips the problems already recorded."""

import json
from pathlib import Path

import numpy as np
import pytest
from eval_testlib import maj_reference, pass_at_k_comb, read_jsonl

from jaxrl import eval as ev
from jaxrl.cli import eval as _cli
from jaxrl.eval import _run

class Killed(Exception):
  """Stands for the run being killed between two chunks."""


MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3"
N = 4


@pytest.fixture
def math_file(tmp_path):
  path = tmp_path / "math.jsonl"
  rows = [{"prompt": f"What is {i} + {i}?", "answer": str(i % 3), "id": f"p{i}"} for i in range(5)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


def _args(data, out, *extra):
  return ["--model", str(MODEL), "--data", str(data), "--out", str(out), "--n", str(N), "--max-new-tokens", "6",
          "--max-prompt-tokens", "64", "--temperature", "1.0", "--top-p", "1.0", "--num-slots", "8",
          "--chunk", "2", *extra]


def _check_summary(records, summary):
  correct = [r["correct"] for r in records]
  want = {f"avg@{N}": np.mean([np.mean(c) for c in correct]),
          "pass@1": np.mean([float(pass_at_k_comb(N, sum(c), 1)) for c in correct]),
          f"pass@{N}": np.mean([any(c) for c in correct]),
          "pass@2": np.mean([float(pass_at_k_comb(N, sum(c), 2)) for c in correct]),
          f"maj@{N}": np.mean([maj_reference(c, r["answers"], N) for c, r in zip(correct, records)])}
  assert summary["metrics"] == pytest.approx(want, abs=1e-12)
  lengths = [t for r in records for t in r["response_tokens"]]
  assert summary["response_tokens"]["mean"] == pytest.approx(np.mean(lengths))
  assert summary["response_tokens"]["max"] == max(lengths)
  reasons = [f for r in records for f in r["finish_reasons"]]
  assert summary["truncation_rate"] == pytest.approx(np.mean([f == "length" for f in reasons]))
  assert summary["settings"]["n"] == N and summary["settings"]["temperature"] == 1.0


def test_eval_custom_reward_interrupted_then_resumed(tmp_path, math_file, monkeypatch, capsys):
  out = tmp_path / "out"
  args = _args(math_file, out, "--task", "custom", "--reward", "eval_testlib:length_mod3_math",
               "--metrics", "avg@n,pass@1,pass@n,pass@2,maj@n")
  real, calls, kill = _run._generate_and_score, [], [True]

  def interrupted(sampler, scorer, problems, todo, *a, **k):
    calls.append([problems.records[i]["id"] for i in todo])
    if kill[0] and len(calls) == 2:
      raise Killed
    return real(sampler, scorer, problems, todo, *a, **k)

  monkeypatch.setattr(_run, "_generate_and_score", interrupted)
  with pytest.raises(Killed):
    _cli.main(args)
  first = read_jsonl(out / ev.RECORDS)
  assert [r["id"] for r in first] == ["p0", "p1"]
  with open(out / ev.RECORDS, "a", encoding="utf-8") as f:
    f.write('{"line": 3, "id": "p2", "resp')  # a write torn by the kill
  calls.clear()
  kill[0] = False
  assert _cli.main(args) == 0
  assert calls == [["p2", "p3"], ["p4"]]  # only the problems not recorded
  records = read_jsonl(out / ev.RECORDS)
  assert records[:2] == first
  assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3", "p4"]
  for r in records:
    assert len(r["correct"]) == len(r["answers"]) == len(r["response_tokens"]) == len(r["responses"]) == N
    assert r["correct"] == [v > 0.5 for v in r["rewards"]]
    assert all(0 < t <= 6 for t in r["response_tokens"])
    assert all(a in ("0", "1", "2") for a in r["answers"])
  fresh = tmp_path / "fresh"  # the same run, never interrupted: the same samples (draws keyed by line and seed)
  assert _cli.main([*args[:args.index("--out") + 1], str(fresh), *args[args.index("--out") + 2:]]) == 0
  assert read_jsonl(fresh / ev.RECORDS) == records
  sharded = tmp_path / "sharded"  # slots and cache over 4 data shards (8 test devices), kv heads over 2 tensor shards
  assert _cli.main([*args[:args.index("--out") + 1], str(sharded), *args[args.index("--out") + 2:],
                    "--mesh", "data=-1,tensor=2"]) == 0
  assert [r["responses"] for r in read_jsonl(sharded / ev.RECORDS)] == [r["responses"] for r in records]
  verdicts = [c for r in records for c in r["correct"]]
  assert 0 < sum(verdicts) < len(verdicts)  # mixed, so the metrics below are not trivially 0 or 1
  summary = json.loads((out / ev.SUMMARY).read_text())
  _check_summary(records, summary)
  printed = capsys.readouterr().out
  for name in (f"avg@{N}", "pass@1", f"pass@{N}", f"maj@{N}"):
    assert f"| {name} | {100 * summary['metrics'][name]:.2f} |" in printed


def test_eval_math_task_on_the_sampler_and_errors(tmp_path, math_file, capsys):
  out = tmp_path / "out"
  # --n 16 (the DeepScaleR-style run): the default metrics are avg@16, pass@1, pass@16 and maj@16, printed
  assert _cli.main(_args(math_file, out, "--backend", "sampler", "--limit", "2", "--n", "16")) == 0
  printed = capsys.readouterr().out
  records = read_jsonl(out / ev.RECORDS)
  assert [r["id"] for r in records] == ["p0", "p1"] and all(len(r["correct"]) == 16 for r in records)
  assert all(set(r["reasons"]) <= {"correct", "wrong_answer", "no_answer"} for r in records)
  summary = json.loads((out / ev.SUMMARY).read_text())
  assert list(summary["metrics"]) == ["avg@16", "pass@1", "pass@16", "maj@16"]
  assert all(name in printed for name in summary["metrics"])
  correct = np.array([r["correct"] for r in records], dtype=float)
  assert summary["metrics"]["avg@16"] == pytest.approx(correct.mean())
  assert summary["metrics"]["pass@16"] == pytest.approx(correct.max(axis=1).mean())
  assert summary["task"] == "math" and summary["problems"] == 2
  # other settings in the same directory: refused, not mixed
  assert _cli.main(_args(math_file, out, "--backend", "sampler", "--limit", "2", "--n", "16", "--seed", "1")) == 2
  assert "seed" in capsys.readouterr().err
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"\n', encoding="utf-8")
  assert _cli.main(_args(bad, tmp_path / "o2")) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"{bad}:2: invalid JSON" in err[0]
  no_answer = tmp_path / "no_answer.jsonl"
  no_answer.write_text('{"prompt": "1+1?"}\n', encoding="utf-8")
  assert _cli.main(_args(no_answer, tmp_path / "o3")) == 2
  assert f"{no_answer}:1: the task needs the field 'answer'" in capsys.readouterr().err
