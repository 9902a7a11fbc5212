"""Which JAX backends to start on a machine that has libtpu installed but no TPU."""

from __future__ import annotations

import glob
import importlib.util
import os


def skip_missing_tpu() -> None:
  """With libtpu installed (requirements-tpu.txt: compiling for TPUs here, see transformer_jax/aot) on a
  machine without a TPU, JAX would first try to start a TPU backend, print libtpu's errors
  about the missing TPU environment, and fall back. Choose the CPU up front instead. Does
  nothing where JAX_PLATFORMS is set, on a TPU VM (/dev/accel*, /dev/vfio) or where the CUDA
  plugin is installed. Must run before JAX starts a backend (its first computation)."""
  if ("JAX_PLATFORMS" not in os.environ and importlib.util.find_spec("libtpu") is not None
      and not glob.glob("/dev/accel*") and not os.path.exists("/dev/vfio")
      and importlib.util.find_spec("jax_cuda12_plugin") is None):
    os.environ["JAX_PLATFORMS"] = "cpu"
