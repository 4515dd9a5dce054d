"""The `jaxrl` command: options of pass-through commands reach their own parsers."""

import pytest

from jaxrl import cli


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
