"""``jaxrl bench device --dry-run``: the device check's code path on CPU with tiny shapes (what CI runs, so the
script cannot rot): every section present and error-free, the kernels' errors small finite numbers, the
Markdown table's rows; and the MFU arithmetic against a hand computation."""

from __future__ import annotations

import json
import math

import pytest

from jaxrl import models
from jaxrl.bench import device


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("device_check")
  result = device.run(device.Shapes.dry(), log=lambda *_: None)
  js, md = device.write(result, out)
  return json.loads(js.read_text()), md.read_text()


def test_dry_run_json_has_every_section_without_errors(dry_run):
  result, _ = dry_run
  assert set(result["sections"]) == set(device.SECTIONS)
  for name, section in result["sections"].items():
    assert "error" not in section, (name, section.get("error"), section.get("traceback"))
  assert result["meta"]["dry_run"] is True and result["meta"]["peak_flops"] > 0


def _small(x: float, tol: float) -> bool:
  return isinstance(x, float) and math.isfinite(x) and 0.0 <= x <= tol


def test_dry_run_kernel_errors_are_small_numbers(dry_run):
  sec = dry_run[0]["sections"]
  att = sec["attention"]
  assert att["impl"] == "pallas_triton" and att["interpret"] and att["documents"] >= 2
  for err in (att["fwd_max_abs_err"], *att["grad_max_abs_err"].values()):
    assert _small(err, 1e-4), att
  assert _small(sec["paged_decode"]["max_abs_err"], 1e-4), sec["paged_decode"]
  for t in att["timings"]:
    assert t["tflops"] > 0 and t["ms"] > 0, t


def test_dry_run_measures_engine_train_and_plan(dry_run):
  sec = dry_run[0]["sections"]
  runs = sec["engine_decode"]["runs"]
  assert [r["slots"] for r in runs] == list(device.Shapes.dry().slots)
  for r in runs:
    assert r["generated_tokens"] == r["slots"] * r["new_tokens"] and r["decode_tokens_per_s"] > 0, r
  t = sec["train_step"]
  assert t["tokens"] == device.Shapes.dry().token_budget and math.isfinite(t["loss"])
  assert t["model_flops"] == pytest.approx(t["plan_model_flops"]) and 0 < t["mfu"] < 1
  programs = [r["program"].split("[")[0] for r in sec["plan"]["rows"]]
  assert programs == ["train_step", "engine_decode", "engine_decode"]
  for r in sec["plan"]["rows"]:
    assert r["status"] == "ok" and r["predicted_peak_bytes"] > 0 and r["est_s"] > 0 and r["measured_s"] > 0, r


def test_dry_run_markdown_has_the_expected_rows(dry_run):
  _, md = dry_run
  lines = md.splitlines()
  assert "DRY RUN" in lines[0] and lines[2:4] == list(device.MD_HEADER)
  metrics = [(c[2].strip(), c[3].strip()) for c in (line.split("|") for line in lines[4:])]
  expected = ["fwd max abs err", "dq/dk/dv max abs err", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "max abs err",
              "tokens/s (one layer)", "decode tokens/s, 4 slots", "decode tokens/s, 8 slots", "tokens/s", "MFU",
              "peak: train_step[s0]", "est. s: train_step[s0]", "peak: engine_decode[s0], 4 slots",
              "est. s: engine_decode[s0], 4 slots", "peak: engine_decode[s0], 8 slots",
              "est. s: engine_decode[s0], 8 slots"]
  assert [m for m, _ in metrics] == expected
  assert all(v not in ("", "error") for _, v in metrics), metrics


def test_mfu_matches_a_hand_computation():
  cfg = models.ModelConfig.tiny()  # V 512, D 64, F 128, L 2, N 4, K 2, H 16
  matmul_params = 2 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128) + 512 * 64  # 106496
  forward = 2 * matmul_params + 2 * 2 * 4 * 16 * 64  # per token at row_len 64: 229376
  flops = device.train_flops(cfg, 64, 256)
  assert flops == 3 * forward * 256 == 176_160_768
  assert device.mfu(flops, 0.5, 1e9) == pytest.approx(176_160_768 / 0.5 / 1e9)


def test_section_failure_is_recorded_and_the_next_runs():
  results = {}
  device._guard(results, "boom", lambda: 1 / 0, log=lambda *_: None)
  device._guard(results, "fine", lambda: {"x": 1.0}, log=lambda *_: None)
  assert results["boom"]["error"].startswith("ZeroDivisionError") and results["fine"]["x"] == 1.0


def test_main_runs_only_the_named_sections_and_writes_both_files(tmp_path, capsys):
  assert device.main(["--dry-run", "--only", "paged_decode", "--out", str(tmp_path)]) == 1  # the rest: skipped
  result = json.loads((tmp_path / "device_check.json").read_text())
  sec = result["sections"]
  assert _small(sec["paged_decode"]["max_abs_err"], 1e-4)
  assert {n for n, s in sec.items() if s.get("error") == "skipped: not in --only"} == set(device.SECTIONS) - {
      "paged_decode"}
  md = (tmp_path / "device_check.md").read_text()
  assert "| paged_decode | tokens/s (one layer) |" in md and "| train_step | error | - | - | skipped" in md
  assert md in capsys.readouterr().out
