"""The HTTP server (transformer_jax/serve.py, serving/server.py, serving/batching.py) on
127.0.0.1 with a tiny exported translation model: it answers good input, refuses bad
input with 4xx and a JSON error and stays up, stays correct under concurrent load, exposes
Prometheus metrics, names its model, queues a burst of connections, and shuts down
gracefully on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
from cli_helpers import ROOT
from test_serving import LINES


@pytest.fixture(scope="module")
def artifact(trained_runs) -> str:
  """The tiny translation model's export, shared with tests/test_serving.py."""
  return trained_runs.artifact("seq2seq")


@pytest.fixture(scope="module")
def served(artifact):
  from transformer_jax.serving import Served
  return Served.load(artifact)


@pytest.fixture(scope="module")
def server(artifact):
  """serve.py on 127.0.0.1 (a free port) with the translation artifact."""
  from benchmarks.serve_load import start_server
  process, url = start_server(artifact, max_batch=8, max_wait_ms=5,
                              extra_args=["--model_name=numbers", "--model_version=7"])
  yield url
  process.terminate()
  process.wait(timeout=60)


def _request(url: str, path: str = "/v1/predict", body: bytes | None = None,
             method: str = "POST") -> tuple[int, dict, dict]:
  """(status, JSON answer, headers)."""
  request = urllib.request.Request(url + path, data=body, method=method,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      return response.status, json.loads(response.read()), dict(response.headers)
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), dict(e.headers)


def _post(url: str, body: bytes) -> tuple[int, dict]:
  return _request(url, body=body)[:2]


def test_server_answers_good_input_and_refuses_bad_input(server, served):
  lines = LINES["seq2seq"][:3]
  expected = served.predict(lines)
  good = json.dumps({"inputs": lines}).encode()
  assert _post(server, good) == (200, {"outputs": expected})
  too_long = " ".join(["eins"] * 200)
  for body in (json.dumps({"inputs": "eins zwei"}).encode(),     # not a list
               json.dumps({"inputs": ["eins", 3]}).encode(),     # not a string
               json.dumps({"text": ["eins"]}).encode(),          # no "inputs"
               json.dumps({"inputs": [too_long]}).encode(),      # over max_len
               b"",                                              # empty body
               b"{not json"):
    status, answer = _post(server, body)
    assert status == 400, (body, status, answer)
    assert isinstance(answer.get("error"), str) and answer["error"]
  assert _post(server, good) == (200, {"outputs": expected})     # Still serving.
  status, health, _ = _request(server, "/healthz", method="GET")
  assert status == 200 and health["status"] == "ok" and health["task"] == "seq2seq"
  assert (health["name"], health["version"]) == ("numbers", "7")
  assert health["fingerprint"] == served.fingerprint


def test_every_error_is_4xx_json(server):
  """Wrong methods, unknown paths, an unknown method and a malformed request line are
  answered 4xx with a JSON error, not the standard library's HTML."""
  for path, method, status in (("/v1/predict", "PUT", 405), ("/v1/predict", "GET", 405),
                               ("/v1/predict", "DELETE", 405), ("/healthz", "POST", 405),
                               ("/nowhere", "GET", 404), ("/nowhere", "POST", 404)):
    code, answer, headers = _request(server, path, b"{}" if method != "GET" else None, method)
    assert code == status and answer["error"], (path, method, code, answer)
    assert headers["Content-Type"] == "application/json"
    if status == 405:
      assert headers["Allow"] in ("GET", "POST")
  host, port = server.removeprefix("http://").split(":")
  for raw in (b"BREW /v1/predict HTTP/1.1\r\nHost: x\r\n\r\n",
              b"GET /a b HTTP/1.1\r\n\r\n"):
    with socket.create_connection((host, int(port)), timeout=30) as s:
      s.sendall(raw)
      head, _, body = s.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.split()[1] in (b"400", b"405") and json.loads(body)["error"], head
  assert _post(server, json.dumps({"inputs": ["eins"]}).encode())[0] == 200


def test_oversized_requests_get_413_not_a_broken_pipe(server):
  """A body over --max_body_bytes (1 MiB), sent whole before the answer is read as
  urllib does, gets its 413; so do more lines than --max_inputs."""
  big = json.dumps({"inputs": ["eins " * (1 << 19)]}).encode()     # 2.5 MiB
  status, answer = _post(server, big)
  assert status == 413 and "max_body_bytes" in answer["error"]
  status, answer = _post(server, json.dumps({"inputs": ["eins"] * 65}).encode())
  assert status == 413 and "at most 64" in answer["error"]
  assert _post(server, json.dumps({"inputs": ["eins"]}).encode())[0] == 200


def test_metrics_in_prometheus_text_format(server):
  from prometheus_client.parser import text_string_to_metric_families
  _post(server, json.dumps({"inputs": ["eins zwei", "drei"]}).encode())
  _post(server, b"{not json")
  with urllib.request.urlopen(server + "/metrics", timeout=30) as response:
    assert response.headers["Content-Type"].startswith("text/plain")
    text = response.read().decode()
  samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for family in text_string_to_metric_families(text) for s in family.samples}
  prefix = "transformer_jax_"
  assert samples[(prefix + "requests_total", (("code", "200"),))] >= 1
  assert samples[(prefix + "request_errors_total", (("code", "400"),))] >= 1
  assert (prefix + "request_errors_total", (("code", "200"),)) not in samples
  assert samples[(prefix + "request_latency_seconds_count", ())] >= 2
  assert samples[(prefix + "batch_lines_count", ())] >= 1
  assert samples[(prefix + "batch_lines_sum", ())] >= 2
  assert samples[(prefix + "decode_length_tokens_count", ())] >= 2
  assert samples[(prefix + "queue_depth", ())] == 0          # nothing waiting now
  assert samples[(prefix + "queue_wait_seconds_count", ())] >= 1


def test_server_stays_correct_under_concurrent_load(server, served):
  """200 requests from 8 clients (bounded in count and time): every answer is the
  artifact's own output for its inputs, whatever it was batched with."""
  from benchmarks.serve_load import run_load
  lines = LINES["seq2seq"]
  expected = dict(zip(lines, served.predict(lines)))
  report = run_load(server, [[line] for line in lines] + [lines[:3], lines[2:]], expected,
                    requests=200, clients=8, time_limit=300)
  assert report["requests"] == 200 and report["errors"] == [] and report["wrong"] == 0


def test_listen_backlog_queues_a_burst_of_connections():
  """Before anything accepts, the kernel completes as many connections as the backlog
  allows: 60 with --listen_backlog=128, far fewer with the standard library's 5."""
  from transformer_jax.serving.server import Server

  def completed(backlog: int) -> int:
    server = Server(("127.0.0.1", 0), object, backlog)     # never serves: nothing accepts
    sockets, done = [], 0
    try:
      for _ in range(60):
        s = socket.socket()
        s.settimeout(0.3)
        sockets.append(s)
        try:
          s.connect(server.server_address)
        except OSError:
          break                           # the queue is full
        done += 1
    finally:
      for s in sockets:
        s.close()
      server.server_close()
    return done
  assert completed(128) == 60
  assert completed(5) < 60


def test_sigterm_finishes_requests_in_flight_and_exits_0(artifact, served):
  from benchmarks.serve_load import start_server
  process, url = start_server(artifact, max_batch=16, max_wait_ms=5)
  try:
    status, health, _ = _request(url, "/healthz", method="GET")
    assert health["name"] == os.path.basename(artifact)   # the defaults: the folder's name
    assert health["version"] == served.fingerprint[:12]
    lines = [f"{LINES['seq2seq'][4]} {'eins ' * i}" for i in range(12)]  # 16 rows: compiles
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        _post(url, json.dumps({"inputs": lines}).encode())))
    client.start()
    while client.is_alive() and b"transformer_jax_queue_wait_seconds_count 1.0" not in (
        urllib.request.urlopen(url + "/metrics", timeout=30).read()):
      time.sleep(0.05)                      # until its model call (compiling) has started
    process.send_signal(signal.SIGTERM)
    client.join(timeout=300)
    out, _ = process.communicate(timeout=120)
  finally:
    if process.poll() is None:              # a failed check above: no server left behind
      process.kill()
      process.wait(timeout=60)
  assert answers == [(200, {"outputs": served.predict(lines)})]
  assert process.returncode == 0 and "stopped" in out, out
  with pytest.raises(OSError):            # no longer listening
    http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=5).connect()


def test_serve_user_errors_exit_2(artifact, tmp_path):
  """The server command fails as the other commands do: one `error:` line, status 2."""
  for args, message in (([f"--model={tmp_path / 'none'}"], "manifest.json is missing"),
                        ([f"--model={artifact}", "--max_batch=0"], "max_batch"),
                        ([], "--model")):
    run = subprocess.run([sys.executable, "-m", "transformer_jax.serve", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
