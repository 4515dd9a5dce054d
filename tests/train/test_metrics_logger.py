"""MetricsLogger: JSONL history, summary table, the watched-few and full plots, progress lines without a terminal."""

import io
import json

from matplotlib import image as plt_image
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
  assert "sft 1/3  loss=2.000  tok/s=100" in out  # the first step always prints
  assert "sft 3/3  loss=1.250  tok/s=300" in out and "eta 0s" in out  # and so does the last
  assert "summary" in out and "1.250" in out  # end-of-run table
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 1.25
  assert plot is not None and plot.exists()


def test_curves_png_shows_the_watched_few_and_curves_all_png_every_metric(tmp_path):
  logger = train.MetricsLogger(tmp_path, total_steps=4, console=Console(file=io.StringIO()), tensorboard=False)
  watched = ["reward/mean", "eval/accuracy", "response/length_mean", "response/truncated_frac", "kl", "entropy",
             "clip_frac", "tok_s/rollout", "tok_s/train"]
  others = ["advantage/abs_mean", "ratio_min", "ratio_max", "time_reward"]
  for step in range(1, 5):
    logger.log(step, {k: float(step * (i + 1)) for i, k in enumerate(watched + others)})
  assert logger.summary_panels() == (
      ("reward / held-out accuracy", ("reward/mean", "eval/accuracy")),
      ("response length / truncated", ("response/length_mean", "response/truncated_frac")),
      ("KL / entropy", ("kl", "entropy")),
      ("clip fraction", ("clip_frac",)),
      ("throughput (tokens/s)", ("tok_s/rollout", "tok_s/train")),
  )
  plot = logger.close()
  summary, full = plt_image.imread(plot), plt_image.imread(tmp_path / "curves_all.png")
  assert plot == tmp_path / "curves.png"
  assert full.shape[0] == 5 * summary.shape[0] // 2  # 13 metrics: 5 rows of 3 panels; summary: 2 rows


def test_curves_png_falls_back_to_every_metric_for_unknown_names(tmp_path):
  logger = train.MetricsLogger(tmp_path, total_steps=2, console=Console(file=io.StringIO()), tensorboard=False)
  logger.log(1, {"my/metric": 1.0, "other": 2.0})
  assert logger.summary_panels() == (("my/metric", ("my/metric",)), ("other", ("other",)))
