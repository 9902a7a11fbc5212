"""Load on the HTTP server (transformer_jax/serve.py): requests/s and latency percentiles
from concurrent clients, every answer checked against the artifact's own outputs.

  python -m benchmarks.serve_load --model=DIR --inputs=FILE [--requests=200] [--clients=8]
      [--lines_per_request=1] [--max_batch=32] [--max_wait_ms=5] [--request_log=FILE] [--json]

Starts the server on 127.0.0.1 (a free port) as a subprocess, computes the expected output
of every input line in this process with `Served` (the same artifact), sends untimed
warm-up requests (one per request shape, so compilation is not timed), then `requests`
POST /v1/predict from `clients` threads, each with `lines_per_request` lines of FILE in turn.
Latency is per request, from sending to the parsed answer; requests/s is requests over the
wall time of the timed loop. Loops are bounded in count and in time (--time_limit).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence
from urllib.parse import urlparse

from absl import flags

from transformer_jax import errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a line.")


def _client(url: str) -> http.client.HTTPConnection:
  parsed = urlparse(url)
  return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)


def _post(connection: http.client.HTTPConnection, lines: Sequence[str]) -> tuple[int, Any]:
  body = json.dumps({"inputs": list(lines)}).encode()
  connection.request("POST", "/v1/predict", body, {"Content-Type": "application/json"})
  response = connection.getresponse()
  return response.status, json.loads(response.read())


def run_load(url: str, requests_lines: Sequence[Sequence[str]], expected: dict[str, str], *,
             requests: int = 200, clients: int = 8, time_limit: float = 300.0) -> dict[str, Any]:
  """Sends `requests` requests (request i holds requests_lines[i % len]) from `clients`
  threads, each on its own keep-alive connection; stops early past `time_limit` seconds.
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


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(model: str, max_batch: int, max_wait_ms: float, timeout: float = 300.0,
                 extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
  """serve.py on a free port of 127.0.0.1 (with `extra_args`); returns it once /healthz
  answers."""
  port = _free_port()
  process = subprocess.Popen(
      [sys.executable, "-m", "transformer_jax.serve", f"--model={model}", "--host=127.0.0.1",
       f"--port={port}", f"--max_batch={max_batch}", f"--max_wait_ms={max_wait_ms}",
       *extra_args],
      cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and process.poll() is None:
    try:
      connection = _client(url)
      connection.request("GET", "/healthz")
      if connection.getresponse().status == 200:
        return process, url
    except OSError:
      time.sleep(0.5)
  process.kill()
  output = process.communicate()[0]
  if process.returncode == errors.EXIT_STATUS:      # the server's own one-line user error
    raise errors.UserError("the server did not start: "
                           + output.strip().splitlines()[-1].removeprefix("error: "))
  raise RuntimeError(f"the server did not start: {output}")


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


def _read_inputs(path: str) -> list[str]:
  if not os.path.isfile(path):
    raise errors.MissingFileError(f"--inputs={path}: no such file")
  with open(path) as f:
    lines = [line.rstrip("\n") for line in f]
  if not lines:
    raise errors.UserError(f"--inputs={path} has no lines")
  return lines


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  from transformer_jax.serving import ArtifactError, Served
  lines = _read_inputs(FLAGS.inputs)
  try:
    served = Served.load(FLAGS.model)
  except (ArtifactError, FileNotFoundError) as e:
    raise errors.UserError(f"--model={FLAGS.model}: {e}") from e
  try:
    expected = dict(zip(lines, served.predict(lines)))
  except errors.UserError as e:       # a line the model cannot take ("input I", from 0)
    raise errors.UserError(f"--inputs={FLAGS.inputs}: {e}") from e
  n = FLAGS.lines_per_request
  requests_lines = [[lines[(i + j) % len(lines)] for j in range(n)] for i in range(len(lines))]
  log_args = [f"--request_log={FLAGS.request_log}"] if FLAGS.request_log else []
  process, url = start_server(FLAGS.model, FLAGS.max_batch, FLAGS.max_wait_ms,
                              extra_args=log_args)
  try:
    # Warm-up, untimed: every request shape compiles once, alone and batched by 8 clients.
    run_load(url, requests_lines, expected, requests=len(requests_lines), clients=1)
    run_load(url, requests_lines, expected, requests=4 * len(requests_lines), clients=8)
    logged = _count_lines(FLAGS.request_log)
    report = run_load(url, requests_lines, expected, requests=FLAGS.requests,
                      clients=FLAGS.clients, time_limit=FLAGS.time_limit)
    if FLAGS.request_log:
      report["where"] = where_the_time_went(FLAGS.request_log, logged)
  finally:
    process.terminate()
    process.wait(timeout=60)
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
  define_flags()
  errors.run(main)
