"""Writing files so that a reader never sees half of one: write a temporary file next to
the target, then rename it into place (atomic on POSIX file systems). A failure leaves the
old file, if any, untouched."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w") -> Iterator[IO]:
  """A file to write that replaces `path` only when the block ends without an error."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                             suffix=".tmp")
  try:
    with os.fdopen(fd, mode) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def atomic_write(path: str, data: str | bytes) -> None:
  with atomic_output(path, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)


def atomic_write_json(path: str, value: Any, **kwargs: Any) -> None:
  atomic_write(path, json.dumps(value, **kwargs))
