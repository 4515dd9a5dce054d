"""Target hardware (a leaf: pure data, stdlib imports only): topology arguments and per-device numbers.

``jaxrl plan`` compiles for these targets and a recipe's ``plan`` section names them; JAX is imported only
when a target's compile-only devices are asked for.

TPU targets are compile-only devices from libtpu (``jax.experimental.topologies.get_topology_desc``
with ``platform="tpu"``); NVIDIA targets are compile-only devices of the CUDA PJRT plugin, described
by a ``GpuTargetConfigProto`` text spec, under ``JAX_PLATFORMS=cpu``. No accelerator is needed.

Peak FLOP/s are dense bf16 per device (a TPU chip, or one GPU); HBM bandwidth in bytes/s per device.
Sources: Google Cloud TPU system-architecture pages (v5e, v5p, v6e) and NVIDIA's H100/H200 data sheets.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """One named hardware target: how to get its compile-only devices, and its per-device limits."""

  name: str
  platform: str
  "``tpu`` or ``cuda``."
  devices: int
  "Devices JAX sees (TPU chips with megacore, or GPUs); 0 for ``cpu``: this process's CPU devices."
  hbm_bytes: int
  "HBM per device."
  peak_flops: float
  "Dense bf16 FLOP/s per device."
  hbm_bandwidth: float
  "HBM bytes/s per device."
  topology: dict[str, Any]
  "Keyword arguments of ``get_topology_desc`` (without the GPU's ``target_config``)."
  gpu_spec: str | None = None
  "GpuTargetConfigProto text of one device (NVIDIA targets)."

  @property
  def slices(self) -> int:
    return int(self.topology.get("num_slices", 1))

  def compile_devices(self) -> list:
    """The target's compile-only devices (cached); raises ``TargetUnavailable`` with the reason."""
    return list(_devices(self.name))


class TargetUnavailable(RuntimeError):
  """The compiler plugin for a target (libtpu, the CUDA plugin) is missing or cannot start here."""


def _gpu_spec(*, name: str, cores: int, memory: int, bandwidth: int, l2: int, clock_ghz: float) -> str:
  """A Hopper (sm_90) ``GpuTargetConfigProto`` text: the fields XLA's GPU compiler reads."""
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""


def _tpu(name, *, chips, hbm_gib, tflops, gbps, topology_name, chip_config="default", host=(2, 2, 1), slices=1):
  return Target(name=name, platform="tpu", devices=chips * slices, hbm_bytes=int(hbm_gib * GiB),
                peak_flops=tflops * 1e12, hbm_bandwidth=gbps * 1e9,
                topology=dict(topology_name=topology_name, chip_config_name=chip_config,
                              chips_per_host_bounds=host, num_slices=slices, wrap=(False, False, False)))


def _gpu(name, *, device_name, gpus, hbm_bytes, tflops, bandwidth):
  return Target(name=name, platform="cuda", devices=gpus, hbm_bytes=hbm_bytes, peak_flops=tflops * 1e12,
                hbm_bandwidth=bandwidth, topology=dict(topology=f"1x1x{gpus}"),
                gpu_spec=_gpu_spec(name=device_name, cores=132, memory=hbm_bytes, bandwidth=int(bandwidth),
                                   l2=50 * 2**20, clock_ghz=1.98))


_V5P = dict(hbm_gib=95.74, tflops=459.0, gbps=2765.0, chip_config="megacore")
TARGETS: dict[str, Target] = {t.name: t for t in [
    _tpu("v5e-8", chips=8, hbm_gib=16.0, tflops=197.0, gbps=819.0, topology_name="v5e:2x4", host=(2, 4, 1)),
    _tpu("v5p-8", chips=4, topology_name="v5:2x2x1", **_V5P),
    _tpu("v5p-8x2", chips=4, topology_name="v5:2x2x1", slices=2, **_V5P),
    _tpu("v5p-64", chips=32, topology_name="v5:4x4x2", **_V5P),
    _tpu("v5p-128", chips=64, topology_name="v5:4x4x4", **_V5P),
    _tpu("v6e-8", chips=8, hbm_gib=31.25, tflops=918.0, gbps=1640.0, topology_name="v6e:2x4", host=(2, 4, 1)),
    _gpu("h100x8", device_name="NVIDIA H100 80GB HBM3", gpus=8, hbm_bytes=80 * 10**9 - 5 * 2**30 // 10,
         tflops=989.0, bandwidth=3.35e12),
    Target(name="cpu", platform="cpu", devices=0, hbm_bytes=16 * GiB, peak_flops=1e12, hbm_bandwidth=1e11,
           topology={}),
    _gpu("h200x8", device_name="NVIDIA H200", gpus=8, hbm_bytes=141 * 10**9, tflops=989.0, bandwidth=4.8e12),
]}
"""Target name → :class:`Target`. ``v5p-N`` counts TensorCores (N/2 megacore chips), as Cloud TPU names do."""


def get_target(name: str) -> Target:
  if name not in TARGETS:
    raise ValueError(f"--target: unknown {name!r}; known: {sorted(TARGETS)}")
  return TARGETS[name]


@functools.lru_cache(maxsize=None)
def _devices(name: str) -> tuple:
  import os
  # libtpu guards a real chip with /tmp/libtpu_lockfile and probes the GCE metadata server; neither
  # applies to compile-only devices, and several planning processes may run at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  from jax.experimental import topologies
  t = TARGETS[name]
  if t.platform == "cpu":  # this process's CPU devices (tests: 8 fake ones); a nominal 16 GiB "HBM"
    import jax
    return tuple(jax.devices("cpu"))
  kwargs = dict(t.topology)
  if t.platform == "cuda":
    kwargs["target_config"] = t.gpu_spec
  try:
    if t.platform == "tpu":
      import libtpu  # noqa: F401  (a clear reason when it is missing)
    topo = topologies.get_topology_desc(platform=t.platform, **kwargs)
  except ImportError as e:
    raise TargetUnavailable(f"{name}: libtpu is not installed ({e}); pip install 'jaxrl[plan]'") from e
  except Exception as e:  # noqa: BLE001  (plugin missing or refusing: report why)
    hint = "pip install 'jaxrl[plan]'" + ("; run with JAX_PLATFORMS=cpu" if t.platform == "cuda" else "")
    raise TargetUnavailable(f"{name}: cannot create compile-only {t.platform} devices: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({hint})") from e
  devices = tuple(topo.devices)
  if len(devices) != t.devices:
    raise TargetUnavailable(f"{name}: the topology gave {len(devices)} devices, expected {t.devices}")
  return devices
