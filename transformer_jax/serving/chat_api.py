"""OpenAI's chat completions as a served language model speaks them, for a model whose
tokenizer has a chat template (data/chat_template.py); the HTTP route is in server.py, the
decoding in streaming.py, the fields' checks shared with openai_api.py.

  POST /v1/chat/completions  {"model", "messages": [{"role": "system" | "user" |
                              "assistant", "content": str | [{"type": "text", "text"}]}],
                              "max_tokens" or "max_completion_tokens" (the context's room),
                              "temperature" (1), "top_p" (1), "top_k" (0: no cut; vLLM's
                              extra field), "seed", "stop", "n" (1), "stream" (false),
                              "stream_options": {"include_usage"}}

The prompt is the conversation rendered by the model's template with the assistant's turn
begun (add_generation_prompt), encoded without any special token the template does not
write: the ids of transformers' `apply_chat_template(messages, add_generation_prompt=True)`.
A choice ends at the model's end ids and at the template's end of turn (Llama 3's
<|eot_id|>, ChatML's <|im_end|>), which the answer's content leaves out. A conversation that
does not fit the model's context with max_tokens is refused (a conversation's start is not
cut away, as a completion's prompt is).

The answer: {"id": "chatcmpl-...", "object": "chat.completion", "created", "model",
"system_fingerprint", "choices": [{"index", "message": {"role": "assistant", "content"},
"logprobs": null, "finish_reason"}], "usage"}; streamed, "chat.completion.chunk"s: each
choice's {"role": "assistant", "content": ""} delta, its content deltas, a chunk with its
finish_reason and an empty delta, the usage chunk if asked for, then [DONE]. OpenAI's fields
for what this server does not have (tools, tool_choice, response_format other than text,
logprobs, top_logprobs, penalties, logit_bias) are accepted at their "off" values only.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any, Callable, Iterator

from transformer_jax.data.chat_template import ChatTemplate, chat_template, end_of_turn
from transformer_jax.serving import device
from transformer_jax.serving.lines import Served
from transformer_jax.serving.openai_api import MAX_STOPS, CompletionRequest, Started
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
from transformer_jax.serving.streaming import Event, Sampling, StreamBatcher

# OpenAI's fields for features not served, each with the values that ask for none of it.
_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"})}
_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "n", "stream", "stream_options", "user", *_OFF}


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
  # `True == 1` and `0 == False` in Python: a value must also be of an off value's type.
  return any(value == off and type(value) is type(off) for off in offs)


def parse_chat_request(body: bytes) -> tuple[dict[str, Any], int | None]:
  """The checked request (messages still unchecked: the template checks them) and its
  max_tokens (None: not given), or OpenAIError (400) naming the field at fault."""
  try:
    request = json.loads(body) if body else None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise OpenAIError(400, f"body is not JSON: {e}") from None
  if not isinstance(request, dict):
    raise OpenAIError(400, 'expected a JSON object {"model", "messages", ...}, got '
                      f"{'an empty body' if not body else kind(request)}")
  for name in request:
    if name not in _KNOWN:
      raise bad(name, "not a field this server's chat completions take (see "
                       "docs/serving.md)", "unknown_parameter")
  for name, offs in _OFF.items():
    if name in request and not _is_off(request[name], offs):
      raise bad(name, f"{json.dumps(request[name])}: not supported by this server (leave it "
                       "out)", "unsupported_parameter")
  if not isinstance(request.get("model"), str):
    raise bad("model", "required: the served model's name (GET /v1/models), got "
               f"{kind(request.get('model'))}", "missing_required_parameter"
               if request.get("model") is None else "invalid_type")
  if "messages" not in request:
    raise bad("messages", 'required: a list of {"role", "content"} objects',
               "missing_required_parameter")
  given = {name: integer(request, name, 0, 1) for name in ("max_tokens",
                                                           "max_completion_tokens")
           if request.get(name) is not None}
  if len(set(given.values())) > 1:
    raise bad("max_completion_tokens", f"{given['max_completion_tokens']} differs from "
               f"max_tokens={given['max_tokens']}: give one of them")
  user = request.get("user")
  if user is not None and not isinstance(user, str):
    raise bad("user", f"expected a string, got {kind(user)}", "invalid_type")
  return request, next(iter(given.values()), None)


class Chats:
  """The chat completions of one served model (`name`; `version`: its system_fingerprint),
  queued on `streams` (None: the model does not stream), at most `max_choices` (n) each."""

  def __init__(self, served: Served, streams: StreamBatcher | None, name: str, version: str,
               max_choices: int):
    self.served, self.streams, self.name, self.version = served, streams, name, version
    self.max_choices = max_choices
    self.template: ChatTemplate | None = None
    self.problem = ("the model has no chat template (its tokenizer_config.json has no "
                    "\"chat_template\", nor chat_template.jinja beside it, at import); POST "
                    "/v1/completions with a prompt instead")
    self.end_ids: tuple[int, ...] = ()
    try:
      self.template = chat_template(getattr(served.tokenizer, "config", {}))
    except ValueError as e:
      self.problem = f"the model's chat template is not usable: {e}"
    if self.template is not None:
      end = end_of_turn(self.template, served.tokenizer.encode)
      self.end_ids = () if end is None else (end,)

  def start(self, body: bytes) -> Started:
    """The request, queued for decoding; OpenAIError for one this model cannot answer."""
    if self.streams is None:     # what the model cannot do, before what the request asks
      raise OpenAIError(404, f"{self.name!r} is a {self.served.manifest['task']} model "
                        "without streaming programs: POST /v1/predict", "model",
                        "model_not_found")
    if self.template is None:
      raise OpenAIError(400, f"chat completions are not served: {self.problem}", None,
                        "no_chat_template")
    request, max_tokens = parse_chat_request(body)
    if request["model"] != self.name:
      raise OpenAIError(404, f"model {request['model']!r} is not served here; GET /v1/models "
                        f"lists {self.name!r}", "model", "model_not_found")
    try:
      prompt = self.served.tokenizer.encode(self.template.render(request["messages"]))
    except ValueError as e:
      raise OpenAIError(400, str(e) if str(e).startswith("messages") else f"messages: {e}",
                        "messages", "invalid_value") from None
    max_tokens = self._room(len(prompt), max_tokens)
    n = integer(request, "n", 1, 1, 128)
    if n > self.max_choices:
      raise OpenAIError(413, f"n={n}; at most {self.max_choices} choices per request "
                        "(--max_inputs)", "n", "too_many_choices")
    stop = strings(request, "stop", required=False)
    if len(stop) > MAX_STOPS or any(not s for s in stop):
      raise bad("stop", f"at most {MAX_STOPS} non-empty strings")
    stream = boolean("stream", request.get("stream"))
    options = request.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
      raise bad("stream_options", 'only with "stream": true, as {"include_usage": bool}')
    seed = request.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
      raise bad("seed", f"expected an integer, got {kind(seed)}", "invalid_type")
    checked = CompletionRequest(
        model=self.name, prompts=[prompt], max_tokens=max_tokens,
        temperature=number(request, "temperature", 1.0, 0.0, 2.0),
        top_p=number(request, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(integer(request, "top_k", 0, -1), 0), seed=seed, stop=tuple(stop), n=n,
        stream=stream, include_usage=boolean("stream_options",
                                              (options or {}).get("include_usage")))
    drawn_with = secrets.randbits(32) if seed is None else seed % (1 << 32)
    completion = self.streams.submit([prompt], n, Sampling(
        max_tokens, checked.temperature, checked.top_k, checked.top_p, drawn_with,
        checked.stop, end_ids=self.end_ids))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": self.name, "system_fingerprint": self.version}
    return Started(checked, completion, head, [""])

  def _room(self, prompt: int, max_tokens: int | None) -> int:
    """max_tokens, or the context's room after the prompt where not given; a 400 where the
    conversation and max_tokens do not fit."""
    context = self.served.max_len
    if max_tokens is not None and max_tokens >= context:
      raise bad("max_tokens", f"{max_tokens} is out of range: the model's context is "
                 f"{context} tokens, the conversation's among them")
    if not prompt:
      raise bad("messages", "the model's chat template writes nothing for them")
    if prompt + (max_tokens or 1) > context:
      asked = "" if max_tokens is None else f" and max_tokens={max_tokens}"
      raise OpenAIError(400, f"messages: the conversation is {prompt} tokens{asked}; the "
                        f"model's context is {context} tokens: send a shorter conversation"
                        + (" or ask for fewer tokens" if max_tokens else ""), "messages",
                        "context_length_exceeded")
    return context - prompt if max_tokens is None else max_tokens

  def answer(self, started: Started) -> tuple[int, dict]:
    """The whole answer, once every choice has ended: 200, or 500 if the model failed."""
    completion = started.completion
    completion.wait()
    if completion.error is not None:
      return 500, error_body(500, device.model_failed(completion.error))
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text.sent},
                "logprobs": None, "finish_reason": c.finish_reason}
               for c in completion.choices]
    return 200, {**started.head, "object": "chat.completion", "choices": choices,
                 "usage": usage_of(completion)}

  def events(self, started: Started) -> Iterator[bytes]:
    """The answer as server-sent events (see the module doc), the ones already drawn
    together; an error event if the model failed."""
    completion, head = started.completion, started.head

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
      return sse({**head, "object": "chat.completion.chunk", "choices": choices,
                     "usage": usage})
    yield b"".join(chunk([_delta(c.index, {"role": "assistant", "content": ""})])
                   for c in completion.choices)
    for events in completion.events():
      data = b"".join(_chunks(events, chunk))
      if data:   # (an empty write would end the chunked HTTP body)
        yield data
    if completion.error is not None:
      yield sse(error_body(500, device.model_failed(completion.error)))
      return
    usage = chunk([], usage_of(completion)) if started.request.include_usage else b""
    yield usage + b"data: [DONE]\n\n"


def _delta(index: int, delta: dict[str, str], finish_reason: str | None = None
           ) -> dict[str, Any]:
  return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _chunks(events: list[Event], chunk: Callable[[list[dict[str, Any]]], bytes]
            ) -> Iterator[bytes]:
  """A chunk per event's text (none for a token whose text is held back), and one with the
  finish reason where a choice ended."""
  for event in events:
    if event.text:
      yield chunk([_delta(event.choice, {"content": event.text})])
    if event.finish_reason is not None:
      yield chunk([_delta(event.choice, {}, event.finish_reason)])

