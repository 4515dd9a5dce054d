"""The quiet start (jaxrl/_platform.py): ``JAX_PLATFORMS=cpu`` only where no accelerator shows and the user
chose nothing, the CUDA stub's notices dropped and every other stderr byte kept, and ``jaxrl info`` in a
clean environment printing its own first line first."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl import _platform

ROOT = Path(__file__).resolve().parents[1]
PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
NOTICE = (b"I0000 00:00:1796493976.651094   23109 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
          b"GPU will not be used.\n")


def test_drop_notices_keeps_everything_but_the_stub_notices_and_their_preambles():
  other = b"E0000 00:00:1.0 real_error.cc:1] something the user must see\n"
  text = PREAMBLE + NOTICE + b"a python warning\n" + PREAMBLE + other + PREAMBLE + NOTICE + b"no newline"
  assert _platform.drop_notices(text) == b"a python warning\n" + PREAMBLE + other + b"no newline"
  assert _platform.drop_notices(b"") == b""


def test_the_capture_writes_back_other_output_also_when_the_block_raises(capfd):
  with pytest.raises(RuntimeError, match="boom"):
    with _platform._stderr_without_notices():
      os.write(2, PREAMBLE + NOTICE + b"kept line\n")
      raise RuntimeError("boom")
  os.write(2, b"after\n")
  assert capfd.readouterr().err == "kept line\nafter\n"


def _fake_machine(monkeypatch, tmp_path, *, files=(), pci=()):
  """Device files and PCI ``(vendor, device)`` pairs under ``tmp_path`` instead of /dev and /sys."""
  for f in files:
    (tmp_path / f).touch()
  for i, (vendor, device) in enumerate(pci):
    d = tmp_path / "pci" / f"0000:00:{i:02x}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  monkeypatch.setattr(_platform, "_DEVICE_FILES", tuple(str(tmp_path / n) for n in ("nvidia0", "nvidiactl", "kfd")))
  monkeypatch.setattr(_platform, "_DEVICE_GLOBS", (str(tmp_path / "accel*"),))
  monkeypatch.setattr(_platform, "_PCI_VENDOR_FILES", str(tmp_path / "pci" / "*" / "vendor"))


@pytest.mark.parametrize("files, pci, present", [
    ((), [("0x8086", "0x1237"), ("0x1ae0", "0x0042")], False),  # Intel bridge, Google gVNIC: a CPU VM
    (("nvidiactl",), [], True),  # an NVIDIA driver's control node (containers)
    (("accel0",), [], True),  # a TPU v4/v5e chip
    ((), [("0x1ae0", "0x0062")], True),  # a TPU v5p chip on the PCI bus
])
def test_accelerator_present_reads_device_nodes_and_tpu_pci_ids(monkeypatch, tmp_path, files, pci, present):
  _fake_machine(monkeypatch, tmp_path, files=files, pci=pci)
  assert _platform.accelerator_present() is present


@pytest.mark.parametrize("env, accelerator, expected", [
    (None, False, "cpu"),  # nothing chosen, nothing found: the CPU
    (None, True, None),  # an accelerator: JAX chooses
    ("cuda", False, "cuda"),  # the user's choice wins
    ("", False, ""),  # ... also JAX's own choice, asked for by an empty value
])
def test_choose_platform_sets_cpu_only_without_accelerator_or_user_choice(monkeypatch, env, accelerator, expected):
  monkeypatch.delitem(sys.modules, "jax")  # as before JAX is imported (restored after the test)
  monkeypatch.setattr(sys, "platform", "linux")
  monkeypatch.setattr(_platform, "accelerator_present", lambda: accelerator)
  if env is None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  else:
    monkeypatch.setenv("JAX_PLATFORMS", env)
  _platform.choose_platform()
  assert os.environ.get("JAX_PLATFORMS") == expected


def test_quiet_import_hook_only_for_platforms_without_cuda(monkeypatch):
  monkeypatch.delitem(sys.modules, "jax")
  monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
  for value, hooked in [("cuda", False), ("cpu,gpu", False), ("", False), ("cpu", True), ("tpu,cpu", True)]:
    monkeypatch.setenv("JAX_PLATFORMS", value)
    assert _platform.quiet_jax_import() is hooked, value
  assert sum(isinstance(f, _platform._QuietJaxFinder) for f in sys.meta_path) == 1  # installed once


@pytest.mark.skipif(_platform.accelerator_present(), reason="an accelerator host: JAX_PLATFORMS is JAX's choice")
def test_info_in_a_clean_environment_prints_its_own_line_first():
  """What a newcomer runs first: no ``JAX_PLATFORMS`` or ``XLA_FLAGS``, the ``plan`` extra's plugins
  installed (as scripts/run.sh does). Nothing may come before ``jaxrl info``'s first line."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_", "TF_CPP"))}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run([sys.executable, "-m", "jaxrl.cli", "info"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  lines = (proc.stderr + proc.stdout).splitlines()
  assert lines and lines[0].startswith("jax ") and "backend=cpu" in lines[0], lines[:5]
  assert not [ln for ln in lines if "Traceback" in ln or "cudart" in ln or "TPU_" in ln], lines



def test_quickstart_in_a_clean_environment_prints_its_own_line_first(tmp_path):
  """The README's first command (``bash scripts/run.sh quickstart`` runs ``jaxrl quickstart``), shortened to one SFT
  and one GRPO step, with no ``JAX_*`` / ``XLA_*`` / ``TPU_*`` variables and the ``plan`` extra's plugins installed:
  its first line is its own SFT progress line, and no plugin traceback, CUDA stub or libtpu notice appears."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_", "TF_CPP"))}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run([sys.executable, "-m", "jaxrl.cli", "quickstart", "--out-dir", str(tmp_path), "--sft-steps", "1",
                         "--rl-steps", "1", "--no-tensorboard"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
  assert lines and lines[0].startswith("sft 1/1"), lines[:5]
  assert not [ln for ln in lines if "Traceback" in ln or "cudart" in ln or "TPU_" in ln], lines

def test_only_the_pytorch_advice_of_transformers_is_dropped():
  _platform.quiet_torch_advice()
  _platform.quiet_torch_advice()  # idempotent: one filter
  logger = logging.getLogger("transformers")
  assert sum(isinstance(f, _platform._NoTorchAdvice) for f in logger.filters) == 1
  records: list[logging.LogRecord] = []
  handler = logging.Handler()
  handler.emit = records.append
  logger.addHandler(handler)
  try:
    logger.warning("PyTorch was not found. Models won't be available and only tokenizers, ... can be used.")
    logger.warning("a tokenizer warning the user must see")
  finally:
    logger.removeHandler(handler)
  assert [r.getMessage() for r in records] == ["a tokenizer warning the user must see"]
