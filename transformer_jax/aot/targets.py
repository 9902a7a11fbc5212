"""What aot compiles for: a named slice of accelerators, described as compile-only devices
on this machine. The chips themselves (peaks, HBM) are rows of `accelerators.CHIPS`; each
platform has one branch here that turns a target name into devices."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Iterator

from transformer_jax.accelerators import TARGET_CHIPS, Chip, chip_of
from transformer_jax.errors import UserError


class UsageError(UserError):
  """A topology, mesh or config that cannot be compiled as asked (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str                     # as given, e.g. "v5p:2x2x2"
  chip: Chip                    # hbm_gib: the memory a program may use per chip
  devices: tuple                # compile-only jax devices, one per chip


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
  """libtpu, loading on a machine without a TPU, logs warnings about the missing TPU VM
  metadata straight to file descriptor 2; they do not concern compile-only use. Errors
  still arrive as Python exceptions."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as devnull:
      os.dup2(devnull.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def _chips_of(platform: str) -> list[str]:
  return sorted(name for name, chip in TARGET_CHIPS.items() if chip.platform == platform)


def describe(name: str, flag: str = "--topology") -> Topology:
  """The compile-only devices of a target, by its chip's platform: a TPU slice "GEN:SHAPE".
  `flag` names the flag in errors."""
  chip = TARGET_CHIPS.get(name.partition(":")[0])
  if chip is None or ":" not in name:
    raise UsageError(f"{flag}={name!r}: expected a TPU slice GEN:SHAPE with GEN one of "
                     f"{_chips_of('tpu')}, e.g. v5p:2x2x2 (8 chips) or v5e:2x4")
  if chip.platform == "tpu":
    return tpu_topology(name, flag)
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
    with _quiet_stderr():
      devices = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                             **kwargs).devices
  except Exception as e:  # libtpu's messages are several lines; its first one says why.
    raise UsageError(f"{flag}={name!r}: libtpu cannot describe it ({_first_line(e)}); is "
                     "jax[tpu] installed (pip install -r requirements-tpu.txt), and is the "
                     "shape one that generation has, e.g. v5e:2x4, v5p:2x2x2?") from None
  return Topology(name, _checked(chip, devices, name, flag), tuple(devices))


def _checked(chip: Chip, devices: list, name: str, flag: str) -> Chip:
  """`chip`, once the described devices are found to be that chip."""
  found = devices[0].device_kind
  if chip_of(found) != chip:
    raise UsageError(f"{flag}={name!r} gave {found!r} devices, not {chip.device_kind!r}")
  return chip


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def with_hbm(topology: Topology, hbm_gib: float) -> Topology:
  """The topology judged against `hbm_gib` per chip instead of the chip's whole HBM (to keep
  headroom, e.g. for XLA's own reservations or a profiler)."""
  return dataclasses.replace(topology, chip=dataclasses.replace(topology.chip,
                                                                hbm_gib=hbm_gib))
