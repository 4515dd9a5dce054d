"""MetricsLogger: JSONL history, summary table, plot, and progress lines without a terminal."""

import io
import json

from rich.console import Console

from jaxrl import train


def test_without_a_terminal_progress_lines_name_step_metrics_and_eta(tmp_path):
  buf = io.StringIO()
  console = Console(file=buf, force_terminal=False, width=200)
  logger = train.MetricsLogger(tmp_path, total_steps=3, desc="sft", show=("loss", "tok/s"), console=console,
                               tensorboard=False)
  for step, loss in [(1, 2.0), (2, 1.5), (3, 1.25)]:
    logger.log(step, {"loss": loss, "tok/s": 100.0 * step})
  plot = logger.close()
  out = buf.getvalue()
  assert "sft 1/3  loss=2.0000  tok/s=100.0000" in out  # the first step always prints
  assert "sft 3/3  loss=1.2500  tok/s=300.0000" in out and "eta 0s" in out  # and so does the last
  assert "summary" in out and "1.2500" in out  # end-of-run table
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 1.25
  assert plot is not None and plot.exists()
