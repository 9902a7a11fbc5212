"""The HTTP handler of the server (the command is transformer_jax/serve.py):

  POST /v1/predict  {"inputs": ["line", ...]}  ->  200 {"outputs": ["output", ...]}
  GET  /healthz                                 ->  200 {"status": "ok", "task", "fingerprint"}

Bad input (no or invalid JSON, no "inputs" list, a non-string, too many inputs, a line over
the model's max_len tokens, an oversized body) is answered 400 with {"error": "..."}.

Built on the standard library's ThreadingHTTPServer: one thread per connection parses and
checks the request, and the batcher's one thread runs the model. The model call is the
bottleneck and it runs on one thread anyway, so an async framework would add a dependency
without adding throughput; the tests drive this server with concurrent clients.
"""

from __future__ import annotations

import http.server
import json
from typing import Any

from transformer_jax.inputs import InputError
from transformer_jax.serving.batching import Batcher
from transformer_jax.serving.lines import Served


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
