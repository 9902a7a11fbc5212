"""One trainer per workdir: W/.lock, held with an OS file lock (`filelock`; flock on POSIX)
for the whole run. The kernel drops the lock when its process dies, even by SIGKILL, so a
stale lock never blocks. W/.lock.holder names the holder (host, PID, start time) for the
message that refuses a second trainer."""

from __future__ import annotations

import datetime
import json
import os
import socket

import filelock

from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json

LOCK_FILE, HOLDER_FILE = ".lock", ".lock.holder"


class WorkdirBusyError(UserError):
  """Another process trains in the workdir."""


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the workdir or raises WorkdirBusyError at once."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._lock = filelock.FileLock(os.path.join(workdir, LOCK_FILE), timeout=0,
                                   thread_local=False)

  def __enter__(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    try:
      self._lock.acquire()
    except filelock.Timeout:
      raise WorkdirBusyError(f"workdir {self.workdir} is in use by another trainer "
                             f"({self._holder()}); wait for it to end, stop it, or use "
                             "another --workdir") from None
    atomic_write_json(os.path.join(self.workdir, HOLDER_FILE), {
        "host": socket.gethostname(), "pid": os.getpid(),
        "since": datetime.datetime.now().isoformat(timespec="seconds")})
    return self

  def __exit__(self, *exc: object) -> None:
    self._lock.release()

  def _holder(self) -> str:
    try:
      with open(os.path.join(self.workdir, HOLDER_FILE)) as f:
        holder = json.load(f)
      return f"host {holder['host']}, PID {holder['pid']}, since {holder['since']}"
    except (OSError, ValueError, KeyError):
      return "holder unknown"
