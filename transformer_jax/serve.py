"""An HTTP server for a served model (an artifact of `export --format=stablehlo`):

  python -m transformer_jax.serve --model=DIR [--host=127.0.0.1] [--port=8080]
      [--max_batch=32] [--max_wait_ms=5] [--max_inputs=64] [--max_body_bytes=1048576]

  POST /v1/predict  {"inputs": ["line", ...]}  ->  200 {"outputs": ["output", ...]}
  GET  /healthz                                 ->  200 {"status": "ok", "task", "fingerprint"}

The batcher gathers the lines of concurrent requests until `max_batch` lines or
`max_wait_ms` after the first and runs them as one model call (transformer_jax/serving/
batching.py); the handler (serving/server.py) answers bad requests 4xx with a JSON error.
Like the loader, it needs only jax, numpy, sentencepiece and absl.
"""

from __future__ import annotations

import http.server

from absl import app, flags

from transformer_jax import errors
from transformer_jax.errors import UserError
from transformer_jax.serving import ArtifactError, Served
from transformer_jax.serving.batching import Batcher
from transformer_jax.serving.server import make_handler

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The command-line flags, defined only when this module is the program."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("model", None, "Artifact directory (export --format=stablehlo).",
                      required=True, **define)
  flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.", **define)
  flags.DEFINE_integer("port", 8080, "Port to listen on.", **define)
  flags.DEFINE_integer("max_batch", 32, "Lines per model call.", lower_bound=1, **define)
  flags.DEFINE_float("max_wait_ms", 5.0, "How long the first request of a batch waits for "
                     "others.", lower_bound=0.0, **define)
  flags.DEFINE_integer("max_inputs", 64, "Lines per request.", lower_bound=1, **define)
  flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body; larger ones are "
                       "answered 413.", lower_bound=1, **define)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    served = Served.load(FLAGS.model, max_rows=FLAGS.max_batch)
  except (ArtifactError, FileNotFoundError) as e:
    raise UserError(f"--model={FLAGS.model}: {e}") from e
  batcher = Batcher(served, FLAGS.max_batch, FLAGS.max_wait_ms / 1000)
  try:
    server = http.server.ThreadingHTTPServer(
        (FLAGS.host, FLAGS.port),
        make_handler(served, batcher, FLAGS.max_inputs, FLAGS.max_body_bytes))
  except OSError as e:
    raise UserError(f"cannot listen on {FLAGS.host}:{FLAGS.port}: {e}; choose another "
                    "--port or --host") from e
  server.daemon_threads = True
  print(f"serving {served.manifest['task']} model {FLAGS.model} on "
        f"http://{FLAGS.host}:{FLAGS.port} (POST /v1/predict, GET /healthz)", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == "__main__":
  define_flags()
  errors.run(main)
