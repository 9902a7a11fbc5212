"""What aot compiles for: a named slice of accelerators, described as compile-only devices
on this machine. The chips themselves (peaks, HBM) are rows of `accelerators.CHIPS`; each
platform has one branch here that turns a target name into devices."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import re

from transformer_jax.accelerators import TARGET_CHIPS, Chip, GiB, chip_of
from transformer_jax.errors import UserError
from transformer_jax.modules import kernels
from transformer_jax.platforms import quiet_stderr

# A GPU's target description (the GpuTargetConfigProto text XLA compiles for), one file per
# aot target name: <target>.txtpb.
GPU_SPECS = pathlib.Path(__file__).parent / "gpu_specs"
# JAX's GPU allocator takes this fraction of the device's memory unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (JAX's "GPU memory allocation" docs).
JAX_GPU_MEMORY_FRACTION = 0.75
# The memory the compile-only GPU compiler is told the device has. Told the real figure, XLA
# rematerializes a step that exceeds it until it fits; on a real H200 (jax 0.11.2) the same
# step was not rematerialized and ran out of memory at the batch such a plan had promised
# (benchmarks/RESULTS.md, "GPU: measured on one H200"). So the compiler is told a memory no
# program reaches, and the plan judges what the step needs as written.
UNREACHED_GPU_MEMORY_BYTES = 2 ** 50


class UsageError(UserError):
  """A topology, mesh or config that cannot be compiled as asked (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str                     # as given, e.g. "v5p:2x2x2", "h100-sxm:8"
  chip: Chip                    # hbm_gib: the memory a program may use per chip
  devices: tuple                # compile-only jax devices, one per chip
  memory_note: str = ""         # how that memory was arrived at, where not the whole HBM


def _chips_of(platform: str) -> list[str]:
  return sorted(name for name, chip in TARGET_CHIPS.items() if chip.platform == platform)


def describe(name: str, flag: str = "--topology") -> Topology:
  """The compile-only devices of a target: a TPU slice "GEN:SHAPE" or "KIND:N" GPUs on one
  or more hosts of 8. `flag` names the flag in errors."""
  chip = TARGET_CHIPS.get(name.partition(":")[0])
  if chip is None or ":" not in name:
    raise UsageError(f"{flag}={name!r}: expected a TPU slice GEN:SHAPE with GEN one of "
                     f"{_chips_of('tpu')}, e.g. v5p:2x2x2 (8 chips) or v5e:2x4, or GPUs KIND:N "
                     f"with KIND one of {_chips_of('cuda')}, e.g. h100-sxm:8")
  if chip.platform == "tpu":
    return tpu_topology(name, flag)
  if chip.platform == "cuda":
    return gpu_topology(name, flag)
  raise UsageError(f"{flag}={name!r}: no compiler for platform {chip.platform!r}")


def tpu_topology(name: str, flag: str = "--topology") -> Topology:
  """The compile-only devices of a TPU slice named "GEN:AxB[xC]" (GEN in v4, v5e, v5p,
  v6e). One device per chip: v4 as megacore (its two TensorCores as one device, as a v4
  runtime runs by default); v5p is megacore already; v5e and v6e have one core."""
  generation = name.split(":")[0]
  chip = TARGET_CHIPS.get(generation)
  if chip is None or chip.platform != "tpu" or ":" not in name:
    raise UsageError(f"{flag}={name!r}: expected GEN:SHAPE with GEN one of "
                     f"{_chips_of('tpu')}, e.g. v5p:2x2x2 (8 chips) or v5e:2x4")
  # Compile-only use of libtpu: another process (a test run, a trainer) may hold libtpu's
  # single-user lockfile; this process never opens a TPU, so it need not take it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  kwargs = {"chip_config_name": "megacore"} if generation == "v4" else {}
  try:
    with quiet_stderr():
      devices = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                             **kwargs).devices
  except Exception as e:  # libtpu's messages are several lines; its first one says why.
    raise UsageError(f"{flag}={name!r}: libtpu cannot describe it ({_first_line(e)}); is "
                     "jax[tpu] installed (pip install -r requirements-tpu.txt), and is the "
                     "shape one that generation has, e.g. v5e:2x4, v5p:2x2x2?") from None
  return Topology(name, _checked(chip, devices, name, flag), tuple(devices))


def gpu_topology(name: str, flag: str = "--target") -> Topology:
  """N compile-only GPUs of one kind, "KIND:N" (8 to a host, as in a DGX/HGX node), from
  the kind's target description in gpu_specs/ and XLA's CUDA compiler plugin. A program may
  use the share of each GPU's memory that JAX's allocator takes (see
  JAX_GPU_MEMORY_FRACTION)."""
  kind, _, count = name.partition(":")
  chip = TARGET_CHIPS.get(kind)
  if chip is None or chip.platform != "cuda" or not count.isdigit() or int(count) < 1:
    raise UsageError(f"{flag}={name!r}: expected KIND:N with KIND one of {_chips_of('cuda')} "
                     "and N GPUs, e.g. h100-sxm:8")
  gpus = int(count)
  if gpus > 8 and gpus % 8:
    raise UsageError(f"{flag}={name!r}: more than 8 GPUs come in hosts of 8; give a multiple "
                     "of 8")
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    raise UsageError(f"{flag}={name!r}: compiling for NVIDIA GPUs needs XLA's CUDA compiler "
                     "plugin; install it with: pip install -r requirements-gpu.txt")
  spec = (GPU_SPECS / f"{kind}.txtpb").read_text()
  found = re.search(r"device_memory_size: (\d+)", spec)
  if found is None:
    raise UsageError(f"{flag}={name!r}: its target description names no device_memory_size")
  memory = int(found.group(1))
  compiled_spec = spec.replace(found.group(0),
                               f"device_memory_size: {UNREACHED_GPU_MEMORY_BYTES}")
  from jax.experimental import topologies
  hosts, per_host = (1, gpus) if gpus <= 8 else (gpus // 8, 8)
  try:
    devices = topologies.get_topology_desc(topology_name="", platform="cuda",
                                           target_config=compiled_spec,
                                           topology=f"1x{hosts}x{per_host}").devices
  except Exception as e:
    raise UsageError(f"{flag}={name!r}: the CUDA plugin cannot describe it ({_first_line(e)}); "
                     "is requirements-gpu.txt installed at the versions it names?") from None
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEMORY_FRACTION))
  chip = dataclasses.replace(_checked(chip, devices, name, flag),
                             hbm_gib=memory * fraction / GiB)
  note = (f"{fraction:.0%} of the {memory / GiB:.1f} GiB an {getattr(devices[0], 'device_kind', name)} reports: the "
          "share JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION"
          + (f"={fraction:g})" if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ
             else f", default {JAX_GPU_MEMORY_FRACTION:g}; set it for the run, and here, to use more)"))
  return Topology(name, chip, tuple(devices), note)


def _checked(chip: Chip, devices: list, name: str, flag: str) -> Chip:
  """`chip`, once the described devices are found to be that chip."""
  found = devices[0].device_kind
  if chip_of(found) != chip:
    raise UsageError(f"{flag}={name!r} gave {found!r} devices, not {chip.device_kind!r}")
  return chip


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def tracing_for(topology: Topology) -> contextlib.AbstractContextManager:
  """Programs traced inside are those the topology's chips run: "auto" attention resolves
  to their kernel, and a kernel that cannot be traced for them is an error, not a fallback
  to this CPU's path (modules/kernels.py)."""
  device = topology.devices[0]
  return kernels.target_platform(device.platform, getattr(device, "compute_capability", None))


def with_hbm(topology: Topology, hbm_gib: float) -> Topology:
  """The topology judged against `hbm_gib` per chip instead of the chip's whole HBM (to keep
  headroom, e.g. for XLA's own reservations or a profiler)."""
  return dataclasses.replace(topology, chip=dataclasses.replace(topology.chip,
                                                                hbm_gib=hbm_gib))
