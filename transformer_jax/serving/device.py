"""The device a served model runs on, and one clear error when this machine's GPU cannot be
used for it.

Each JAX process on a GPU takes 75% of its memory when it starts (XLA's preallocation). A
second process on the same GPU, such as a server started beside a tool that already loaded
a model, then gets too little: its GPU backend fails to start and JAX quietly falls back to
the CPU (a log warning only), or a later allocation fails with RESOURCE_EXHAUSTED. A server
must instead stop at once and say which environment variables share the GPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from transformer_jax.errors import UserError

PREALLOCATE, MEM_FRACTION = "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"
MEMORY_HINT = (f"if another JAX process uses this GPU, start each one with {PREALLOCATE}=false "
               f"(take memory as needed) or {MEM_FRACTION}=0.4 (a share each); or serve on "
               "the CPU with JAX_PLATFORMS=cpu")
# Words of XLA's and CUDA's errors when a GPU's memory runs out (or is too short to start).
_OUT_OF_MEMORY = ("resource_exhausted", "out of memory", "out_of_memory",
                  "no supported devices found")
_GPU_PLATFORMS = ("cuda", "rocm")


def _one_line(text: str, limit: int = 400) -> str:
  """XLA's messages span lines; a user error is one."""
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def out_of_memory(error: BaseException | str) -> bool:
  text = str(error).lower()
  return any(words in text for words in _OUT_OF_MEMORY)


def model_failed(error: BaseException | str) -> str:
  """A 500's message for a model call that failed; out of GPU memory, naming the
  variables that share a GPU."""
  hint = f"; {MEMORY_HINT}" if out_of_memory(error) else ""
  return f"the model failed: {error}{hint}"


def memory_error(error: BaseException, what: str) -> UserError | None:
  """The user error for `error` if it says the GPU's memory ran out while doing `what`,
  else None."""
  if not out_of_memory(error):
    return None
  return UserError(f"{what}: the GPU ran out of memory ({_one_line(str(error))}); "
                   f"{MEMORY_HINT}")


def describe(device: Any) -> dict[str, str]:
  """What /healthz says of a jax.Device: {"device": platform, "device_kind": its model}."""
  return {"device": device.platform, "device_kind": device.device_kind}


def start() -> dict[str, str]:
  """Starts JAX's backends and describes the device the model will run on (the first,
  where jax.device_put puts the parameters); UserError as `check_backends` says."""
  import jax
  chosen = os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None)
  return check_backends(jax.devices, chosen)


def check_backends(devices: Callable[..., list[Any]], chosen: str | None) -> dict[str, str]:
  """describe(devices()[0]), given jax.devices and the platforms JAX_PLATFORMS chose (if
  any). UserError when a chosen backend fails to start, or when, none chosen, the GPU
  backend failed and JAX fell back to the CPU."""
  try:
    device = devices()[0]
  except RuntimeError as e:           # JAX_PLATFORMS named a backend that did not start
    raise UserError(f"JAX could not start its backend ({_one_line(str(e))}); "
                    f"{MEMORY_HINT}") from e
  if device.platform == "cpu" and not chosen:     # JAX chose the CPU: did a GPU fail?
    for platform in _GPU_PLATFORMS:
      try:
        devices(platform)
      except RuntimeError as e:
        # "Unknown backend": no such GPU or plugin here, so the CPU is the right choice.
        if "failed to initialize" in str(e):
          raise UserError(f"this machine's GPU did not start, and JAX would serve on the "
                          f"CPU instead ({_one_line(str(e))}); {MEMORY_HINT}") from e
  return describe(device)
