"""The HTTP server (transformer_jax/serve.py, serving/server.py, serving/batching.py) on
127.0.0.1 with a tiny exported translation model: it answers good input, refuses bad
input with 4xx and a JSON error and stays up, stays correct under concurrent load, exposes
Prometheus metrics, names its model and device, queues a burst of connections, and shuts
down gracefully on SIGTERM; a server that cannot start is reported within seconds, with its
own last lines, by benchmarks/serve_load.py."""

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
  from benchmarks.serve_process import start_server
  running = start_server(artifact, max_batch=8, max_wait_ms=5,
                         extra_args=["--model_name=numbers", "--model_version=7"])
  yield running.url
  running.stop()


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


PREFIX = "transformer_jax_"


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
  """GET /metrics as {(sample name without the prefix, sorted labels): value}."""
  from prometheus_client.parser import text_string_to_metric_families
  with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
    assert response.headers["Content-Type"].startswith("text/plain")
    text = response.read().decode()
  return {(s.name.removeprefix(PREFIX), tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


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


def test_metrics_in_prometheus_text_format(server, served):
  """Each counter moves by exactly what one good request of two lines (one model call: both
  are in one bucket) and one malformed request do, read before and after them."""
  lines = ["eins zwei", "drei"]
  assert len({served.bucket(line) for line in served.encode(lines)}) == 1
  before = _metrics(server)
  assert _post(server, json.dumps({"inputs": lines}).encode())[0] == 200
  assert _post(server, b"{not json")[0] == 400
  after = _metrics(server)

  def change(name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)
  # 200s: the good request, and the first /metrics read (counted once its text was made).
  assert change("requests_total", code="200") == 2
  assert change("requests_total", code="400") == 1
  assert change("request_errors_total", code="400") == 1
  assert ("request_errors_total", (("code", "200"),)) not in after
  assert change("request_latency_seconds_count") == 2      # the two POSTs; GETs are not timed
  assert change("queue_wait_seconds_count") == 1           # the malformed one never queued
  assert change("batch_lines_count") == 1 and change("batch_lines_sum") == 2
  assert change("model_call_seconds_count") == 1
  assert change("decode_length_tokens_count") == 2
  assert after[("queue_depth", ())] == 0                   # nothing waiting now


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
  from benchmarks.serve_process import start_server
  running = start_server(artifact, max_batch=16, max_wait_ms=5)
  process, url = running.process, running.url
  try:
    status, health, _ = _request(url, "/healthz", method="GET")
    assert health["name"] == os.path.basename(artifact)   # the defaults: the folder's name
    assert health["version"] == served.fingerprint[:12]
    lines = [f"{LINES['seq2seq'][4]} {'eins ' * i}" for i in range(12)]  # 16 rows: compiles
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        (_post(url, json.dumps({"inputs": lines}).encode()), time.monotonic())))
    client.start()
    deadline = time.monotonic() + 300
    while True:                             # until its model call (compiling) has started
      samples = _metrics(url)
      if (samples[("queue_wait_seconds_count", ())] >= 1 or not client.is_alive()
          or time.monotonic() > deadline):
        break
      time.sleep(0.05)
    # In flight when the signal goes: its model call started, its answer not yet sent (only
    # POSTs are timed). Else the test would pass with nothing to finish.
    assert samples[("queue_wait_seconds_count", ())] == 1, samples
    assert samples[("request_latency_seconds_count", ())] == 0, samples
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    client.join(timeout=300)
    process.wait(timeout=120)
    assert running.output.wait_closed(60)
    out = "\n".join(running.output.lines())
  finally:
    if process.poll() is None:              # a failed check above: no server left behind
      process.kill()
      process.wait(timeout=60)
  assert [answer for answer, _ in answers] == [(200, {"outputs": served.predict(lines)})]
  assert answers[0][1] > signalled          # answered after the signal, not before it
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


def test_healthz_names_the_device(server):
  """/healthz says where the model runs: JAX's platform and the device's model, as JAX
  names them in the server's process (here the CPU: JAX_PLATFORMS=cpu, conftest.py)."""
  import jax
  status, health, _ = _request(server, "/healthz", method="GET")
  assert status == 200
  assert health["device"] == jax.devices()[0].platform == "cpu"
  assert health["device_kind"] == jax.devices()[0].device_kind and health["device_kind"]


def test_serve_load_reports_a_server_that_dies_at_start(artifact, tmp_path):
  """A server that exits while loading (a corrupted params.npz: status 2, its own error
  line) ends serve_load within seconds, far below --ready_timeout_s: one `error:` line
  naming the server's own error, then the server's last lines; status 2; no JSON."""
  import shutil
  broken = tmp_path / "broken"
  shutil.copytree(artifact, broken)
  with open(broken / "params.npz", "r+b") as f:      # same size, other bytes
    f.seek(100)
    f.write(b"\0" * 16)
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("\n".join(LINES["seq2seq"]) + "\n")
  started = time.monotonic()
  run = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", f"--model={broken}",
                        f"--inputs={inputs}", "--requests=5", "--ready_timeout_s=120",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
  elapsed = time.monotonic() - started
  assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
  assert elapsed < 30, elapsed
  errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "server exited with status 2" in errors[0], run.stderr
  assert "params.npz" in errors[0] and "SHA-256" in errors[0], run.stderr
  tail = run.stderr.partition(errors[0])[2].splitlines()     # the server's, after the error
  assert any(line.startswith("  server| error: --model=") for line in tail), run.stderr
  assert "Traceback" not in run.stderr


def test_server_exit_is_noticed_at_once_and_a_slow_start_is_bounded(tmp_path, artifact):
  """start_server raises ServerFailed with the server's output within about a second of
  its exit (a directory that is not an artifact), and kills a server whose /healthz does
  not answer within the ready timeout (it listens on another port) instead of waiting on."""
  from benchmarks.serve_process import ServerFailed, start_server
  with pytest.raises(ServerFailed) as failed:
    start_server(str(tmp_path / "none"), max_batch=1, max_wait_ms=0, ready_timeout=120)
  noticed = time.monotonic()
  assert failed.value.status == 2 and failed.value.ended_at is not None
  assert noticed - failed.value.ended_at < 1.5, noticed - failed.value.ended_at
  assert "manifest.json is missing" in str(failed.value).splitlines()[0]
  assert any("manifest.json is missing" in line for line in failed.value.tail)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    elsewhere = s.getsockname()[1]
  started = time.monotonic()
  with pytest.raises(ServerFailed) as failed:     # the last --port wins
    start_server(artifact, max_batch=1, max_wait_ms=0, ready_timeout=5,
                 extra_args=[f"--port={elsewhere}"])
  assert failed.value.status is None and "--ready_timeout_s" in str(failed.value)
  assert 5 <= time.monotonic() - started < 20
  with pytest.raises(OSError):                    # killed: no longer listening
    socket.create_connection(("127.0.0.1", elsewhere), timeout=5).close()


class _Device:
  def __init__(self, platform: str, kind: str):
    self.platform, self.device_kind = platform, kind


def _devices(failure: str | None):
  """A stand-in for jax.devices: the CPU by default; asked for a GPU platform, raises
  RuntimeError(failure) (JAX's words when that backend did not start), or 'Unknown
  backend' when failure is None."""
  def devices(platform: str | None = None) -> list:
    if platform is None:
      return [_Device("cpu", "cpu")]
    raise RuntimeError(failure or f"Unknown backend {platform}. Available backends are "
                       "['cpu']")
  return devices


def test_a_gpu_that_did_not_start_is_one_line_naming_the_memory_variables():
  """JAX falls back to the CPU when its GPU backend fails (another process holding the
  memory): the server refuses in one line naming the variables that share a GPU. A CPU
  machine, or a chosen JAX_PLATFORMS, serves on the CPU."""
  from transformer_jax.errors import UserError
  from transformer_jax.serving import device
  failure = ("Backend 'cuda' failed to initialize: INTERNAL: no supported devices found for "
             "platform CUDA.\n Available backends are ['cpu']")
  with pytest.raises(UserError) as refused:
    device.check_backends(_devices(failure), chosen=None)
  message = str(refused.value)
  assert "\n" not in message and "no supported devices found" in message
  assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in message
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in message
  assert device.check_backends(_devices(None), chosen=None) == {"device": "cpu",
                                                                "device_kind": "cpu"}
  assert device.check_backends(_devices(failure), chosen="cpu")["device"] == "cpu"

  def broken(platform: str | None = None) -> list:
    raise RuntimeError("Unable to initialize backend 'cuda': RESOURCE_EXHAUSTED")
  with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
    device.check_backends(broken, chosen="cuda")
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.5GiB.")
  problem = device.memory_error(oom, "loading --model=M")
  assert problem is not None and str(problem).startswith("loading --model=M: ")
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" in str(problem)
  assert device.memory_error(RuntimeError("INVALID_ARGUMENT: shapes differ"), "x") is None
