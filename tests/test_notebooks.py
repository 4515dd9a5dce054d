"""Executes notebooks/loss_variants.ipynb in this interpreter's kernel and checks the figures it writes."""

import json
import math
import pathlib
import shutil
import sys
import time

import ipykernel  # noqa: F401  (the kernel below runs `python -m ipykernel_launcher`)
import matplotlib.image
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "loss_variants.ipynb"
IMG_DIR = ROOT / "docs" / "img"
FIGURES = ("surrogate_vs_ratio", "aggregation_weights", "advantage_distributions", "sft_packing_weights")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KERNEL_ENV = {
    "JAX_PLATFORMS": "cpu",
    # One CPU device (the notebook shards nothing); compile fast rather than run fast: tiny arrays.
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
                 "--xla_llvm_disable_expensive_passes=true",
    "MPLBACKEND": "Agg",
}


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
  """Puts a ``python3`` kernelspec that runs this interpreter first on ``JUPYTER_PATH``.

  The spec installed with ipykernel says ``python``, which jupyter_client maps to ``sys.executable``; an
  explicit spec keeps that true whatever other ``python3`` specs exist (user dir, system dir).
  """
  spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  spec = {
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (test)",
      "language": "python",
      "env": KERNEL_ENV,
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  resolved = KernelSpecManager().get_kernel_spec("python3")
  assert resolved.argv[0] == sys.executable, resolved.argv
  return "python3"


@pytest.mark.slow
def test_loss_variants_notebook_runs_and_writes_figures(tmp_path, python3_kernel):
  copy = tmp_path / NOTEBOOK.name
  shutil.copy(NOTEBOOK, copy)
  nb = nbformat.read(copy, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
  start = math.floor(time.time())  # PNG mtimes may be truncated to whole seconds
  client = NotebookClient(nb, timeout=300, kernel_name=python3_kernel,
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()
  elapsed = time.time() - start
  print(f"notebook executed in {elapsed:.1f} s")

  errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if out.output_type == "error"]
  assert not errors, errors
  kernel_python = nb.cells[-1].outputs[0]["text"].strip()
  assert pathlib.Path(kernel_python).resolve() == pathlib.Path(sys.executable).resolve()
  for name in FIGURES:
    path = IMG_DIR / f"{name}.png"
    assert path.is_file(), path
    assert path.stat().st_mtime >= start, f"{path} was not rewritten by the notebook"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, (path, len(data))
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 200 and width > 200, (path, height, width)


def test_committed_notebook_has_no_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert code
  for cell in code:
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


COCONUT_NOTEBOOK = ROOT / "notebooks" / "coconut.ipynb"


@pytest.mark.slow
def test_coconut_notebook_runs_and_prints_the_comparison(python3_kernel):
  nb = nbformat.read(COCONUT_NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name=python3_kernel,
                          resources={"metadata": {"path": str(COCONUT_NOTEBOOK.parent)}})
  start = time.time()
  client.execute()
  print(f"notebook executed in {time.time() - start:.1f} s")
  errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if out.output_type == "error"]
  assert not errors, errors
  text = "".join(out.get("text", "") for out in nb.cells[-2].outputs)
  rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
  assert [row.split("|")[1].strip() for row in rows] == [
      "no_cot", "cot", "coconut", "no_curriculum", "no_thought", "pause_as_thought"], text
  for row in rows:
    accuracy, tokens = (float(x) for x in row.split("|")[2:4])
    assert 0.0 <= accuracy <= 1.0 and tokens >= 1.0, row


def test_committed_coconut_notebook_has_no_outputs():
  nb = nbformat.read(COCONUT_NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
