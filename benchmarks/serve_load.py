"""Load on the HTTP server (transformer_jax/serve.py): requests/s and latency percentiles
from concurrent clients, every answer checked against the artifact's own outputs.

  python -m benchmarks.serve_load --model=DIR --inputs=FILE [--requests=200] [--clients=8]
      [--lines_per_request=1] [--max_batch=32] [--max_wait_ms=5] [--request_log=FILE]
      [--ready_timeout_s=120] [--json]

Starts the server on 127.0.0.1 (a free port) as a subprocess (benchmarks/serve_process.py)
and waits for its /healthz, computes the expected output of every input line in this
process with `Served` (the same artifact), sends untimed warm-up requests (one per request
shape, so compilation is not timed), then `requests` POST /v1/predict from `clients`
threads, each with `lines_per_request` lines of FILE in turn. Latency is per request, from sending to the
parsed answer; requests/s is requests over the wall time of the timed loop. Loops are
bounded in count and in time (--time_limit).

Two JAX processes share one GPU here: unless XLA_PYTHON_CLIENT_PREALLOCATE or
XLA_PYTHON_CLIENT_MEM_FRACTION is set, both take GPU memory as they need it instead of 75%
of it each at start. A server that exits, or is not ready within --ready_timeout_s, ends
the run at once: one `error:` line, then the server's last output lines; status 2 when the
server's own was 2 (its user error, e.g. a corrupted artifact), else 1.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import sys
import threading
import time
from typing import Any, Callable, NoReturn, Sequence
from urllib.parse import urlparse

from absl import flags

from benchmarks.serve_process import ServerFailed, share_gpu, start_server
from transformer_jax import errors

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (absl flags are
  global: tests import this module beside modules that define --json, --max_batch...)."""
  flags.DEFINE_string("model", None, "Artifact directory (export --format=stablehlo).",
                      required=True)
  flags.DEFINE_string("inputs", None, "Input lines, one per line.", required=True)
  flags.DEFINE_integer("requests", 200, "Timed requests.", lower_bound=1)
  flags.DEFINE_integer("clients", 8, "Concurrent client threads.", lower_bound=1)
  flags.DEFINE_integer("lines_per_request", 1, "Input lines in each request.", lower_bound=1)
  flags.DEFINE_integer("max_batch", 32, "The server's --max_batch.", lower_bound=1)
  flags.DEFINE_float("max_wait_ms", 5.0, "The server's --max_wait_ms.", lower_bound=0.0)
  flags.DEFINE_float("time_limit", 600.0, "Seconds after which the timed loop stops early.",
                     lower_bound=0.0)
  flags.DEFINE_string("request_log", None, "The server's per-request log (serve "
                      "--request_log); the timed requests are summarised from it.")
  flags.DEFINE_float("ready_timeout_s", 120.0, "How long the server may take to load the "
                     "model and answer /healthz.", lower_bound=0.0)
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a line.")


def _client(url: str, timeout: float = 120.0) -> http.client.HTTPConnection:
  parsed = urlparse(url)
  return http.client.HTTPConnection(str(parsed.hostname), parsed.port, timeout=timeout)


def _post(connection: http.client.HTTPConnection, lines: Sequence[str]) -> tuple[int, Any]:
  body = json.dumps({"inputs": list(lines)}).encode()
  connection.request("POST", "/v1/predict", body, {"Content-Type": "application/json"})
  response = connection.getresponse()
  return response.status, json.loads(response.read())


def run_load(url: str, requests_lines: Sequence[Sequence[str]], expected: dict[str, str], *,
             requests: int = 200, clients: int = 8, time_limit: float = 300.0,
             alive: Callable[[], bool] = lambda: True) -> dict[str, Any]:
  """Sends `requests` requests (request i holds requests_lines[i % len]) from `clients`
  threads, each on its own keep-alive connection; stops early past `time_limit` seconds,
  or at a failed connection once `alive()` says the server is gone.
  Returns counts, wrong answers (an output differing from `expected[line]`), errors, and
  requests/s and latency percentiles in ms."""
  counter = iter(range(requests))
  lock = threading.Lock()
  latencies: list[float] = []
  errors: list[str] = []
  wrong = 0
  deadline = time.monotonic() + time_limit

  def worker() -> None:
    nonlocal wrong
    connection = _client(url)
    try:
      while time.monotonic() < deadline:
        with lock:
          index = next(counter, None)
        if index is None:
          return
        lines = requests_lines[index % len(requests_lines)]
        start = time.perf_counter()
        try:
          status, answer = _post(connection, lines)
        except (OSError, http.client.HTTPException, ValueError) as e:
          with lock:
            errors.append(f"request {index}: {type(e).__name__}: {e}")
          connection.close()
          if not alive():
            return
          connection = _client(url)
          continue
        elapsed = time.perf_counter() - start
        with lock:
          if status != 200:
            errors.append(f"request {index}: {status} {answer}")
          else:
            latencies.append(elapsed)
            wrong += answer["outputs"] != [expected[line] for line in lines]
    finally:
      connection.close()

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for future in [pool.submit(worker) for _ in range(clients)]:
      future.result()
  wall = time.perf_counter() - start
  latencies.sort()

  def percentile(q: float) -> float:
    return 1000 * latencies[min(int(q * len(latencies)), len(latencies) - 1)] if latencies else 0.0
  return {"requests": len(latencies) + len(errors), "ok": len(latencies), "wrong": wrong,
          "errors": errors[:10], "clients": clients, "wall_s": wall,
          "requests_per_s": len(latencies) / wall if wall else 0.0,
          "p50_ms": percentile(0.50), "p99_ms": percentile(0.99)}


def _count_lines(path: str | None) -> int:
  if not path or not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for _ in f)


def where_the_time_went(path: str, skip: int) -> dict[str, dict[str, float]]:
  """From the server's request log (past its first `skip` records, the warm-up): for all
  requests and for the slowest 1%, the mean latency, queue wait, model-call seconds,
  compile seconds, lines per call, padded length and output tokens."""
  with open(path) as f:
    records = [json.loads(line) for line in list(f)[skip:]]
  records.sort(key=lambda r: r["latency_s"])

  def summary(group: list[dict]) -> dict[str, float]:
    calls = [c for r in group for c in r["calls"]]
    tokens = [t for r in group for t in r["decode_tokens"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0   # noqa: E731
    return {"requests": len(group), "latency_s": mean([r["latency_s"] for r in group]),
            "queue_wait_s": mean([r["queue_wait_s"] for r in group]),
            "call_s": mean([c["seconds"] for c in calls]),
            "compile_s": mean([c["compile_s"] for c in calls]),
            "lines_per_call": mean([c["lines"] for c in calls]),
            "bucket": mean([c["bucket"] for c in calls]),
            "decode_tokens": mean(tokens), "max_decode_tokens": max(tokens, default=0)}
  return {"all": summary(records),
          "slowest_1pct": summary(records[-max(1, len(records) // 100):])}


def _read_inputs(path: str, flag: str = "--inputs") -> list[str]:
  """The lines of the file `flag` names."""
  if not os.path.isfile(path):
    raise errors.MissingFileError(f"{flag}={path}: no such file")
  with open(path) as f:
    lines = [line.rstrip("\n") for line in f]
  if not lines:
    raise errors.UserError(f"{flag}={path} has no lines")
  return lines


def _progress(message: str) -> None:
  """A line on stderr, so that a long wait (loading, compiling) shows what it waits for."""
  print(f"serve_load: {message}", file=sys.stderr, flush=True)


def _expected(model: str, lines: list[str], inputs: str) -> dict[str, str]:
  """Each input line's output from the artifact, computed in this process."""
  from transformer_jax.serving import ArtifactError, Served, device
  try:
    served = Served.load(model)
    return dict(zip(lines, served.predict(lines)))
  except (ArtifactError, FileNotFoundError) as e:
    raise errors.UserError(f"--model={model}: {e}") from e
  except errors.UserError as e:       # a line the model cannot take ("input I", from 0)
    raise errors.UserError(f"--inputs={inputs}: {e}") from e
  except RuntimeError as e:           # beside the server, the GPU's memory ran out
    problem = device.memory_error(e, f"--model={model} in serve_load")
    if problem is None:
      raise
    raise problem from e


def _fail(failure: ServerFailed) -> NoReturn:
  """One `error:` line and the server's last lines; the server's own status 2 (its user
  error) stays 2, anything else is a failure of the server under test: 1."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {failure}\n")
  sys.stderr.flush()
  raise SystemExit(errors.EXIT_STATUS if failure.status == errors.EXIT_STATUS else 1)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  lines = _read_inputs(FLAGS.inputs)
  n = FLAGS.lines_per_request
  requests_lines = [[lines[(i + j) % len(lines)] for j in range(n)] for i in range(len(lines))]
  log_args = [f"--request_log={FLAGS.request_log}"] if FLAGS.request_log else []
  started = time.monotonic()
  try:        # The server first: a broken artifact or GPU is reported before any work here.
    server = start_server(FLAGS.model, FLAGS.max_batch, FLAGS.max_wait_ms,
                          FLAGS.ready_timeout_s, extra_args=log_args)
  except ServerFailed as e:
    _fail(e)
  _progress(f"server ready in {time.monotonic() - started:.1f} s on "
            f"{server.health['device']} ({server.health['device_kind']})")
  try:
    started = time.monotonic()
    expected = _expected(FLAGS.model, lines, FLAGS.inputs)
    server.check("while this process computed the expected outputs")
    _progress(f"expected outputs of {len(lines)} lines in {time.monotonic() - started:.1f} s")
    # Warm-up, untimed: every request shape compiles once, alone and batched by 8 clients.
    started = time.monotonic()
    alive = lambda: server.process.poll() is None     # noqa: E731
    run_load(server.url, requests_lines, expected, requests=len(requests_lines), clients=1,
             alive=alive)
    run_load(server.url, requests_lines, expected, requests=4 * len(requests_lines), clients=8,
             alive=alive)
    server.check("during the warm-up")
    _progress(f"warm-up in {time.monotonic() - started:.1f} s")
    logged = _count_lines(FLAGS.request_log)
    report = run_load(server.url, requests_lines, expected, requests=FLAGS.requests,
                      clients=FLAGS.clients, time_limit=FLAGS.time_limit, alive=alive)
    server.check("during the timed requests")
    if FLAGS.request_log:
      report["where"] = where_the_time_went(FLAGS.request_log, logged)
  except ServerFailed as e:
    _fail(e)
  finally:
    server.stop()
  report.update(device=server.health["device"], device_kind=server.health["device_kind"])
  report.update(date=datetime.date.today().isoformat(), machine=platform.platform(),
                cpus=os.cpu_count(), lines_per_request=n, max_batch=FLAGS.max_batch,
                max_wait_ms=FLAGS.max_wait_ms, model=FLAGS.model)
  if FLAGS.json:
    print(json.dumps(report))
  else:
    print(f"{report['ok']}/{FLAGS.requests} requests ok, {report['wrong']} wrong, "
          f"{len(report['errors'])} errors; {FLAGS.clients} clients, {n} line(s) each: "
          f"{report['requests_per_s']:.1f} requests/s, p50 {report['p50_ms']:.1f} ms, "
          f"p99 {report['p99_ms']:.1f} ms")
    if "where" in report:
      for group, values in report["where"].items():
        print(f"  {group}: " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
  if report["wrong"] or report["errors"]:
    # A failure of the server under test, not of the user's input: status 1, not 2.
    sys.exit(1)


if __name__ == "__main__":
  share_gpu(os.environ)     # before this process (or the server) starts JAX
  define_flags()
  errors.run(main)
