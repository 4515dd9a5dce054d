"""The JAX platform on a machine without accelerators, and a quiet start there (a leaf: stdlib only, run
by ``jaxrl/__init__.py`` before JAX is imported).

The ``plan`` extra installs compile-only plugins (libtpu and the CUDA PJRT plugin) so that ``jaxrl plan``
compiles for TPU and NVIDIA targets on any machine. Left to choose its backends, JAX starts every plugin
it finds: on a machine without the hardware each command would print a CUDA plugin traceback, libtpu's
``TPU_ACCELERATOR_TYPE``/``TPU_WORKER_HOSTNAMES`` errors and the CUDA stub's "Could not find cuda
drivers" notices before its first line. So, at ``import jaxrl``:

1. :func:`choose_platform`: if the user did not set ``JAX_PLATFORMS`` and this Linux machine shows no
   accelerator (:func:`accelerator_present`: the device files and PCI ids JAX itself checks), it sets
   ``JAX_PLATFORMS=cpu``, the backend JAX would pick there anyway. No plugin starts as a backend; the
   plugins stay registered, so ``jaxrl plan`` still makes its compile-only TPU and CUDA devices.
2. :func:`quiet_jax_import`: when the platforms leave CUDA out, the first ``import jax`` and JAX's plugin
   discovery run with file descriptor 2 captured; the CUDA stub's notices are dropped and every other
   byte is written back to stderr unchanged.
3. :func:`quiet_torch_advice`: transformers' "PyTorch was not found" advice is dropped (jaxrl uses
   transformers for tokenizers and configs only); its other messages stay.

A ``JAX_PLATFORMS`` the user set (even to ``""``, JAX's own choice) always wins; docs/platforms.md.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
"""NVIDIA (bare metal, containers), WSL2 and AMD ROCm device nodes: a driver that can run a GPU has one."""
_DEVICE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*")
"""More NVIDIA GPUs; TPU chips (v2 to v5e as ``/dev/accel*``, v5p and later through VFIO)."""
_PCI_VENDOR_FILES = "/sys/bus/pci/devices/*/vendor"
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
"""TPU chips among Google's PCI devices (the ids ``jax._src.hardware_utils`` counts; not gVNIC or NVMe)."""

_STUB_NOTICE = b"cudart_stub.cc"
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_GPU_PLATFORMS = frozenset({"cuda", "gpu", "rocm"})


def accelerator_present() -> bool:
  """True if this machine shows a GPU or TPU: a device node of a GPU driver or a TPU chip, or a TPU on
  the PCI bus. A file that cannot be read counts as an accelerator (the safe side: JAX chooses)."""
  if any(os.path.exists(f) for f in _DEVICE_FILES) or any(glob.glob(g) for g in _DEVICE_GLOBS):
    return True
  for vendor in glob.glob(_PCI_VENDOR_FILES):
    try:
      if (Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
          and Path(vendor).with_name("device").read_text().strip() in _TPU_PCI_DEVICES):
        return True
    except OSError:
      return True
  return False


def choose_platform() -> str | None:
  """Sets ``JAX_PLATFORMS=cpu`` on a Linux machine without accelerators, unless the user set it or JAX
  is already imported (its configuration is read then). Returns the value set, or None."""
  if "JAX_PLATFORMS" in os.environ or "jax" in sys.modules or not sys.platform.startswith("linux"):
    return None
  if accelerator_present():
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"
  return "cpu"


def quiet_jax_import() -> bool:
  """Makes the first ``import jax`` drop the CUDA stub's notices when ``JAX_PLATFORMS`` names platforms
  without CUDA. Returns whether the import hook was installed (never once JAX is imported)."""
  platforms = {p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
  if "jax" in sys.modules or not platforms or platforms & _GPU_PLATFORMS:
    return False
  if not any(isinstance(f, _QuietJaxFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _QuietJaxFinder())
  return True


def quiet_torch_advice() -> None:
  """Drops transformers' "PyTorch was not found" advice, logged by its root logger at import."""
  logger = logging.getLogger("transformers")
  if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
    logger.addFilter(_NoTorchAdvice())


class _NoTorchAdvice(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found.")


def drop_notices(text: bytes) -> bytes:
  """``text`` without the CUDA stub's notice lines (and the absl preamble line printed before each)."""
  lines = text.splitlines(keepends=True)
  kept = []
  for i, line in enumerate(lines):
    following = lines[i + 1] if i + 1 < len(lines) else b""
    if _STUB_NOTICE in line or (line.startswith(_ABSL_PREAMBLE) and _STUB_NOTICE in following):
      continue
    kept.append(line)
  return b"".join(kept)


@contextlib.contextmanager
def _stderr_without_notices():
  """Captures file descriptor 2 (C++ logging included) while the block runs, then writes back all of
  it but the CUDA stub's notices, also when the block raises."""
  _flush_stderr()
  try:
    saved = os.dup(2)
  except OSError:  # no stderr at all: nothing to keep quiet
    yield
    return
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      _flush_stderr()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      rest = drop_notices(captured.read())
      while rest:
        rest = rest[os.write(2, rest):]


def _flush_stderr() -> None:
  if sys.stderr is not None:
    sys.stderr.flush()


class _QuietJaxFinder(importlib.abc.MetaPathFinder):
  """Finds ``jax`` once, through the other finders, and has it loaded by :class:`_QuietLoader`."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname != "jax":
      return None
    with contextlib.suppress(ValueError):  # another thread's import got here first
      sys.meta_path.remove(self)
    spec = importlib.util.find_spec("jax")
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


class _QuietLoader(importlib.abc.Loader):
  """Runs JAX's own loader, then JAX's plugin discovery (which loads the CUDA plugin's libraries), inside
  :func:`_stderr_without_notices`; the module keeps JAX's own loader."""

  def __init__(self, loader: importlib.abc.Loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module) -> None:
    module.__loader__ = module.__spec__.loader = self._loader
    with _stderr_without_notices():
      self._loader.exec_module(module)
      # Registration only (no backend starts; safe before XLA_FLAGS or jax_platforms change): JAX calls
      # it again at the first backend use and returns at once.
      discover = getattr(importlib.import_module("jax._src.xla_bridge"), "_discover_and_register_pjrt_plugins",
                         None)
      if discover is not None:
        discover()
