"""An HTTP server for a served model (an artifact of `export --format=stablehlo`):

  python -m transformer_jax.serve --model=DIR [--host=127.0.0.1] [--port=8080]
      [--max_batch=32] [--max_wait_ms=5] [--slots=32] [--warm_up_tokens=0] [--max_inputs=64]
      [--max_body_bytes=1048576] [--listen_backlog=128] [--model_name=NAME]
      [--model_version=V] [--shutdown_timeout_s=30] [--request_log=FILE]
      [--too_long=refuse|truncate]

  POST /v1/predict      {"inputs": ["line", ...]}  ->  200 {"outputs": ["output", ...]}
  POST /v1/completions  a language model's OpenAI completions (streamed with "stream": true)
  GET  /v1/models       the served model, as OpenAI lists models
  GET  /healthz         ->  200 {"status": "ok", "name", "version", "task", "fingerprint",
                                  "device", "device_kind"}
  GET  /metrics         ->  Prometheus text format

The batcher runs the lines of concurrent requests together, one length bucket per model
call (transformer_jax/serving/batching.py); a language model's completions are decoded by
the continuous batcher (serving/streaming.py) in a batch of --slots rows that requests join
and leave at every step; the handler (serving/server.py) answers bad requests 4xx with a
JSON error. Each line is cleaned and fitted to the model as predict does
it (serving/line_policy.py: the artifact's manifest says what the training did with lines
longer than max_len; --too_long=refuse refuses them instead). SIGTERM (or Ctrl-C) stops
accepting connections, lets the requests in flight finish (up to --shutdown_timeout_s) and
exits with status 0.

A GPU that cannot be used (its memory taken by another JAX process, most often) ends the
command at start with one line naming XLA_PYTHON_CLIENT_PREALLOCATE and
XLA_PYTHON_CLIENT_MEM_FRACTION (serving/device.py), not a quiet fall back to the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from absl import app, flags

from transformer_jax import errors
from transformer_jax.errors import UserError
from transformer_jax.serving import ArtifactError, Served, device
from transformer_jax.serving.batching import Batcher
from transformer_jax.serving.line_policy import TOO_LONG_CHOICES
from transformer_jax.serving.server import InFlight, Limits, Server, make_handler
from transformer_jax.serving.slots import DecodingBatch
from transformer_jax.serving.streaming import StreamBatcher

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The command-line flags, defined only when this module is the program."""
  define: dict[str, Any] = {"flag_values": flag_values}
  flags.DEFINE_string("model", None, "Artifact directory (export --format=stablehlo).",
                      required=True, **define)
  flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.", **define)
  flags.DEFINE_integer("port", 8080, "Port to listen on.", **define)
  flags.DEFINE_integer("max_batch", 32, "Lines per model call.", lower_bound=1, **define)
  flags.DEFINE_float("max_wait_ms", 5.0, "How long the first line after an idle spell "
                     "waits for others.", lower_bound=0.0, **define)
  flags.DEFINE_integer("slots", 32, "A language model's completions decoded at once (the "
                       "most rows of its decoding batch; its KV cache holds the rows in use); "
                       "more wait for a free slot.", lower_bound=1, **define)
  flags.DEFINE_integer("warm_up_tokens", 0, "Before listening, compile a language model's "
                       "streaming programs for every batch shape of texts up to this many "
                       "tokens (prompt and completion), so that no request waits for a "
                       "compilation; 0: each shape compiles on first use.", lower_bound=0,
                       **define)
  flags.DEFINE_integer("max_inputs", 64, "Lines per request (completions: prompts x n); "
                       "more are answered 413.", lower_bound=1, **define)
  flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body; larger ones are "
                       "answered 413.", lower_bound=1, **define)
  flags.DEFINE_integer("listen_backlog", 128, "Connections the kernel queues before "
                       "accept.", lower_bound=1, **define)
  flags.DEFINE_string("model_name", None, "Name in /healthz; default: the --model "
                      "directory's name.", **define)
  flags.DEFINE_string("model_version", None, "Version in /healthz; default: the first 12 "
                      "hex digits of the artifact's fingerprint.", **define)
  flags.DEFINE_float("shutdown_timeout_s", 30.0, "On SIGTERM, how long requests in flight "
                     "may take to finish.", lower_bound=0.0, **define)
  flags.DEFINE_enum("too_long", None, list(TOO_LONG_CHOICES), "A line longer than the "
                    "model's max_len: 'truncate' does what training did (the artifact's "
                    "manifest: a classifier truncates, a tagger tags windows, translation "
                    "refuses), 'refuse' answers 400 naming it. Default: truncate (translation: "
                    "refuse).", **define)
  flags.DEFINE_string("request_log", None, "Append one JSON line per answered prediction "
                      "(latency, queue wait, model calls, output lengths).", **define)


def _request_logger(path: str | None) -> Any:
  if path is None:
    return None, None
  try:
    stream = open(path, "a")
  except OSError as e:
    raise UserError(f"--request_log={path}: {e}") from e
  lock = threading.Lock()

  def log(record: dict) -> None:
    with lock:
      stream.write(json.dumps(record) + "\n")
      stream.flush()
  return log, stream


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  runs_on = device.start()         # before loading: a GPU that did not start is the cause
  try:
    served = Served.load(FLAGS.model, max_rows=FLAGS.max_batch)
    decoding = (None if served.streaming is None     # the cache: allocated now, or the error
                else DecodingBatch(served.streaming, FLAGS.slots))
  except (ArtifactError, FileNotFoundError) as e:
    raise UserError(f"--model={FLAGS.model}: {e}") from e
  except RuntimeError as e:        # the parameters did not fit on the device
    problem = device.memory_error(e, f"loading --model={FLAGS.model}")
    if problem is None:
      raise
    raise problem from e
  served.policy = served.policy.choose(FLAGS.too_long, served.manifest["task"])
  identity = {"name": FLAGS.model_name or os.path.basename(os.path.abspath(FLAGS.model)),
              "version": FLAGS.model_version or served.fingerprint[:12], **runs_on}
  log, log_stream = _request_logger(FLAGS.request_log)
  batcher = Batcher(served, FLAGS.max_batch, FLAGS.max_wait_ms / 1000)
  streams = None if decoding is None else StreamBatcher(
      decoding, served.tokenizer.decode, served.end_ids, batcher.metrics)
  if streams is not None and FLAGS.warm_up_tokens:
    started = time.monotonic()
    shapes = streams.warm_up(FLAGS.warm_up_tokens)
    print(f"compiled {shapes} batch shapes of completions in {time.monotonic() - started:.1f} s",
          flush=True)
  in_flight = InFlight()
  handler = make_handler(served, batcher, Limits(FLAGS.max_inputs, FLAGS.max_body_bytes),
                         identity, in_flight, log, streams)
  try:
    server = Server((FLAGS.host, FLAGS.port), handler, FLAGS.listen_backlog)
  except OSError as e:
    raise UserError(f"cannot listen on {FLAGS.host}:{FLAGS.port}: {e}; choose another "
                    "--port or --host") from e

  def stop(signum: int, frame: Any) -> None:
    # serve_forever runs in this (the main) thread: shutdown() must come from another.
    in_flight.draining = True
    threading.Thread(target=server.shutdown, daemon=True).start()
  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  print(f"serving {served.manifest['task']} model {identity['name']} version "
        f"{identity['version']} on {runs_on['device']} ({runs_on['device_kind']}) at "
        f"http://{FLAGS.host}:{FLAGS.port} (POST /v1/predict"
        f"{'' if streams is None else ', POST /v1/completions, GET /v1/models'}, GET /healthz, "
        "GET /metrics)", flush=True)
  try:
    server.serve_forever()
  finally:
    server.server_close()            # no new connections from here on
    finished = in_flight.wait(FLAGS.shutdown_timeout_s)
    if log_stream is not None:
      log_stream.close()
  print("stopped" + ("" if finished else f": requests still in flight after "
                     f"{FLAGS.shutdown_timeout_s} s were cut off"), flush=True)


if __name__ == "__main__":
  define_flags()
  errors.run(main)
