"""``jaxrl eval`` on two local processes × 2 CPU devices (each on its local ``--mesh data=-1``) equals one process
× 2 devices: records.jsonl and summary.json, custom reward, sampled, n=2. Problem i goes to process i % 2;
process 1 resumes from a part file holding one of its problems already (marked, so a regenerated record would
show) and a torn line; the parts are merged into records.jsonl in problem order and removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from multihost_testlib import ROOT, free_port, wait_json, worker_env

MODEL = ROOT / "tests" / "fixtures" / "hf" / "qwen3"
WORKER = """
import json, sys
from multihost_testlib import configure_process
count, index, port = (int(a) for a in sys.argv[1:4])
configure_process(count, index, 2, port)
import jax
from jaxrl import cli
from jaxrl.eval import _run
done, real = [], _run._generate_and_score
def recording(sampler, scorer, problems, todo, *a, **k):
  done.extend(problems.records[i]["id"] for i in todo)
  return real(sampler, scorer, problems, todo, *a, **k)
_run._generate_and_score = recording
rc = cli.main(["eval", *sys.argv[4:]])
print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "generated": done, "rc": rc}),
      flush=True)
sys.exit(rc)
"""


def _run(processes: int, data: Path, out: Path) -> list[dict]:
  args = ["--model", str(MODEL), "--data", str(data), "--out", str(out), "--task", "custom",
          "--reward", "eval_testlib:length_mod3_math", "--n", "2", "--max-new-tokens", "5",
          "--max-prompt-tokens", "64", "--temperature", "1.0", "--top-p", "1.0", "--num-slots", "4", "--chunk", "2",
          "--metrics", "avg@n,pass@1,pass@n,maj@n", "--mesh", "data=-1", "--seed", "0"]
  env = worker_env()
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "multihost"), str(ROOT / "tests" / "eval"),
                                       env["PYTHONPATH"]])
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(processes), str(i), str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
           for i in range(processes)]
  return wait_json(procs, 900)


def _jsonl(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_eval_on_two_processes_equals_one(tmp_path):
  data = tmp_path / "math.jsonl"
  rows = [{"prompt": f"What is {i} + {i}?", "answer": str(i % 3), "id": f"p{i}"} for i in range(5)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  single = _run(1, data, tmp_path / "single")
  assert single == [{"process": 0, "processes": 1, "generated": ["p0", "p1", "p2", "p3", "p4"], "rc": 0}]
  want = _jsonl(tmp_path / "single" / "records.jsonl")
  assert [r["id"] for r in want] == ["p0", "p1", "p2", "p3", "p4"]
  assert all(len(r["responses"]) == 2 for r in want)
  pair = tmp_path / "pair"
  pair.mkdir()
  seeded = {**want[3], "seeded": True}  # problem 3 is process 1's (3 % 2): resumed from its part, not redone
  (pair / "records.part-1-of-2.jsonl").write_text(json.dumps(seeded) + "\n" + '{"line": 2, "id": "p1", "re',
                                                  encoding="utf-8")  # and a torn last line, dropped
  assert _run(2, data, pair) == [{"process": 0, "processes": 2, "generated": ["p0", "p2", "p4"], "rc": 0},
                                 {"process": 1, "processes": 2, "generated": ["p1"], "rc": 0}]
  assert _jsonl(pair / "records.jsonl") == want[:3] + [seeded] + want[4:]
  assert sorted(p.name for p in pair.iterdir() if p.name.startswith("records")) == ["records.jsonl"]
  summary = json.loads((tmp_path / "single" / "summary.json").read_text())
  assert json.loads((pair / "summary.json").read_text()) == summary
  verdicts = [c for r in want for c in r["correct"]]
  assert 0 < sum(verdicts) < len(verdicts)  # mixed verdicts: the summaries' metrics are not trivially 0 or 1
