"""The OpenAI completions API as a served language model speaks it (the HTTP routes are in
server.py, the decoding in streaming.py): a request body checked into a `CompletionRequest`,
and the JSON of answers, stream chunks, model cards and errors.

  POST /v1/completions  {"model", "prompt": str | [str, ...], "max_tokens" (16),
                         "temperature" (1), "top_p" (1), "top_k" (0: no cut; vLLM's extra
                         field), "seed", "stop": str | [str, ...] (up to 4), "n" (1),
                         "stream" (false), "stream_options": {"include_usage"}}
  GET  /v1/models, /v1/models/{model}

`Completions` answers them for one served model, without the HTTP (server.py writes what it
returns). Fields OpenAI defines for features this server does not have are accepted at their
"off" values only (logprobs null, echo false, best_of null or n, suffix null, penalties 0,
logit_bias empty; `user` is ignored); another value is a 400 naming the field, and so is a
field OpenAI does not define. Errors have OpenAI's shape,
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Iterator

from transformer_jax.inputs import InputError
from transformer_jax.serving import device
from transformer_jax.serving.line_policy import escape_line
from transformer_jax.serving.lines import Served
from transformer_jax.serving.streaming import Completion, Sampling, StreamBatcher

MAX_STOPS = 4              # OpenAI's limit on stop strings
DEFAULT_MAX_TOKENS = 16    # OpenAI's default max_tokens
# OpenAI's fields for features this server does not have: accepted only asking for none.
_UNSUPPORTED = ("logprobs", "echo", "suffix", "presence_penalty", "frequency_penalty",
                "logit_bias")
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "n", "stream", "stream_options", "best_of", "user", *_UNSUPPORTED}


class OpenAIError(Exception):
  """Answered with `status` and OpenAI's error shape; `param` names the field at fault."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code

  def body(self) -> dict[str, Any]:
    return error_body(self.status, str(self), self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
  kind = "server_error" if status >= 500 else "invalid_request_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A checked POST /v1/completions body."""
  model: str
  prompts: list[str]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int               # 0: no cut
  seed: int | None
  stop: tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool      # stream_options.include_usage: a last chunk with the usage


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
  return OpenAIError(400, f"{param}: {message}", param, code)


def _kind(value: Any) -> str:
  return "null" if value is None else type(value).__name__


def _integer(body: dict, name: str, default: int, low: int, high: int | None = None,
             why: str = "") -> int:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool):
    raise _bad(name, f"expected an integer, got {_kind(value)}", "invalid_type")
  if value < low or (high is not None and value > high):
    limits = f"from {low} to {high}" if high is not None else f">= {low}"
    raise _bad(name, f"{value} is out of range: must be {limits}{why}")
  return value


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise _bad(name, f"expected a number, got {_kind(value)}", "invalid_type")
  if not (low < value if low_open else low <= value) or value > high:
    raise _bad(name, f"{value} is out of range: must be in {'(' if low_open else '['}{low}, "
                     f"{high}]")
  return float(value)


def _strings(body: dict, name: str, required: bool) -> list[str]:
  """A string or a non-empty list of strings, as a list."""
  value = body.get(name)
  if value is None:
    if required:
      raise _bad(name, "required: a string or a list of strings", "missing_required_parameter")
    return []
  values = [value] if isinstance(value, str) else value
  if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
    return values
  if not isinstance(values, list):
    got = _kind(value)
  elif not values:
    got = "an empty list"
  elif not any(isinstance(v, str) for v in values):
    got = "token ids (not supported: send the text)"
  else:
    got = "a list holding " + next(_kind(v) for v in values if not isinstance(v, str))
  raise _bad(name, f"expected a string or a non-empty list of strings, got {got}",
             "invalid_type")


def _boolean(name: str, value: Any) -> bool:
  if value is None:
    return False
  if not isinstance(value, bool):
    raise _bad(name, f"expected true or false, got {_kind(value)}", "invalid_type")
  return value


def _asks_for_nothing(name: str, value: Any) -> bool:
  """Whether an `_UNSUPPORTED` field's value leaves its feature off."""
  if value is None:
    return True
  if name == "echo":
    return value is False
  if name == "logit_bias":
    return value == {}
  if name.endswith("_penalty"):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
  return False                       # logprobs, suffix: null only


def parse_completion_request(body: bytes, max_len: int) -> CompletionRequest:
  """The checked request, or OpenAIError (400) naming the field at fault. `max_len`: the
  model's context in tokens, which max_tokens must leave a prompt's first token room in."""
  if not body:
    raise OpenAIError(400, 'empty body; send a JSON object {"model", "prompt", ...}')
  try:
    request = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise OpenAIError(400, f"body is not JSON: {e}") from None
  if not isinstance(request, dict):
    raise OpenAIError(400, f"expected a JSON object, got {_kind(request)}")
  for name in request:
    if name not in _KNOWN:
      raise _bad(name, "not a field of the completions API (see docs/serving.md for the "
                       "fields this server takes)", "unknown_parameter")
  for name in _UNSUPPORTED:
    if not _asks_for_nothing(name, request.get(name)):
      raise _bad(name, f"{json.dumps(request[name])}: not supported by this server (leave it "
                       "out)", "unsupported_parameter")
  model = request.get("model")
  if not isinstance(model, str):
    raise _bad("model", f"required: the served model's name (GET /v1/models), got "
                        f"{_kind(model)}", "invalid_type" if model is not None
               else "missing_required_parameter")
  n = _integer(request, "n", 1, 1, 128)
  best_of = _integer(request, "best_of", n, 1, 128)
  if best_of != n:
    raise _bad("best_of", f"{best_of}: only best_of = n ({n}) is supported (no candidates "
                          "are ranked)", "unsupported_parameter")
  user = request.get("user")
  if user is not None and not isinstance(user, str):
    raise _bad("user", f"expected a string, got {_kind(user)}", "invalid_type")
  stop = _strings(request, "stop", required=False)
  if len(stop) > MAX_STOPS or any(not s for s in stop):
    raise _bad("stop", f"at most {MAX_STOPS} non-empty strings")
  max_tokens = _integer(request, "max_tokens", min(DEFAULT_MAX_TOKENS, max_len - 1), 1,
                        max_len - 1, f" (the model's context is {max_len} tokens, a prompt's "
                        "first among them)")
  stream = _boolean("stream", request.get("stream"))
  options = request.get("stream_options")
  if options is not None and (not stream or not isinstance(options, dict)
                              or set(options) - {"include_usage"}):
    raise _bad("stream_options", 'only with "stream": true, as {"include_usage": bool}')
  include_usage = _boolean("stream_options", (options or {}).get("include_usage"))
  top_k = _integer(request, "top_k", 0, -1)     # vLLM's -1 and 0: no cut
  seed = request.get("seed")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise _bad("seed", f"expected an integer, got {_kind(seed)}", "invalid_type")
  return CompletionRequest(
      model=model, prompts=_strings(request, "prompt", required=True), max_tokens=max_tokens,
      temperature=_number(request, "temperature", 1.0, 0.0, 2.0),
      top_p=_number(request, "top_p", 1.0, 0.0, 1.0, low_open=True),
      top_k=max(top_k, 0), seed=seed, stop=tuple(stop), n=n, stream=stream,
      include_usage=include_usage)


# ---------------------------------------------------------------------------- answers
def _usage(completion: Completion) -> dict[str, int]:
  prompt, drawn = completion.prompt_tokens, completion.completion_tokens
  return {"prompt_tokens": prompt, "completion_tokens": drawn, "total_tokens": prompt + drawn}


def _choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
  return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _completion(head: dict[str, Any], choices: list[dict[str, Any]],
                usage: dict[str, int] | None) -> dict[str, Any]:
  """An answer or a stream chunk: `head` holds id, created, model, system_fingerprint."""
  return {**head, "object": "text_completion", "choices": choices, "usage": usage}


def _model_card(name: str, created: int, max_len: int) -> dict[str, Any]:
  """What GET /v1/models lists of the served model (max_model_len as vLLM names it)."""
  return {"id": name, "object": "model", "created": created, "owned_by": "transformer_jax",
          "max_model_len": max_len}


# ---------------------------------------------------------------------------- endpoint
def _event(payload: dict[str, Any]) -> bytes:
  """A server-sent event of `payload`."""
  return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Completions:
  """The completions and models of one served model (`name`; `version`: its
  system_fingerprint): requests checked and queued on `streams` (None: the model does not
  stream, a task other than a language model's), at most `max_choices` (prompts x n) each."""

  def __init__(self, served: Served, streams: StreamBatcher | None, name: str, version: str,
               max_choices: int):
    self.served, self.streams, self.name, self.version = served, streams, name, version
    self.max_choices, self.created = max_choices, int(time.time())

  def models(self) -> dict[str, Any]:
    return {"object": "list", "data": [self.model(self.name)]}

  def model(self, asked: str) -> dict[str, Any]:
    if asked != self.name:
      raise OpenAIError(404, f"no model {asked!r}: this server serves {self.name!r}", "model",
                        "model_not_found")
    return _model_card(self.name, self.created, self.served.max_len)

  def start(self, body: bytes) -> tuple[CompletionRequest, Completion, dict[str, Any]]:
    """The request, its choices queued for decoding, and the head of its answer (id,
    created, model, system_fingerprint); OpenAIError for one this model cannot answer."""
    request = parse_completion_request(body, self.served.max_len)
    if request.model != self.name:
      raise OpenAIError(404, f"model {request.model!r} is not served here; GET /v1/models "
                        f"lists {self.name!r}", "model", "model_not_found")
    if self.streams is None:
      raise OpenAIError(404, f"{self.name!r} is a {self.served.manifest['task']} model "
                        "without streaming programs: POST /v1/predict (a language model "
                        "exported before completions were served: export it again)",
                        "model", "model_not_found")
    choices = len(request.prompts) * request.n
    if choices > self.max_choices:
      raise OpenAIError(413, f"{len(request.prompts)} prompts x n={request.n} = {choices} "
                        f"choices; at most {self.max_choices} per request (--max_inputs)",
                        "prompt", "too_many_choices")
    try:    # `escape_line`: the prompt as a line whose escapes read back to its text
      encoded = self.served.encode([escape_line(p) for p in request.prompts])
    except InputError as e:
      raise OpenAIError(400, f"prompt: {e}", "prompt", "invalid_value") from None
    seed = secrets.randbits(32) if request.seed is None else request.seed % (1 << 32)
    completion = self.streams.submit([line.ids for line in encoded], request.n, Sampling(
        request.max_tokens, request.temperature, request.top_k, request.top_p, seed,
        request.stop))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": self.name, "system_fingerprint": self.version}
    return request, completion, head

  def answer(self, completion: Completion, head: dict[str, Any]) -> tuple[int, dict]:
    """The whole answer, once every choice has ended: 200, or 500 if the model failed."""
    completion.wait()
    if completion.error is not None:
      return 500, error_body(500, device.model_failed(completion.error))
    choices = [_choice(c.index, c.text.sent, c.finish_reason) for c in completion.choices]
    return 200, _completion(head, choices, _usage(completion))

  def events(self, completion: Completion, head: dict[str, Any],
             include_usage: bool) -> Iterator[bytes]:
    """The answer as server-sent events, the ones already drawn together: a chunk per
    drawn token, then the usage if asked for and [DONE]; an error event if the model
    failed."""
    for events in completion.events():
      yield b"".join(_event(_completion(head, [_choice(*event)], None)) for event in events)
    if completion.error is not None:
      yield _event(error_body(500, device.model_failed(completion.error)))
      return
    usage = _event(_completion(head, [], _usage(completion))) if include_usage else b""
    yield usage + b"data: [DONE]\n\n"
