"""Which JAX backends to start on a machine that has accelerator plugins installed only to
compile for accelerators it does not have (libtpu: requirements-tpu.txt; XLA's CUDA
compiler: requirements-gpu.txt; see transformer_jax/aot)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
  """File descriptor 2 to /dev/null: for native libraries that log, while loading, about the
  accelerator this machine lacks. Errors still arrive as Python exceptions."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as devnull:
      os.dup2(devnull.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def _has_accelerator() -> bool:
  """A TPU VM (/dev/accel*, /dev/vfio) or an NVIDIA GPU (/dev/nvidia0, ...)."""
  return bool(glob.glob("/dev/accel*") or os.path.exists("/dev/vfio")
              or glob.glob("/dev/nvidia[0-9]*"))


def skip_missing_tpu() -> None:
  """On a machine without a TPU or GPU where libtpu or the CUDA plugin is installed, JAX
  would try to start their backends, print their errors about the missing hardware, and
  fall back to the CPU. Choose the CPU up front (unless JAX_PLATFORMS says otherwise), and
  load the CUDA plugin (whose libraries each log that no CUDA driver is found, whatever
  JAX_PLATFORMS says) with those lines silenced. Does nothing where an accelerator is
  present. Must run before JAX starts a backend and, for the silencing, before jax is
  imported."""
  if _has_accelerator():
    return
  cuda = importlib.util.find_spec("jax_cuda12_plugin") is not None
  if not cuda and importlib.util.find_spec("libtpu") is None:
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if cuda and "jax" not in sys.modules:
    with quiet_stderr():
      import jax  # noqa: F401  (loads the plugin's extension libraries)
      from jax._src import xla_bridge
      # JAX registers its plugins once, on first use of a backend or topology; do it now,
      # quietly (the plugin's compiler library logs the same line).
      getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()


def cudnn_version() -> int | None:
  """The version of the cuDNN library that JAX's CUDA plugin loads (e.g. 91900 for 9.19.0),
  printed beside every GPU figure; None where there is no such plugin or library."""
  try:
    from jax._src.lib import cuda_versions
    return int(cuda_versions.cudnn_get_version()) if cuda_versions else None
  except Exception:    # the plugin's libraries missing or failing to load
    return None
