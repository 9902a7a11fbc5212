"""The server's OpenAI completions (POST /v1/completions, GET /v1/models; serving/server.py,
serving/openai_api.py) on 127.0.0.1 with a tiny exported language model, driven by the
`openai` client: a streamed completion is the unstreamed one, a chunk per token; concurrent
clients each get the text their request gets alone; bad requests, sent raw, get OpenAI's
error shape with the right status and field, and the server answers on; while it shuts
down it answers 503. The batcher itself: tests/test_streaming.py."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
from test_streaming import PROMPTS, write_lm_artifact

NAME, SLOTS, MAX_INPUTS = "tiny-lm", 4, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """serve.py with the tiny language model: 4 slots, at most 8 choices a request."""
  from benchmarks.serve_process import start_server
  artifact = write_lm_artifact(str(tmp_path_factory.mktemp("lm") / "artifact")).directory
  running = start_server(artifact, max_batch=4, max_wait_ms=5, extra_args=[
      f"--model_name={NAME}", f"--slots={SLOTS}", f"--max_inputs={MAX_INPUTS}",
      "--max_body_bytes=4096"])
  yield running
  running.stop()


def _client(server):
  openai = pytest.importorskip("openai")
  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _texts(stream) -> tuple[dict[int, str], dict[int, int], dict[int, str], object]:
  """A completion stream's text, chunks and finish reason per choice, and its usage."""
  texts: dict[int, str] = {}
  chunks: dict[int, int] = {}
  reasons: dict[int, str] = {}
  usage = None
  for chunk in stream:
    usage = chunk.usage or usage
    for choice in chunk.choices:
      texts[choice.index] = texts.get(choice.index, "") + choice.text
      chunks[choice.index] = chunks.get(choice.index, 0) + 1
      if choice.finish_reason:
        reasons[choice.index] = choice.finish_reason
  return texts, chunks, reasons, usage


def test_a_streamed_completion_is_the_unstreamed_one(server):
  """The openai client, streaming and not, same seed: the same text per choice (two
  prompts x n=2, top-k as vLLM's extra field, a stop string); one chunk per drawn token;
  the same usage; and /v1/predict still answers."""
  client = _client(server)
  request = dict(model=NAME, prompt=PROMPTS[:2], max_tokens=10, temperature=1.0, top_p=0.9,
                 seed=5, n=2, stop=["q"], extra_body={"top_k": 8})
  whole = client.completions.create(**request)
  texts, chunks, reasons, usage = _texts(client.completions.create(
      **request, stream=True, stream_options={"include_usage": True}))
  assert {c.index: c.text for c in whole.choices} == texts and len(texts) == 4
  assert {c.index: c.finish_reason for c in whole.choices} == reasons
  assert usage == whole.usage and sum(chunks.values()) == usage.completion_tokens
  assert usage.prompt_tokens == sum(len(p) + 1 for p in PROMPTS[:2])     # BOS + characters
  assert len(set(texts.values())) > 2 and not any("q" in text for text in texts.values())
  again = client.completions.create(**request)                        # same seed, same text
  assert [c.text for c in again.choices] == [c.text for c in whole.choices]
  assert [m.id for m in client.models.list().data] == [NAME]
  connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
  connection.request("POST", "/v1/predict", json.dumps({"inputs": PROMPTS}).encode())
  response = connection.getresponse()
  assert response.status == 200 and len(json.loads(response.read())["outputs"]) == len(PROMPTS)


def test_concurrent_clients_each_get_their_text_alone(server):
  """Twelve streaming clients at once, more choices than the server's 4 slots: each text is
  what its request gets alone."""
  client = _client(server)
  requests = [dict(model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4 + i,
                   temperature=0.0 if i % 3 == 0 else 1.0, seed=i, stream=True)
              for i in range(12)]
  alone = [_texts(client.completions.create(**r))[0] for r in requests]
  with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
    together = list(pool.map(lambda r: _texts(client.completions.create(**r))[0], requests))
  assert together == alone and len({t[0] for t in alone}) > 3


def _raw(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
  connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
  try:
    connection.request(method, path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())
  finally:
    connection.close()


def _completion(**fields) -> bytes:
  return json.dumps({"model": NAME, "prompt": "the", **fields}).encode()


# (body or (method, path, body), status, param): sent raw, one after another.
BAD = [
    (b"{not json", 400, None), (b"[]", 400, None), (b"", 400, None),
    (json.dumps({"prompt": "the"}).encode(), 400, "model"),
    (_completion(model="gpt-4"), 404, "model"),
    (json.dumps({"model": NAME}).encode(), 400, "prompt"),
    (_completion(prompt=7), 400, "prompt"), (_completion(prompt=[]), 400, "prompt"),
    (_completion(prompt=[[5, 6], []]), 400, "prompt"), (_completion(prompt=[5, 1.5]), 400,
                                                        "prompt"),
    (_completion(prompt=[5, 99999]), 400, "prompt"), (_completion(prompt=[0, 5]), 400,
                                                      "prompt"),        # PAD: no token
    (_completion(prompt="the Z"), 400, "prompt"),                # not in the vocabulary
    (_completion(max_tokens=0), 400, "max_tokens"), (_completion(max_tokens=24), 400,
                                                      "max_tokens"),
    (_completion(max_tokens="8"), 400, "max_tokens"), (_completion(temperature=-1), 400,
                                                        "temperature"),
    (_completion(temperature="hot"), 400, "temperature"), (_completion(top_p=0), 400, "top_p"),
    (_completion(top_k=-2), 400, "top_k"), (_completion(n=0), 400, "n"),
    (_completion(n=True), 400, "n"), (_completion(seed=1.5), 400, "seed"),
    (_completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"), (_completion(stop=""), 400,
                                                                 "stop"),
    (_completion(stream="yes"), 400, "stream"),
    (_completion(stream_options={"include_usage": True}), 400, "stream_options"),
    (_completion(logprobs=6), 400, "logprobs"), (_completion(logprobs=True), 400, "logprobs"),
    (_completion(echo="yes"), 400, "echo"),
    (_completion(prompt="the" * 30, echo=True, logprobs=0), 400, "prompt"),   # past context
    (_completion(best_of=3), 400, "best_of"), (_completion(max_token=8), 400, "max_token"),
    (_completion(prompt=["a"] * 3, n=3), 413, "prompt"),         # 9 choices > --max_inputs
    (_completion(prompt="a" * 5000), 413, None),                 # > --max_body_bytes
    (("POST", "/v1/chat/completions", b"{}"), 400, None),       # no chat template
    (("GET", "/v1/completions", None), 405, None),
    (("GET", "/v1/models/gpt-4", None), 404, "model"),
]


def test_bad_requests_get_openai_errors_and_the_server_answers_on(server):
  for case, status, param in BAD:
    method, path, body = case if isinstance(case, tuple) else ("POST", "/v1/completions", case)
    code, answer = _raw(server, method, path, body)
    error = answer.get("error")
    assert code == status, (case, code, answer)
    assert set(error) == {"message", "type", "param", "code"} and error["message"], answer
    assert error["param"] == param and error["type"] == "invalid_request_error", answer
    code, answer = _raw(server, "POST", "/v1/completions", _completion(max_tokens=2))
    assert code == 200 and answer["choices"][0]["finish_reason"], (case, answer)


def test_bad_requests_through_the_client_raise_its_errors(server):
  client = _client(server)
  import openai
  with pytest.raises(openai.NotFoundError) as missing:
    client.completions.create(model="gpt-4", prompt="the")
  assert missing.value.body["code"] == "model_not_found"
  with pytest.raises(openai.BadRequestError) as bad:
    client.completions.create(model=NAME, prompt="the", temperature=3)
  assert bad.value.body["param"] == "temperature"


def test_clients_that_leave_early_leave_no_traceback(server):
  """Clients that reset their connection right after sending: a streamed request, and a
  whole answer's (its write fails in `_answer`): the server logs no traceback and answers
  on."""
  import struct
  host, port = server.url.removeprefix("http://").split(":")
  for stream in (True, False, False):
    body = _completion(max_tokens=20, n=4, stream=stream)
    with socket.create_connection((host, int(port)), timeout=60) as leaving:
      leaving.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                      b"\r\n%s" % (len(body), body))
    time.sleep(0.5)                                    # its answer is written, or fails
  code, answer = _raw(server, "POST", "/v1/completions", _completion(max_tokens=2))
  assert code == 200 and answer["choices"][0]["finish_reason"]
  assert not [line for line in server.output.lines() if "Traceback" in line], "\n".join(server.output.lines())


def test_while_shutting_down_new_requests_get_503(server):
  """The last test of the module: a completion in flight (its body half sent) when SIGTERM
  comes is answered; a request on another connection already open gets 503 in OpenAI's
  shape; then the server exits 0."""
  host, port = server.url.removeprefix("http://").split(":")
  idle = http.client.HTTPConnection(host, int(port), timeout=60)
  idle.request("GET", "/v1/models")
  assert idle.getresponse().read()
  body = _completion(max_tokens=3)
  with socket.create_connection((host, int(port)), timeout=60) as slow:
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body[:10]))
    time.sleep(0.5)                       # its handler waits for the rest of the body
    server.process.terminate()
    time.sleep(0.5)                       # the server is draining
    idle.request("POST", "/v1/completions", _completion())
    response = idle.getresponse()
    answer = json.loads(response.read())
    assert response.status == 503 and answer["error"]["type"] == "server_error", answer
    slow.sendall(body[10:])
    status_line = slow.makefile("rb").readline()
    assert status_line.split()[1] == b"200", status_line
  assert server.process.wait(timeout=60) == 0
