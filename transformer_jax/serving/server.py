"""The HTTP server of a served model (the command is transformer_jax/serve.py):

  POST /v1/predict      {"inputs": ["line", ...]}  ->  200 {"outputs": ["output", ...]}
  POST /v1/completions  a language model's OpenAI completions, streamed as server-sent
                        events with "stream": true (openai_api.py, streaming.py)
  POST /v1/chat/completions  its chat completions, where its tokenizer has a chat template
                        (chat_api.py); a 400 naming the missing template where not
  GET  /v1/models       the served model, as OpenAI lists models
  GET  /, /index.html   the playground: a page that streams completions (or chats) in a
                        browser (playground.html, read once at start)
  GET  /healthz         ->  200 {"status": "ok", "name", "version", "task", "fingerprint",
                                  "device", "device_kind"}
  GET  /metrics         ->  200 Prometheus text format (serving/metrics.py)

Every error is answered with a JSON body, {"error": "..."} (OpenAI's shape, {"error":
{"message", "type", "param", "code"}}, under /v1/ but for /v1/predict): 400 for bad input
(no or invalid JSON, no "inputs" list, a non-string, a line over the model's max_len tokens
that the line policy refuses: translation, or --too_long=refuse; serving/line_policy.py; a
completion field out of range, naming it), 413 for a body over --max_body_bytes or more
than --max_inputs lines (prompts x n), 404 for an unknown path or model, 405 for a method a
path does not take, 503 while shutting down, 500 when the model call fails (out of GPU
memory: naming the variables that share a GPU, serving/device.py). A refused body is still
read (up to DRAIN_LIMIT bytes), so that a client that sends it before reading the answer
gets the 413 rather than a broken pipe.

Built on the standard library's ThreadingHTTPServer: one thread per connection parses and
checks the request, and the batcher's one thread runs the model. The model call is the
bottleneck and it runs on one thread anyway, so an async framework would add a dependency
without adding throughput; the tests drive this server with concurrent clients.
"""

from __future__ import annotations

import dataclasses
import http.server
import importlib.resources
import json
import sys
import threading
import time
import urllib.parse
from typing import Any, Callable

from transformer_jax.inputs import InputError
from transformer_jax.serving import chat_api, device, openai_api
from transformer_jax.serving.batching import Batcher
from transformer_jax.serving.lines import Served
from transformer_jax.serving.openai_api import OpenAIError
from transformer_jax.serving.streaming import StreamBatcher

DRAIN_LIMIT = 64 << 20      # a refused body larger than this is not read; the socket closes
PREDICT, HEALTH, METRICS = "/v1/predict", "/healthz", "/metrics"
COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
_METHODS = {PREDICT: "POST", HEALTH: "GET", METRICS: "GET", COMPLETIONS: "POST", CHAT: "POST",
            MODELS: "GET"}
PLAYGROUND_PATHS = ("/", "/index.html")
_METHODS.update(dict.fromkeys(PLAYGROUND_PATHS, "GET"))    # POST / is a 405, not a 404
# The playground page, read once: package data beside this module (pyproject.toml).
PLAYGROUND = (importlib.resources.files("transformer_jax.serving") / "playground.html"
              ).read_bytes()


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
    raise BadRequest(f'{len(inputs)} inputs; at most {max_inputs} per request', 413)
  return inputs


@dataclasses.dataclass
class Limits:
  max_inputs: int = 64             # lines per request
  max_body_bytes: int = 1 << 20    # bytes per request body


class InFlight:
  """Requests being handled now, so that a shutdown can wait for them."""

  def __init__(self) -> None:
    self._count, self._cond = 0, threading.Condition()
    self.draining = False     # set on shutdown: new requests are answered 503

  def __enter__(self) -> "InFlight":
    with self._cond:
      self._count += 1
    return self

  def __exit__(self, *exc: object) -> None:
    with self._cond:
      self._count -= 1
      self._cond.notify_all()

  def wait(self, timeout: float) -> bool:
    """Until none are in flight (True) or `timeout` seconds (False)."""
    with self._cond:
      return self._cond.wait_for(lambda: self._count == 0, timeout)


def make_handler(served: Served, batcher: Batcher, limits: Limits, identity: dict[str, str],
                 in_flight: InFlight, log_request: Callable[[dict], None] | None = None,
                 streams: StreamBatcher | None = None,
                 ) -> type[http.server.BaseHTTPRequestHandler]:
  """The request handler class for one loaded model; `identity`: what /healthz says of it
  besides its task and fingerprint (name, version, and device and device_kind: where it
  runs). `streams`: a language model's continuous batcher, for /v1/completions."""
  metrics = batcher.metrics
  completions = openai_api.Completions(served, streams, identity["name"], identity["version"],
                                       limits.max_inputs)
  chats = chat_api.Chats(served, streams, identity["name"], identity["version"],
                         limits.max_inputs)

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"       # keep-alive: clients reuse connections
    disable_nagle_algorithm = True      # a streamed token goes out at once

    def _answer(self, status: int, payload: dict[str, Any] | None = None, *,
                body: bytes | None = None, content_type: str = "application/json",
                headers: dict[str, str] | None = None, started: float | None = None) -> None:
      body = json.dumps(payload).encode() if body is None else body
      try:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
          self.send_header(key, value)
        if self.close_connection:
          self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
      except OSError:        # the client went away before its answer: nothing to tell it
        self.close_connection = True
      metrics.answered(status, None if started is None else time.monotonic() - started)

    def _error(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None,
               started: float | None = None) -> None:
      """An error in the path's shape: OpenAI's under /v1/ (but /v1/predict), else
      {"error": message}."""
      path = getattr(self, "path", "").split("?")[0]    # none: the request line was bad
      openai = path.startswith("/v1/") and path != PREDICT
      payload = (openai_api.error_body(status, message, param, code) if openai
                 else {"error": message})
      self._answer(status, payload, headers=headers, started=started)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
      """The standard library's errors (a malformed request line, an unknown method) as
      JSON; a method no path takes is 405, not 501."""
      self.close_connection = True
      if code == 501 and self.command:
        self._method_not_allowed()
        return
      self._error(code, message or explain or self.responses[code][0])

    def _method_not_allowed(self) -> None:
      path = self.path.split("?")[0]
      allowed = _METHODS.get(path, "GET, POST")
      self._error(405, f"{self.command} is not allowed on {path}; use {allowed}",
                  headers={"Allow": allowed})

    def _refuse_while_draining(self) -> bool:
      if in_flight.draining:
        self.close_connection = True
        self._error(503, "the server is shutting down; retry on another replica")
      return in_flight.draining

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
      with in_flight:
        self._get()

    def do_POST(self) -> None:  # noqa: N802
      with in_flight:
        self._post()

    def _get(self) -> None:
      if self._refuse_while_draining():
        return
      if self.path == HEALTH:
        self._answer(200, {"status": "ok", **identity, "task": served.manifest["task"],
                           "fingerprint": served.fingerprint})
      elif self.path == METRICS:
        body, content_type = metrics.text()
        self._answer(200, body=body, content_type=content_type)
      elif self.path == MODELS:
        self._answer(200, completions.models())
      elif self.path.startswith(MODELS + "/"):
        try:
          self._answer(200, completions.model(urllib.parse.unquote(self.path[len(MODELS) + 1:])))
        except OpenAIError as e:
          self._answer(e.status, e.body())
      elif self.path in PLAYGROUND_PATHS:
        self._answer(200, body=PLAYGROUND, content_type="text/html; charset=utf-8")
      elif self.path in (PREDICT, COMPLETIONS, CHAT):
        self._method_not_allowed()
      else:
        self._error(404, f"no such path {self.path}; use GET / (the playground), POST "
                    f"{PREDICT}, POST {COMPLETIONS}, POST {CHAT}, GET {MODELS}, GET "
                    f"{HEALTH} or GET {METRICS}")

    def _post(self) -> None:
      if self._refuse_while_draining():
        return
      if self.path not in (PREDICT, COMPLETIONS, CHAT):
        self._drain(self._length())
        if self.path in _METHODS:
          self._method_not_allowed()
        else:
          self._error(404, f"no such path {self.path}; use POST {PREDICT}, POST "
                      f"{COMPLETIONS} or POST {CHAT}")
        return
      started = time.monotonic()
      if self.path in (COMPLETIONS, CHAT):
        self._complete(started, chats if self.path == CHAT else completions)
        return
      try:
        inputs = parse_inputs(self._body(), limits.max_inputs)
        encoded = served.encode(inputs)
      except (BadRequest, InputError) as e:
        self._error(getattr(e, "status", 400), str(e), started=started)
        return
      try:
        outputs, record = batcher.predict(encoded)
      except RuntimeError as e:
        self._error(500, device.model_failed(e), started=started)
        return
      self._answer(200, {"outputs": outputs}, started=started)
      if log_request is not None:
        log_request({"latency_s": time.monotonic() - started, **dataclasses.asdict(record)})

    # ------------------------------------------------- /v1/completions, /v1/chat/...
    def _complete(self, began: float,
                  endpoint: openai_api.Completions | chat_api.Chats) -> None:
      try:
        queued = endpoint.start(self._body())
      except BadRequest as e:
        self._error(e.status, str(e), started=began)
        return
      except OpenAIError as e:
        self._answer(e.status, e.body(), started=began)
        return
      if not queued.request.stream:
        self._answer(*endpoint.answer(queued), started=began)
        return
      try:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for data in endpoint.events(queued):
          self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))    # one write, one chunk
        self.wfile.write(b"0\r\n\r\n")                             # the body's end
      except OSError:                           # the client went away: its rows stop
        queued.completion.cancelled = True
        self.close_connection = True
      metrics.answered(200, time.monotonic() - began)

    # ---------------------------------------------------------------------- bodies
    def _other_method(self) -> None:
      self._drain(self._length())
      self._method_not_allowed()

    do_PUT = do_DELETE = do_PATCH = _other_method  # noqa: N815

    def _length(self) -> int:
      try:
        return int(self.headers.get("Content-Length") or 0)
      except ValueError:
        return -1

    def _body(self) -> bytes:
      """The request body, or BadRequest (413 when too large, after reading it)."""
      length = self._length()
      if length < 0:
        self.close_connection = True    # where the next request starts is unknown
        raise BadRequest(f"Content-Length {self.headers.get('Content-Length')!r}: give "
                         "the body's size in bytes")
      if length > limits.max_body_bytes:
        self._drain(length)
        raise BadRequest(f"a body of {length} bytes; at most {limits.max_body_bytes} bytes "
                         f"per request (--max_body_bytes)", 413)
      return self.rfile.read(length) if length else b""

    def _drain(self, length: int) -> None:
      """Reads and drops a body this server will not use (see the module doc)."""
      if length < 0 or length > DRAIN_LIMIT:
        self.close_connection = True
        return
      while length > 0:
        chunk = self.rfile.read(min(length, 1 << 16))
        if not chunk:
          break
        length -= len(chunk)
      self.close_connection = True   # a refused client is not kept alive

    def log_message(self, format: str, *args: Any) -> None:
      pass   # No line per request on stderr; errors are in the answers and /metrics.

  return Handler


class Server(http.server.ThreadingHTTPServer):
  """ThreadingHTTPServer with a chosen listen backlog (the standard library's is 5, so a
  burst of connections stalls) and handler threads that do not hold up the exit."""
  daemon_threads = True

  def __init__(self, address: tuple[str, int], handler: type, backlog: int):
    self.request_queue_size = backlog
    super().__init__(address, handler)

  def handle_error(self, request: Any, client_address: Any) -> None:
    """A client that went away (a reset or a broken pipe, while its next request was read)
    is nothing to report; anything else is, with its traceback."""
    if not isinstance(sys.exc_info()[1], ConnectionError):
      super().handle_error(request, client_address)
