"""The `jaxrl` command: options of pass-through commands reach their own parsers; user errors are one line."""

from pathlib import Path

import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.data import DataError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("command", ["rl", "sample", "quickstart"])
def test_leading_options_reach_the_subcommand(command, monkeypatch):
  seen = {}
  monkeypatch.setitem(cli.PASSTHROUGH, command, lambda rest: seen.setdefault("rest", rest) and 0)
  assert cli.main([command, "--config", "x.yaml", "a.b=1"]) == 0
  assert seen["rest"] == ["--config", "x.yaml", "a.b=1"]


def test_bench_takes_its_name_then_options(monkeypatch):
  import jaxrl.bench.sft as bench_sft
  seen = {}
  monkeypatch.setattr(bench_sft, "main", lambda rest: seen.setdefault("rest", rest) and 0)
  assert cli.main(["bench", "sft", "--quick"]) == 0
  assert seen["rest"] == ["--quick"]


def test_a_bad_data_line_ends_sft_with_one_line(tmp_path, capsys):
  bad = tmp_path / "train.jsonl"
  bad.write_text('{"prompt": "1+1?", "completion": "2"}\n{"prompt": "2+2?", "completion": \n')
  status = cli.main(["sft", "--config", str(CONFIGS / "sft_tiny.yaml"), f"data.train=[{bad}]",
                     f"out_dir={tmp_path / 'run'}", "tensorboard=false"])
  err = capsys.readouterr().err
  ours = [line for line in err.splitlines() if line.startswith("jaxrl ")]  # libraries may log warnings
  assert status == 2 and "Traceback" not in err and len(ours) == 1, err
  assert ours[0].startswith("jaxrl sft: data error: ") and f"{bad}:2" in ours[0]


@pytest.mark.parametrize("error, shown", [(config_lib.ConfigError("rollout.n must be >= 1"), "config error"),
                                          (DataError("a.jsonl:3: not JSON"), "data error"),
                                          (FileNotFoundError("no such file: x.jsonl"), "error")])
def test_user_errors_of_pass_through_commands_are_one_line(error, shown, monkeypatch, capsys):
  def fail(rest):
    raise error
  monkeypatch.setitem(cli.PASSTHROUGH, "rl", fail)
  assert cli.main(["rl", "--config", "x.yaml"]) == 2
  assert capsys.readouterr().err == f"jaxrl rl: {shown}: {error}\n"


def test_a_bug_still_raises_with_its_traceback(monkeypatch):
  def fail(rest):
    raise RuntimeError("a bug")
  monkeypatch.setitem(cli.PASSTHROUGH, "rl", fail)
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["rl"])
