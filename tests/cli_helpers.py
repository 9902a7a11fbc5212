"""Running the repository's command lines as subprocesses in tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
  """`python *args` from the repository root, importing this checkout's code; stdout and
  stderr go to one pipe."""
  env = {**os.environ, **(env or {}),
         "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen) -> tuple[int, str]:
  """(exit status, output)."""
  try:
    out, _ = process.communicate(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    process.kill()
    out, _ = process.communicate()
    pytest.fail(f"{process.args} timed out:\n{out}")
  return process.returncode, out
