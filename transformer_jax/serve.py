"""An HTTP server for a served model (an artifact of `export --format=stablehlo`):

  python -m transformer_jax.serve --model=DIR [--host=127.0.0.1] [--port=8080]
      [--max_batch=32] [--max_wait_ms=5] [--max_inputs=64]

  POST /v1/predict  {"inputs": ["line", ...]}  ->  200 {"outputs": ["output", ...]}
  GET  /healthz                                 ->  200 {"status": "ok", "task", "fingerprint"}

Bad input (no or invalid JSON, no "inputs" list, a non-string, too many inputs, a line over
the model's max_len tokens, an oversized body) is answered 400 with {"error": "..."}.

Built on the standard library's ThreadingHTTPServer: one thread per connection parses and
checks the request, and one batching thread runs the model. It gathers the lines of
concurrent requests until `max_batch` lines or `max_wait_ms` after the first, runs them as
one call, and hands each request its outputs. The model call is the bottleneck and it runs
on one thread anyway, so an async framework would add a dependency without adding
throughput; the tests drive this server with concurrent clients. Like the loader, it needs
only jax, numpy and sentencepiece.
"""

from __future__ import annotations

import argparse
import http.server
import json
import queue
import sys
import threading
import time
from typing import Any

from transformer_jax.inputs import InputError
from transformer_jax.serving import ArtifactError, EncodedLine, Served


class _Pending:
  """One request's encoded lines, waiting for the batcher."""

  def __init__(self, encoded: list[EncodedLine]):
    self.encoded = encoded
    self.outputs: list[str] | None = None
    self.error: str | None = None
    self.done = threading.Event()


class Batcher:
  """Runs `served` on the lines of concurrent requests together (see the module doc)."""

  def __init__(self, served: Served, max_batch: int, max_wait_s: float):
    self.served, self.max_batch, self.max_wait_s = served, max_batch, max_wait_s
    self._queue: queue.Queue[_Pending] = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
    self._thread.start()

  def predict(self, encoded: list[EncodedLine]) -> list[str]:
    """Blocks until the outputs of `encoded` (lines through Served.encode) are ready."""
    pending = _Pending(encoded)
    self._queue.put(pending)
    pending.done.wait()
    if pending.error is not None:
      raise RuntimeError(pending.error)
    return pending.outputs

  def _loop(self) -> None:
    while True:
      batch = [self._queue.get()]
      size = len(batch[0].encoded)
      deadline = time.monotonic() + self.max_wait_s
      while size < self.max_batch:
        try:
          item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
          break
        batch.append(item)
        size += len(item.encoded)
      self._run(batch)

  def _run(self, batch: list[_Pending]) -> None:
    try:
      outputs = self.served.predict_ids([ids for p in batch for ids in p.encoded])
    except Exception as e:  # noqa: BLE001  (a model failure is answered, not fatal)
      for p in batch:
        p.error = f"{type(e).__name__}: {e}"
        p.done.set()
      return
    start = 0
    for p in batch:
      p.outputs = outputs[start:start + len(p.encoded)]
      start += len(p.encoded)
      p.done.set()


class BadRequest(Exception):
  """Answered 400 (or `status`) with the message as the JSON error."""

  def __init__(self, message: str, status: int = 400):
    super().__init__(message)
    self.status = status


def parse_inputs(body: bytes, max_inputs: int) -> list[Any]:
  """The "inputs" list of a request body, or BadRequest saying what is wrong."""
  if not body:
    raise BadRequest('empty body; send {"inputs": ["line", ...]}')
  try:
    request = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"body is not JSON: {e}") from None
  if not isinstance(request, dict) or "inputs" not in request:
    raise BadRequest('expected a JSON object {"inputs": ["line", ...]}')
  inputs = request["inputs"]
  if not isinstance(inputs, list):
    raise BadRequest(f'"inputs" must be a list of strings, got {type(inputs).__name__}')
  if len(inputs) > max_inputs:
    raise BadRequest(f'{len(inputs)} inputs; at most {max_inputs} per request')
  return inputs


def make_handler(served: Served, batcher: Batcher, max_inputs: int,
                 max_body_bytes: int) -> type[http.server.BaseHTTPRequestHandler]:
  """The request handler class for one loaded model."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"       # keep-alive: clients reuse connections

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
      body = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
      if self.path == "/healthz":
        self._answer(200, {"status": "ok", "task": served.manifest["task"],
                           "fingerprint": served.fingerprint})
      else:
        self._answer(404, {"error": f"no such path {self.path}; use POST /v1/predict or "
                                    "GET /healthz"})

    def do_POST(self) -> None:  # noqa: N802
      if self.path != "/v1/predict":
        self._answer(404, {"error": f"no such path {self.path}; use POST /v1/predict"})
        return
      try:
        length = int(self.headers.get("Content-Length") or 0)
      except ValueError:
        length = -1
      try:
        if length < 0 or length > max_body_bytes:
          self.close_connection = True    # the unread body is not drained
          raise BadRequest(f"Content-Length {self.headers.get('Content-Length')!r}: give the "
                           f"body's size, at most {max_body_bytes} bytes",
                           413 if length > 0 else 400)
        inputs = parse_inputs(self.rfile.read(length) if length > 0 else b"", max_inputs)
        encoded = served.encode(inputs)
      except BadRequest as e:
        self._answer(e.status, {"error": str(e)})
        return
      except InputError as e:
        self._answer(400, {"error": str(e)})
        return
      try:
        outputs = batcher.predict(encoded) if encoded else []
      except RuntimeError as e:
        self._answer(500, {"error": f"the model failed: {e}"})
        return
      self._answer(200, {"outputs": outputs})

    def log_message(self, format: str, *args: Any) -> None:
      pass   # No line per request on stderr; errors are in the answers.

  return Handler


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m transformer_jax.serve",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True, help="artifact directory (export "
                      "--format=stablehlo)")
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
  parser.add_argument("--port", type=int, default=8080)
  parser.add_argument("--max_batch", type=int, default=32, help="lines per model call")
  parser.add_argument("--max_wait_ms", type=float, default=5.0, help="how long the first "
                      "request of a batch waits for others")
  parser.add_argument("--max_inputs", type=int, default=64, help="lines per request")
  parser.add_argument("--max_body_bytes", type=int, default=1 << 20)
  args = parser.parse_args(argv)
  for name in ("max_batch", "max_inputs", "max_body_bytes"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1")          # exit status 2
  if args.max_wait_ms < 0:
    parser.error("--max_wait_ms must be >= 0")
  try:
    served = Served.load(args.model, max_rows=args.max_batch)
  except (ArtifactError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  batcher = Batcher(served, args.max_batch, args.max_wait_ms / 1000)
  try:
    server = http.server.ThreadingHTTPServer(
        (args.host, args.port),
        make_handler(served, batcher, args.max_inputs, args.max_body_bytes))
  except OSError as e:
    print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
    sys.exit(2)
  server.daemon_threads = True
  print(f"serving {served.manifest['task']} model {args.model} on "
        f"http://{args.host}:{args.port} (POST /v1/predict, GET /healthz)", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == "__main__":
  main()
