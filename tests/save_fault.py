"""`python tests/save_fault.py PLACE train.py [flags]` (or `-m transformer_jax.export [flags]`):
the command with a fault in the save whose directory's path contains PLACE (for example
"/checkpoints/4." or "/exports/"), so that a test meets a failed save without racing it.

The disk is full for the save's `config` item: its write fails with ENOSPC. The save's array
writes are still in flight then: the first of each item completes only when it is cancelled,
or once the interpreter has begun to shut down (as a slow write would when the process did
not wait for it). So a command that exits without first ending Orbax's work on that save
always meets it, instead of once in a while under load.

SAVE_FAULT_SIGTERM=1: the in-flight write sends the process SIGTERM (a preemption notice that
arrives during the save). SAVE_FAULT_NAN_AT=S: the training loss is NaN from step S on (a
non-finite stop while the save is in flight).
"""

import builtins
import concurrent.futures.thread
import errno
import os
import runpy
import signal
import sys
import threading

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))

import transformer_jax  # noqa: E402,F401  (before jax, as every entry point)

PLACE = sys.argv[1]

from orbax.checkpoint import type_handlers  # noqa: E402

_open = builtins.open


def refusing_open(file, mode="r", *args, **kwargs):
  """The disk is full for the config item of the save at PLACE."""
  path = str(file)
  if PLACE in path and "/config" in path.split(PLACE, 1)[1] and set(mode) & set("wax+"):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  return _open(file, mode, *args, **kwargs)


_signalled = threading.Event()


class InFlight:
  """A write that completes when cancelled, or once the interpreter is shutting down (and
  its thread pools take no more work: concurrent.futures' own flag)."""

  def __init__(self):
    self.cancelled = threading.Event()

  def result(self, timeout=None):
    if os.environ.get("SAVE_FAULT_SIGTERM") == "1" and not _signalled.is_set():
      _signalled.set()   # once: a second SIGTERM would kill the process
      os.kill(os.getpid(), signal.SIGTERM)
    while not self.cancelled.wait(0.01) and not concurrent.futures.thread._shutdown:
      pass

  def cancel(self):
    self.cancelled.set()


def slowed(serialize):
  async def serialize_in_flight(self, values, infos, args=None):
    futures = await serialize(self, values, infos, args)
    return [InFlight(), *futures] if PLACE in str(infos[0].parent_dir) else futures
  return serialize_in_flight


builtins.open = refusing_open
for handler in (type_handlers.ArrayHandler, type_handlers.NumpyHandler):
  handler.serialize = slowed(handler.serialize)

if os.environ.get("SAVE_FAULT_NAN_AT"):
  from transformer_jax.training import loop
  nan_at, check_finite = int(os.environ["SAVE_FAULT_NAN_AT"]), loop._check_finite

  def nan_from_step(host_metrics, policy):
    for step, metrics in host_metrics:
      if step >= nan_at:
        metrics["loss"], metrics["nonfinite"] = float("nan"), 1
    return check_finite(host_metrics, policy)
  loop._check_finite = nan_from_step

if sys.argv[2] == "-m":
  sys.argv = [sys.argv[3], *sys.argv[4:]]
  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
  sys.argv = sys.argv[2:]
  runpy.run_path(sys.argv[0], run_name="__main__")
