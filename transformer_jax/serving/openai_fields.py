"""What OpenAI's APIs as this server speaks them share (the completions: openai_api.py; the
chat completions: chat_api.py): the error shape, {"error": {"message", "type", "param",
"code"}}, the checks of a request's fields, each failing with a 400 naming the field, and the
usage and server-sent events of answers."""

from __future__ import annotations

import json
from typing import Any

from transformer_jax.serving.streaming import Completion


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


def bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
  return OpenAIError(400, f"{param}: {message}", param, code)


def kind(value: Any) -> str:
  return "null" if value is None else type(value).__name__


def integer(body: dict, name: str, default: int, low: int, high: int | None = None,
             why: str = "") -> int:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool):
    raise bad(name, f"expected an integer, got {kind(value)}", "invalid_type")
  if value < low or (high is not None and value > high):
    limits = f"from {low} to {high}" if high is not None else f">= {low}"
    raise bad(name, f"{value} is out of range: must be {limits}{why}")
  return value


def number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise bad(name, f"expected a number, got {kind(value)}", "invalid_type")
  if not (low < value if low_open else low <= value) or value > high:
    raise bad(name, f"{value} is out of range: must be in {'(' if low_open else '['}{low}, "
                     f"{high}]")
  return float(value)


def strings(body: dict, name: str, required: bool) -> list[str]:
  """A string or a non-empty list of strings, as a list."""
  value = body.get(name)
  if value is None:
    if required:
      raise bad(name, "required: a string or a list of strings", "missing_required_parameter")
    return []
  values = [value] if isinstance(value, str) else value
  if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
    return values
  if not isinstance(values, list):
    got = kind(value)
  elif not values:
    got = "an empty list"
  elif not any(isinstance(v, str) for v in values):
    got = "token ids (not supported: send the text)"
  else:
    got = "a list holding " + next(kind(v) for v in values if not isinstance(v, str))
  raise bad(name, f"expected a string or a non-empty list of strings, got {got}",
             "invalid_type")


def boolean(name: str, value: Any) -> bool:
  if value is None:
    return False
  if not isinstance(value, bool):
    raise bad(name, f"expected true or false, got {kind(value)}", "invalid_type")
  return value


def usage_of(completion: Completion) -> dict[str, int]:
  prompt, drawn = completion.prompt_tokens, completion.completion_tokens
  return {"prompt_tokens": prompt, "completion_tokens": drawn, "total_tokens": prompt + drawn}


def sse(payload: dict[str, Any]) -> bytes:
  """A server-sent event of `payload`."""
  return b"data: " + json.dumps(payload).encode() + b"\n\n"
