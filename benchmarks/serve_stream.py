"""Streamed completions under load (POST /v1/completions with "stream": true, the server of
transformer_jax/serve.py): the time to the first token and between tokens (p50, p99) and
the tokens per second in all, for each number of concurrent streaming clients; beside them,
the same prompts through POST /v1/predict in batches.

  python -m benchmarks.serve_stream --model=DIR --prompts=FILE [--clients=1,4,16,64]
      [--requests=4] [--slots=64] [--predict_batch=16] [--warm_up_tokens=N]
      [--ready_timeout_s=600] [--json] [--random_model=gpt2_small]

FILE holds one prompt a line, as POST /v1/predict takes lines (`\\n` for a newline). The
server starts with --slots and --warm_up_tokens (benchmarks/serve_process.py): the batch
shapes of texts up to that many tokens compile before it listens. Every completion draws
with the artifact's own decode options (max_new_tokens, temperature, top_k, top_p, seed),
as /v1/predict does. First, untimed, each prompt alone: its text and token count, which must
equal /v1/predict's line for it. Then for each client count C, an untimed warm-up round
(each client one completion) and a timed one: each of C threads streams --requests
completions, one after another on its own connection. Every streamed text must equal its
prompt's own (a choice does not depend on the rows beside it): a difference fails the run.
The times are the client's: the first token from sending the request, between tokens from
one chunk to the next; tokens per second are all the tokens over the round's wall time.
/v1/predict: the prompts in requests of --predict_batch lines, one after another; its
tokens are the prompts' completion tokens. The server's compile seconds during each timed
round are reported (0: no shape compiled then).

--random_model=gpt2_small first writes to --model (when it does not exist) an artifact of
GPT-2 small's shape (124M parameters: 12 layers, 768 wide, 12 heads, 1,024 positions, a
50,257-token vocabulary: 50,253 characters standing in for its byte-level BPE) with random
weights: its speed is GPT-2 small's, its text noise.
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
from typing import Any, Sequence

from absl import flags

from benchmarks.serve_load import _client, _fail, _progress, _read_inputs
from benchmarks.serve_process import RunningServer, ServerFailed, share_gpu, start_server
from transformer_jax import errors

FLAGS = flags.FLAGS
RANDOM_MODELS = ("gpt2_small",)


def define_flags() -> None:
  flags.DEFINE_string("model", None, "Artifact directory of a language model (export "
                      "--format=stablehlo).", required=True)
  flags.DEFINE_string("prompts", None, "Prompts, one per line.", required=True)
  flags.DEFINE_list("clients", ["1", "4", "16", "64"], "Concurrent streaming clients, one "
                    "timed round each.")
  flags.DEFINE_integer("requests", 4, "Completions each client streams in a round.",
                       lower_bound=1)
  flags.DEFINE_integer("slots", 64, "The server's --slots.", lower_bound=1)
  flags.DEFINE_integer("predict_batch", 16, "Lines per /v1/predict request.", lower_bound=1)
  flags.DEFINE_integer("warm_up_tokens", None, "The server's --warm_up_tokens (default: the "
                       "model's max_len: every batch shape compiles before the rounds).",
                       lower_bound=1)
  flags.DEFINE_float("ready_timeout_s", 600.0, "How long the server may take to load the "
                     "model and answer /healthz.", lower_bound=0.0)
  flags.DEFINE_enum("random_model", None, list(RANDOM_MODELS), "Write a model of this shape "
                    "with random weights to --model first, unless it exists.")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


# -------------------------------------------------------------------------- requests
def _completion(connection: http.client.HTTPConnection, body: bytes
                ) -> tuple[float, list[float], str]:
  """Streams one completion: when it was sent, when each chunk (a token) came, the text."""
  sent = time.perf_counter()
  connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
  response = connection.getresponse()
  if response.status != 200:
    raise RuntimeError(f"{response.status} {response.read()[:300]!r}")
  times, text = [], []
  for line in iter(response.readline, b""):
    if not line.startswith(b"data: "):
      continue
    if line.strip() == b"data: [DONE]":
      break
    times.append(time.perf_counter())
    chunk = json.loads(line[len(b"data: "):])
    if "error" in chunk:
      raise RuntimeError(chunk["error"]["message"])
    text.append(chunk["choices"][0]["text"])
  response.read()                              # the chunked body's end: the connection goes on
  return sent, times, "".join(text)


def _percentile(values: Sequence[float], q: float) -> float:
  ordered = sorted(values)
  return 1000 * ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def stream_round(url: str, bodies: Sequence[bytes], expected: Sequence[str], clients: int,
                 requests: int) -> dict[str, Any]:
  """`clients` threads, each streaming `requests` completions (request j of client i:
  bodies[(i * requests + j) % len]); times and texts checked against `expected`."""
  lock = threading.Lock()
  first: list[float] = []
  between: list[float] = []
  tokens = wrong = 0

  def client(i: int) -> None:
    nonlocal tokens, wrong
    connection = _client(url, timeout=600)
    try:
      for j in range(requests):
        k = (i * requests + j) % len(bodies)
        sent, times, text = _completion(connection, bodies[k])
        with lock:
          first.append(times[0] - sent)
          between.extend(b - a for a, b in zip(times, times[1:]))
          tokens += len(times)
          wrong += text != expected[k]
    finally:
      connection.close()

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for future in [pool.submit(client, i) for i in range(clients)]:
      future.result()
  wall = time.perf_counter() - start
  return {"clients": clients, "requests": clients * requests, "tokens": tokens,
          "wrong": wrong, "wall_s": wall, "tokens_per_s": tokens / wall,
          "first_token_p50_ms": _percentile(first, 0.5),
          "first_token_p99_ms": _percentile(first, 0.99),
          "between_tokens_p50_ms": _percentile(between, 0.5),
          "between_tokens_p99_ms": _percentile(between, 0.99)}


def predict_round(url: str, lines: Sequence[str], tokens: Sequence[int],
                  expected: Sequence[str], batch: int) -> dict[str, Any]:
  """The lines through /v1/predict, `batch` a request, one request after another."""
  connection = _client(url, timeout=600)
  latencies, wrong = [], 0
  start = time.perf_counter()
  try:
    for first in range(0, len(lines), batch):
      sent = time.perf_counter()
      connection.request("POST", "/v1/predict",
                         json.dumps({"inputs": list(lines[first:first + batch])}).encode())
      outputs = json.loads(connection.getresponse().read())["outputs"]
      latencies.append(time.perf_counter() - sent)
      wrong += sum(o != e for o, e in zip(outputs, expected[first:first + batch]))
  finally:
    connection.close()
  wall = time.perf_counter() - start
  return {"lines_per_request": batch, "requests": len(latencies), "tokens": sum(tokens),
          "wrong": wrong, "wall_s": wall, "tokens_per_s": sum(tokens) / wall,
          "request_p50_ms": _percentile(latencies, 0.5),
          "request_p99_ms": _percentile(latencies, 0.99)}


def _compile_seconds(server: RunningServer) -> float:
  """The server's transformer_jax_compile_seconds_total."""
  connection = _client(server.url)
  try:
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
  finally:
    connection.close()
  return next(float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("transformer_jax_compile_seconds_total "))


# ---------------------------------------------------------------------------- models
def write_gpt2_small(directory: str) -> None:
  """GPT-2 small's shape with random weights, as an artifact (see the module doc)."""
  import jax
  import jax.numpy as jnp

  from transformer_jax import TransformerConfig
  from transformer_jax.data.tokenizer import CharVocab
  from transformer_jax.options import DecodeOptions
  from transformer_jax.serving import write_artifact
  from transformer_jax.tasks.lm import LanguageModelTask
  ascii_ = [chr(c) for c in range(32, 127)] + ["\n"]
  chars = ascii_ + [chr(c) for c in range(0xA1, 0xA1 + 50253 - len(ascii_))]
  cfg = TransformerConfig(
      vocab_size=4 + len(chars), d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0,
      num_decoder_layers=12, max_len=1024, dropout_rate=0.0, attention_dropout_rate=0.0,
      activation="gelu", norm_position="pre", positional="learned", norm_type="layer",
      scale_embeddings=False, attention_impl="auto")
  task = LanguageModelTask(cfg, tokenizer=CharVocab(chars))
  params = jax.jit(task.model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
  write_artifact(task, params, DecodeOptions(max_new_tokens=64, temperature=0.8), directory,
                 lines=task.line_policy(None), source={"random": "gpt2_small"})


# ------------------------------------------------------------------------------ main
def _manifest(model: str) -> dict[str, Any]:
  try:
    with open(os.path.join(model, "manifest.json")) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.UserError(f"--model={model}: {e}") from e
  if manifest.get("output") != "continuation":
    raise errors.UserError(f"--model={model} is a {manifest.get('task')} model; this "
                           "benchmark streams a language model's completions")
  return manifest


def measure(server: RunningServer, lines: list[str], clients: list[int]) -> dict[str, Any]:
  from transformer_jax.serving.line_policy import escape_line, unescape_line
  decode = _manifest(FLAGS.model)["decode"]
  name = server.health["name"]
  bodies = [json.dumps({"model": name, "prompt": unescape_line(line), "stream": True,
                        "max_tokens": decode["max_new_tokens"],
                        "temperature": decode["temperature"], "top_k": decode["top_k"],
                        "top_p": decode["top_p"], "seed": decode["seed"]}).encode()
            for line in lines]
  expected, tokens = [], []
  connection = _client(server.url, timeout=600)
  for body in bodies:                         # each prompt alone: its text and tokens
    _, times, text = _completion(connection, body)
    expected.append(text)
    tokens.append(len(times))
  connection.close()
  server.check("while each prompt ran alone")
  _progress(f"each of {len(lines)} prompts alone: {sum(tokens)} tokens")
  report: dict[str, Any] = {"rounds": [], "alone_tokens": sum(tokens)}
  for count in clients:
    stream_round(server.url, bodies, expected, count, 1)
    compiled = _compile_seconds(server)
    row = stream_round(server.url, bodies, expected, count, FLAGS.requests)
    row["compile_s"] = _compile_seconds(server) - compiled
    row["load"] = os.getloadavg()[0]        # other work on this machine's cores meanwhile
    server.check(f"with {count} clients")
    _progress(f"{count} clients: {row['tokens_per_s']:.1f} tokens/s")
    report["rounds"].append(row)
  escaped = [escape_line(text) for text in expected]
  predict_round(server.url, lines, tokens, escaped, FLAGS.predict_batch)       # warm-up
  compiled = _compile_seconds(server)
  report["predict"] = predict_round(server.url, lines, tokens, escaped, FLAGS.predict_batch)
  report["predict"]["compile_s"] = _compile_seconds(server) - compiled
  report["predict"]["load"] = os.getloadavg()[0]
  return report


def _print(report: dict[str, Any]) -> None:
  print("clients | tokens/s | first token p50 / p99 ms | between tokens p50 / p99 ms | "
        "wrong | compile s | load")
  for r in report["rounds"]:
    print(f"{r['clients']:7d} | {r['tokens_per_s']:8.1f} | {r['first_token_p50_ms']:8.1f} / "
          f"{r['first_token_p99_ms']:8.1f} | {r['between_tokens_p50_ms']:8.1f} / "
          f"{r['between_tokens_p99_ms']:8.1f} | {r['wrong']} | {r['compile_s']:.1f} | "
          f"{r['load']:.1f}")
  p = report["predict"]
  print(f"/v1/predict, {p['lines_per_request']} lines a request: {p['tokens_per_s']:.1f} "
        f"tokens/s, request p50 {p['request_p50_ms']:.1f} ms, p99 {p['request_p99_ms']:.1f} "
        f"ms, {p['wrong']} wrong, compile {p['compile_s']:.1f} s")
  for key, value in report.get("against_one_client", {}).items():
    print(f"{key}: {value:.2f}")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    clients = [int(c) for c in FLAGS.clients]
  except ValueError:
    raise errors.UserError(f"--clients={','.join(FLAGS.clients)}: give whole numbers") from None
  lines = _read_inputs(FLAGS.prompts, "--prompts")
  if FLAGS.random_model and not os.path.exists(FLAGS.model):
    started = time.monotonic()
    write_gpt2_small(FLAGS.model)
    _progress(f"wrote {FLAGS.random_model} with random weights to {FLAGS.model} in "
              f"{time.monotonic() - started:.0f} s")
  warm_up = FLAGS.warm_up_tokens or _manifest(FLAGS.model)["max_len"]
  started = time.monotonic()
  try:
    server = start_server(FLAGS.model, FLAGS.predict_batch, 5.0, FLAGS.ready_timeout_s,
                          extra_args=[f"--slots={FLAGS.slots}", f"--warm_up_tokens={warm_up}",
                                      f"--max_inputs={max(64, FLAGS.predict_batch)}"])
  except ServerFailed as e:
    _fail(e)
  _progress(f"server ready in {time.monotonic() - started:.1f} s")
  try:
    report = measure(server, lines, clients)
  except ServerFailed as e:
    _fail(e)
  finally:
    server.stop()
  rounds = {r["clients"]: r for r in report["rounds"]}
  if 1 in rounds:
    report["against_one_client"] = {}
    for count, row in rounds.items():
      if count != 1:
        report["against_one_client"][f"tokens/s at {count} clients / at 1"] = (
            row["tokens_per_s"] / rounds[1]["tokens_per_s"])
        report["against_one_client"][f"between-token p99 at {count} clients / at 1"] = (
            row["between_tokens_p99_ms"] / rounds[1]["between_tokens_p99_ms"])
  report.update(model=FLAGS.model, slots=FLAGS.slots, warm_up_tokens=warm_up,
                date=datetime.date.today().isoformat(), machine=platform.platform(),
                cpus=os.cpu_count(), device=server.health["device"])
  if FLAGS.json:
    print(json.dumps(report))
  else:
    _print(report)
  if any(r["wrong"] for r in report["rounds"]) or report["predict"]["wrong"]:
    sys.exit(1)      # a failure of the server under test, not of the user's input


if __name__ == "__main__":
  share_gpu(os.environ)
  define_flags()
  errors.run(main)
