"""How a save of a checkpoint or snapshot fails, and the one place where the rest of a failed
save is ended before the command that made it reports the failure and exits.

Orbax writes a save in threads of its own: one per item and per batch of arrays, each running
a coroutine. It waits for them one by one and stops at the first that fails, so the others may
still be running when the failure reaches the caller. A thread still running when the
interpreter shuts down asks a thread pool for work that it then refuses ("cannot schedule new
futures after interpreter shutdown"), and Orbax logs that with a traceback, after the
command's error line. `Saves.failing` stops them first: whatever fails in a save, the save's
threads still running are cancelled (each with its own cancel()) and waited for, then the
error is raised; a write the file system refuses (disk full, read-only, no permission) as one
CheckpointWriteError naming the directory and the reason. A save that did not fail ends
through Orbax's API, wait_until_finished and close (TrainCheckpoints.close). After a failure
that API cannot end the rest: AsyncCheckpointer.cancel() forgets a save once its error was
raised, and close() waits only for the thread that reported it.

Orbax also logs the failure from each of its threads, with tracebacks, and asyncio every
future whose error nobody read: records that repeat a write failure are dropped, as the one
error raised says it (`quiet_save_failures`; all of it is shown with --verbose).
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

from absl import logging

from transformer_jax.errors import UserError, tracebacks_wanted

STOP_TIMEOUT_SECS = 30   # after a failed save, how long to wait for its threads to end


class CheckpointWriteError(UserError):
  """A checkpoint or snapshot directory cannot be written."""


# TensorStore (under Orbax) reports a failed write as ValueError("RESOURCE_EXHAUSTED: ...
# No space left on device [os_error_code='28']"), not as an OSError.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?")


def write_failure_reason(error: BaseException | None) -> str | None:
  """Why a write failed, in a few lowercase words ("no space left on device"), if `error` or
  an error that caused it is a file-system failure (an OSError, or Orbax/TensorStore's
  message carrying the OS error code); None for anything else."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, OSError):
      return (error.strerror or str(error)).lower()
    code = _OS_ERROR_CODE.search(str(error))
    if code:
      return os.strerror(int(code.group(1))).lower()
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


class _WithoutSaveFailureTracebacks(std_logging.Filter):
  """Only records that repeat a write failure are dropped: Orbax's own save-thread messages,
  or a record whose error or text is one that `write_failure_reason` recognises."""
  _ORBAX_THREADS = ("background save thread", "Finalize thread")

  def filter(self, record: std_logging.LogRecord) -> bool:
    if tracebacks_wanted() or record.levelno < std_logging.ERROR:
      return True
    message = record.getMessage()
    error = record.exc_info[1] if record.exc_info else None
    repeats_failure = (any(m in message for m in self._ORBAX_THREADS)
                       or write_failure_reason(error) is not None
                       or _OS_ERROR_CODE.search(message) is not None)
    return not repeats_failure


_SAVE_FAILURE_FILTER = _WithoutSaveFailureTracebacks()


def _quiet_closed_event_loops() -> None:
  """After a failed save, TensorStore's callbacks into Orbax's closed event loops end in
  RuntimeError("Event loop is closed"), which Python reports through sys.unraisablehook as
  soon as the write fails: silenced, as they only repeat the failure that is raised."""
  if getattr(sys.unraisablehook, "quiets_closed_loops", False):
    return
  previous = sys.unraisablehook

  def unraisablehook(unraisable: Any) -> None:
    closed_loop = (isinstance(unraisable.exc_value, RuntimeError)
                   and str(unraisable.exc_value) == "Event loop is closed")
    if tracebacks_wanted() or not closed_loop:
      previous(unraisable)
  unraisablehook.quiets_closed_loops = True  # type: ignore[attr-defined]
  sys.unraisablehook = unraisablehook


def quiet_save_failures() -> None:
  """Drops the log records and unraisable errors that only repeat a failed save (once)."""
  for logger in ("absl", "asyncio"):
    std_logging.getLogger(logger).addFilter(_SAVE_FAILURE_FILTER)  # Added once.
  _quiet_closed_event_loops()


def _is_orbax_thread(thread: threading.Thread) -> bool:
  return type(thread).__module__.split(".")[0] == "orbax"


class Saves:
  """The saves made from now on, of checkpoints or snapshots `what` ("checkpoint to DIR"):
  `failing` goes around every call that starts a save or waits for one. `failed` tells
  whether one did; `stuck`, whether its threads outlasted `stop`."""

  def __init__(self, what: str, intact: str):
    quiet_save_failures()
    self.what, self.intact = what, intact
    self.failed = self.stuck = False
    self._before = frozenset(threading.enumerate())   # threads not of these saves

  @contextlib.contextmanager
  def failing(self) -> Iterator[None]:
    """On an error, first ends what is left of the failed save (`stop`), then raises it: a
    write the file system refused as CheckpointWriteError, anything else as it is."""
    try:
      yield
    except Exception as e:
      self.failed = True
      self.stop()
      reason = write_failure_reason(e)
      if reason is None:
        raise
      raise CheckpointWriteError(f"cannot write {self.what}: {reason} ({self.intact})") from e

  def stop(self, timeout: float = STOP_TIMEOUT_SECS) -> None:
    """Cancels Orbax's threads that these saves started, once each runs its coroutine (it
    then stops at its next wait; cancelled before, it would skip the coroutine and leave it
    never awaited), and waits for them to end; a warning if some did not in `timeout`
    seconds (a thread blocked outside Orbax's waits cannot be cancelled)."""
    deadline = time.monotonic() + timeout
    while True:
      running = [t for t in threading.enumerate() if t not in self._before
                 and t is not threading.current_thread() and _is_orbax_thread(t)]
      if not running or time.monotonic() >= deadline:
        break
      for thread in running:   # Orbax sets main_task on the thread while its coroutine runs.
        cancel = getattr(thread, "cancel", None)
        if cancel is not None and getattr(thread, "main_task", None) is not None:
          try:
            cancel()   # again each round: one whose coroutine started since is cancelled too
          except (RuntimeError, AttributeError):   # It ended meanwhile (its loop closed).
            pass
      # Thread's own join (Orbax's raises the thread's error again).
      threading.Thread.join(running[0], min(0.05, max(0.0, deadline - time.monotonic())))
    self.stuck = bool(running)
    if self.stuck:
      logging.warning("gave up waiting for the threads of the failed save to stop")
