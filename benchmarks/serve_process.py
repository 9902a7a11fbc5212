"""The HTTP server (transformer_jax/serve.py) as a subprocess on 127.0.0.1, for the load
test (benchmarks/serve_load.py) and the tests: started on a free port, waited for until
its /healthz answers, its output read as it comes, and ServerFailed with its last output
lines as soon as it exits or when it is not ready in time.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, MutableMapping, Sequence
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_TAIL = 20      # lines of the server's output shown when it fails
POLL_S = 0.2          # how often the wait for the server looks whether it has exited
PROBE_S = 2.0         # timeout of one GET /healthz while waiting
# Any of these set: the user chose how the processes share a GPU.
GPU_SHARING = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
               "XLA_PYTHON_CLIENT_ALLOCATOR")


def share_gpu(env: MutableMapping[str, str]) -> None:
  """This process and the server both run JAX, on the same GPU where there is one, and
  each would take 75% of its memory at start: the second then fails or crawls. Unless the
  user chose otherwise, each takes memory as it needs it. Must run before JAX starts."""
  if not any(name in env for name in GPU_SHARING):
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerOutput:
  """The server's stdout and stderr, read as they come (a pipe nobody reads fills up, with
  XLA's log lines on a GPU, and blocks the server mid-write); keeps the last lines."""

  def __init__(self, stream: IO[str], keep: int = 200):
    self._lines: collections.deque[str] = collections.deque(maxlen=keep)
    self._lock = threading.Lock()
    self.closed_at: float | None = None    # time.monotonic() when the stream ended
    self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
    self._thread.start()

  def _read(self, stream: IO[str]) -> None:
    for line in stream:
      with self._lock:
        self._lines.append(line.rstrip("\n"))
    self.closed_at = time.monotonic()

  def lines(self) -> list[str]:
    with self._lock:
      return list(self._lines)

  def wait_closed(self, timeout: float) -> bool:
    self._thread.join(timeout)
    return not self._thread.is_alive()


class ServerFailed(RuntimeError):
  """The server exited, or was not ready in time. `status`: its exit status (None: it was
  still running and has been killed); `tail`: its last output lines; `ended_at`: the
  time.monotonic() its output ended (it exited)."""

  def __init__(self, message: str, status: int | None, tail: list[str],
               ended_at: float | None = None):
    super().__init__("\n".join([message, *(f"  server| {line}" for line in tail)]))
    self.status, self.tail, self.ended_at = status, tail, ended_at


@dataclasses.dataclass
class RunningServer:
  process: subprocess.Popen
  url: str
  output: ServerOutput
  health: dict[str, Any]     # its GET /healthz answer

  def check(self, when: str) -> None:
    """ServerFailed if the server has exited (`when`: what was going on)."""
    status = self.process.poll()
    if status is None:
      return
    self.output.wait_closed(5)
    tail = self.output.lines()[-SERVER_TAIL:]
    said = [line.removeprefix("error: ") for line in tail if line.startswith("error: ")]
    how = (f"was killed by {signal.Signals(-status).name}" if status < 0
           else f"exited with status {status}")
    raise ServerFailed(f"the server {how} {when}"
                       + (f": {said[-1]}" if said else ""), status, tail,
                       self.output.closed_at)

  def stop(self, timeout: float = 60.0) -> int:
    """SIGTERM (the server finishes what is in flight), then SIGKILL after `timeout`."""
    if self.process.poll() is None:
      self.process.terminate()
    try:
      self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait(timeout)
    self.output.wait_closed(timeout)
    return self.process.returncode


def _health(url: str, timeout: float) -> dict[str, Any] | None:
  """The server's /healthz answer, or None while it does not answer 200."""
  parsed = urlparse(url)
  connection = http.client.HTTPConnection(str(parsed.hostname), parsed.port, timeout=timeout)
  try:
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    return json.loads(response.read()) if response.status == 200 else None
  except (OSError, http.client.HTTPException, ValueError):
    return None
  finally:
    connection.close()


def start_server(model: str, max_batch: int, max_wait_ms: float, ready_timeout: float = 120.0,
                 extra_args: Sequence[str] = ()) -> RunningServer:
  """serve.py on a free port of 127.0.0.1 (with `extra_args`), once its /healthz answers.
  ServerFailed, with its last output lines, as soon as it exits (within POLL_S, or one
  PROBE_S probe) or after `ready_timeout` seconds without an answer (then it is killed)."""
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
  share_gpu(env)
  process = subprocess.Popen(
      [sys.executable, "-m", "transformer_jax.serve", f"--model={model}", "--host=127.0.0.1",
       f"--port={port}", f"--max_batch={max_batch}", f"--max_wait_ms={max_wait_ms}",
       *extra_args],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      errors="replace")
  assert process.stdout is not None
  server = RunningServer(process, f"http://127.0.0.1:{port}", ServerOutput(process.stdout), {})
  deadline = time.monotonic() + ready_timeout
  while True:
    server.check("before it answered GET /healthz")
    health = _health(server.url, min(PROBE_S, max(deadline - time.monotonic(), 0.1)))
    if health is not None:
      server.health = health
      return server
    if time.monotonic() > deadline:
      process.kill()
      process.wait()
      server.output.wait_closed(5)
      raise ServerFailed(f"the server did not answer GET /healthz within {ready_timeout:g} s "
                         "(--ready_timeout_s); killed it", None,
                         server.output.lines()[-SERVER_TAIL:])
    time.sleep(POLL_S)
