"""Preemption: SIGTERM or SIGINT asks the training loop to stop after the current step.

Cloud schedulers announce preemption with SIGTERM (Cloud TPU maintenance events, spot/
preemptible VMs, Kubernetes pod eviction) and kill the process a grace period later. The
loop polls `should_stop(step)` once per step; when it returns True the loop saves a
checkpoint, waits until it is on disk and returns normally (exit status 0).

On several hosts (jax.distributed initialized) the hosts must stop at the same step, so
the signal handling is left to JAX's preemption service, whose sync point picks a step that
every host reaches (`multihost_utils.reached_preemption_sync_point`), and no Python handler
is installed.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _multi_host() -> bool:
  return jax.process_count() > 1


class PreemptionWatcher:
  """Between start() and stop() (or as a context manager), the first SIGTERM/SIGINT is
  recorded instead of killing the process; a second one acts as usual (a second Ctrl-C
  interrupts at once)."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous: dict[int, Any] = {}

  def start(self) -> None:
    # Handlers can only be installed from the main thread (not, e.g., under a test runner
    # thread); elsewhere the watcher still answers JAX's multi-host preemption sync point.
    if not _multi_host() and threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)

  def stop(self) -> None:
    """Puts the previous handlers back."""
    self._restore_handlers()

  def __enter__(self) -> "PreemptionWatcher":
    self.start()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.stop()

  def _restore_handlers(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    self._restore_handlers()

  def should_stop(self, step: int) -> bool:
    """True once a signal arrived, or (multi-host) at JAX's preemption sync point. Call it
    at every step on every host: the sync point protocol requires it."""
    if self.signal_name is not None:
      return True
    try:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = "preemption notice"
        return True
    except RuntimeError:   # The preemption service is disabled (jax_enable_preemption_service).
      pass
    return False
