"""The OpenAI completions API as a served language model speaks it (the HTTP routes are in
server.py, the decoding in streaming.py): a request body checked into a `CompletionRequest`,
and the JSON of answers, stream chunks, model cards and errors.

  POST /v1/completions  {"model", "prompt": str | [str, ...] | token ids [int, ...] |
                         [[int, ...], ...], "max_tokens" (16; 0 with echo: scoring only),
                         "temperature" (1), "top_p" (1), "top_k" (0: no cut; vLLM's extra
                         field), "seed", "stop": str | [str, ...] (up to 4), "n" (1),
                         "echo" (false), "logprobs" (null, or 0-5), "stream" (false),
                         "stream_options": {"include_usage"}}
  GET  /v1/models, /v1/models/{model}

`Completions` answers them for one served model, without the HTTP (server.py writes what it
returns). Token ids are the tokenizer's own (a Hugging Face tokenizer's ids, as
lm-evaluation-harness sends them). `echo` puts the prompt before the completion; with
`logprobs`, the prompt's tokens' log-probabilities too (the first null), in OpenAI's legacy
shape (serving/logprobs.py): the model's log-softmax before temperature and any cut, as vLLM
reports it. Fields OpenAI defines for features this server does not have are accepted at
their "off" values only (best_of null or n, suffix null, penalties 0, logit_bias empty;
`user` is ignored); another value is a 400 naming the field, and so is a field OpenAI does
not define. Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Iterator, NamedTuple

from transformer_jax.inputs import InputError
from transformer_jax.serving import device
from transformer_jax.serving.line_policy import escape_line
from transformer_jax.serving.lines import Served
from transformer_jax.serving.logprobs import LogprobsFormat
from transformer_jax.serving.openai_fields import (
  OpenAIError,
  bad,
  boolean,
  error_body,
  integer,
  kind,
  number,
  sse,
  strings,
  usage_of,
)
from transformer_jax.serving.streaming import Completion, Event, Sampling, StreamBatcher

MAX_STOPS = 4              # OpenAI's limit on stop strings
DEFAULT_MAX_TOKENS = 16    # OpenAI's default max_tokens
MAX_LOGPROBS = 5           # OpenAI's limit on logprobs (sampling.TOP_LOGPROBS)
# OpenAI's fields for features this server does not have: accepted only asking for none.
_UNSUPPORTED = ("suffix", "presence_penalty", "frequency_penalty", "logit_bias")
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "n", "stream", "stream_options", "best_of", "user", "echo", "logprobs",
          *_UNSUPPORTED}
Prompt = str | list[int]   # a text, or the tokenizer's ids of one


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A checked POST /v1/completions body."""
  model: str
  prompts: list[Prompt]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int               # 0: no cut
  seed: int | None
  stop: tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool      # stream_options.include_usage: a last chunk with the usage
  echo: bool = False       # the prompt before the completion
  logprobs: int | None = None   # the likeliest tokens reported at each place (None: none)


def _is_id(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _prompts(body: dict) -> list[Prompt]:
  """"prompt": a string, token ids, or a non-empty list of either, as a list of prompts."""
  value = body.get("prompt")
  if isinstance(value, list) and value and all(_is_id(v) for v in value):
    return [value]
  if (isinstance(value, list) and value and all(isinstance(v, list) for v in value)
      and all(v and all(_is_id(i) for i in v) for v in value)):
    return value
  if isinstance(value, list) and any(isinstance(v, list) for v in value):
    raise bad("prompt", "token ids must be a non-empty list of integers, or a list of such "
                         "lists", "invalid_type")
  return list(strings(body, "prompt", required=True))


def _asks_for_nothing(name: str, value: Any) -> bool:
  """Whether an `_UNSUPPORTED` field's value leaves its feature off."""
  if value is None:
    return True
  if name == "logit_bias":
    return value == {}
  if name.endswith("_penalty"):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
  return False                       # suffix: null only


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
    raise OpenAIError(400, f"expected a JSON object, got {kind(request)}")
  for name in request:
    if name not in _KNOWN:
      raise bad(name, "not a field of the completions API (see docs/serving.md for the "
                       "fields this server takes)", "unknown_parameter")
  for name in _UNSUPPORTED:
    if not _asks_for_nothing(name, request.get(name)):
      raise bad(name, f"{json.dumps(request[name])}: not supported by this server (leave it "
                       "out)", "unsupported_parameter")
  model = request.get("model")
  if not isinstance(model, str):
    raise bad("model", f"required: the served model's name (GET /v1/models), got "
                        f"{kind(model)}", "invalid_type" if model is not None
               else "missing_required_parameter")
  n = integer(request, "n", 1, 1, 128)
  best_of = integer(request, "best_of", n, 1, 128)
  if best_of != n:
    raise bad("best_of", f"{best_of}: only best_of = n ({n}) is supported (no candidates "
                          "are ranked)", "unsupported_parameter")
  user = request.get("user")
  if user is not None and not isinstance(user, str):
    raise bad("user", f"expected a string, got {kind(user)}", "invalid_type")
  stop = strings(request, "stop", required=False)
  if len(stop) > MAX_STOPS or any(not s for s in stop):
    raise bad("stop", f"at most {MAX_STOPS} non-empty strings")
  echo = boolean("echo", request.get("echo"))
  logprobs = request.get("logprobs")
  if logprobs is not None:
    logprobs = integer(request, "logprobs", 0, 0, MAX_LOGPROBS)
  max_tokens = integer(request, "max_tokens", min(DEFAULT_MAX_TOKENS, max_len - 1),
                        0 if echo else 1, max_len - 1, f" (the model's context is {max_len} "
                        "tokens, a prompt's first among them; 0 only with echo)")
  stream = boolean("stream", request.get("stream"))
  options = request.get("stream_options")
  if options is not None and (not stream or not isinstance(options, dict)
                              or set(options) - {"include_usage"}):
    raise bad("stream_options", 'only with "stream": true, as {"include_usage": bool}')
  include_usage = boolean("stream_options", (options or {}).get("include_usage"))
  top_k = integer(request, "top_k", 0, -1)     # vLLM's -1 and 0: no cut
  seed = request.get("seed")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise bad("seed", f"expected an integer, got {kind(seed)}", "invalid_type")
  return CompletionRequest(
      model=model, prompts=_prompts(request), max_tokens=max_tokens,
      temperature=number(request, "temperature", 1.0, 0.0, 2.0),
      top_p=number(request, "top_p", 1.0, 0.0, 1.0, low_open=True),
      top_k=max(top_k, 0), seed=seed, stop=tuple(stop), n=n, stream=stream,
      include_usage=include_usage, echo=echo, logprobs=logprobs)


# ---------------------------------------------------------------------------- answers
def _choice(index: int, text: str, finish_reason: str | None,
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
  return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _completion(head: dict[str, Any], choices: list[dict[str, Any]],
                usage: dict[str, int] | None) -> dict[str, Any]:
  """An answer or a stream chunk: `head` holds id, created, model, system_fingerprint."""
  return {**head, "object": "text_completion", "choices": choices, "usage": usage}


def _model_card(name: str, created: int, max_len: int) -> dict[str, Any]:
  """What GET /v1/models lists of the served model (max_model_len as vLLM names it)."""
  return {"id": name, "object": "model", "created": created, "owned_by": "transformer_jax",
          "max_model_len": max_len}


# ---------------------------------------------------------------------------- endpoint
class Started(NamedTuple):
  """A request queued: its choices decoding, the head of its answer (id, created, model,
  system_fingerprint), and each prompt's text where it is echoed."""
  request: CompletionRequest
  completion: Completion
  head: dict[str, Any]
  echoes: list[str]


class Completions:
  """The completions and models of one served model (`name`; `version`: its
  system_fingerprint): requests checked and queued on `streams` (None: the model does not
  stream, a task other than a language model's), at most `max_choices` (prompts x n) each."""

  def __init__(self, served: Served, streams: StreamBatcher | None, name: str, version: str,
               max_choices: int):
    self.served, self.streams, self.name, self.version = served, streams, name, version
    self.max_choices, self.created = max_choices, int(time.time())
    self.logprobs = LogprobsFormat(served.tokenizer)

  def models(self) -> dict[str, Any]:
    return {"object": "list", "data": [self.model(self.name)]}

  def model(self, asked: str) -> dict[str, Any]:
    if asked != self.name:
      raise OpenAIError(404, f"no model {asked!r}: this server serves {self.name!r}", "model",
                        "model_not_found")
    return _model_card(self.name, self.created, self.served.max_len) | {   # chat served?
        "chat_template": bool(getattr(self.served.tokenizer, "config", {}).get("chat_template"))}

  def start(self, body: bytes) -> Started:
    """The request, queued for decoding; OpenAIError for one this model cannot answer."""
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
    prompts = [self._ids(p, i) for i, p in enumerate(request.prompts)]
    scored = request.echo and request.logprobs is not None
    for i, ids in enumerate(prompts):
      if scored and len(ids) + request.max_tokens > self.served.max_len:
        raise bad("prompt", f"prompt {i} is {len(ids)} tokens; with max_tokens="
                   f"{request.max_tokens} that is past the model's context of "
                   f"{self.served.max_len} tokens, and an echoed prompt's log-probabilities "
                   "are of the whole prompt: send a shorter one")
    seed = secrets.randbits(32) if request.seed is None else request.seed % (1 << 32)
    completion = self.streams.submit(prompts, request.n, Sampling(
        request.max_tokens, request.temperature, request.top_k, request.top_p, seed,
        request.stop, logprobs=request.logprobs, score_prompt=scored))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": self.name, "system_fingerprint": self.version}
    echoes = [(p if isinstance(p, str) else self.served.tokenizer.decode(ids))
              if request.echo else "" for p, ids in zip(request.prompts, prompts)]
    return Started(request, completion, head, echoes)

  def _ids(self, prompt: Prompt, index: int) -> list[int]:
    """A prompt's ids as the model reads them: a text encoded as predict encodes it; token
    ids (the tokenizer's own) checked and taken as they are."""
    if isinstance(prompt, str):
      try:    # `escape_line`: the prompt as a line whose escapes read back to its text
        return self.served.encode([escape_line(prompt)])[0].ids
      except InputError as e:
        raise OpenAIError(400, f"prompt: {e}", "prompt", "invalid_value") from None
    tokenizer = self.served.tokenizer
    to_ours = getattr(tokenizer, "to_ours", None)     # a Hugging Face tokenizer's ids
    size = tokenizer.size if to_ours else tokenizer.vocab_size
    low = 0 if to_ours else 1                         # our PAD is no token
    wrong = [i for i in prompt if not low <= i < size]
    if wrong:
      raise bad("prompt", f"prompt {index}: token id {wrong[0]} is outside the vocabulary "
                 f"(ids {low} to {size - 1})")
    return to_ours(prompt).tolist() if to_ours else list(prompt)

  def _choices(self, started: Started, events: list[Event],
               offsets: dict[int, int]) -> list[dict[str, Any]]:
    """The choices of a chunk (or of the answer: each choice's events in one), the echo
    before a choice's first text; `offsets`: where each choice's text is so far."""
    request, n = started.request, started.request.n
    choices = []
    for event in events:
      first = event.choice not in offsets
      text = (started.echoes[event.choice // n] if first else "") + event.text
      logprobs = None
      if request.logprobs is not None:
        logprobs, offsets[event.choice] = self.logprobs.block(
            event.logprobs, request.logprobs, offsets.get(event.choice, 0))
      offsets.setdefault(event.choice, 0)
      choices.append(_choice(event.choice, text, event.finish_reason, logprobs))
    return choices

  def answer(self, started: Started) -> tuple[int, dict]:
    """The whole answer, once every choice has ended: 200, or 500 if the model failed."""
    completion = started.completion
    completion.wait()
    if completion.error is not None:
      return 500, error_body(500, device.model_failed(completion.error))
    whole = [Event(c.index, c.text.sent, c.finish_reason, tuple(c.logprobs))
             for c in completion.choices]
    return 200, _completion(started.head, self._choices(started, whole, {}),
                            usage_of(completion))

  def events(self, started: Started) -> Iterator[bytes]:
    """The answer as server-sent events, the ones already drawn together: a chunk per
    drawn token, then the usage if asked for and [DONE]; an error event if the model
    failed."""
    completion, head = started.completion, started.head
    offsets: dict[int, int] = {}
    for events in completion.events():
      yield b"".join(sse(_completion(head, self._choices(started, [event], offsets), None))
                     for event in events)
    if completion.error is not None:
      yield sse(error_body(500, device.model_failed(completion.error)))
      return
    usage = (sse(_completion(head, [], usage_of(completion)))
             if started.request.include_usage else b"")
    yield usage + b"data: [DONE]\n\n"
