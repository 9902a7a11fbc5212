"""A model's chat template: a conversation rendered as the text the model was tuned on, as
transformers' `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)` renders it, with jinja2 alone (transformers is an optional extra).

The template is tokenizer_config.json's "chat_template" (a string, or a list of {"name",
"template"} whose "default" is taken), or the text of chat_template.jinja beside it, where
transformers 5 saves it (convert/llama.py's `read_tokenizer` puts that in the config). It
renders in transformers' environment: jinja2's immutable sandbox with trim_blocks and
lstrip_blocks, the loop controls ({% break %}, {% continue %}), `{% generation %}` blocks
(which mark the assistant's text for training; here they render their body), a `tojson` that
does not escape HTML, and the globals `raise_exception(message)` and `strftime_now(format)`;
its variables are `messages`, `add_generation_prompt`, `tools` and `documents` (none), and
the tokenizer's named special tokens (bos_token, eos_token, unk_token, ...) as strings.

Messages are {"role": "system" | "user" | "assistant", "content": str or a list of {"type":
"text", "text": str} parts}. A template that writes content as a string (most: `content |
trim`) gets the parts' texts joined by newlines, as vLLM gives them; one that walks the parts
(Gemma 3's) gets them as they are.

`end_of_turn` finds the token the template ends an assistant's turn with (Llama 3's
<|eot_id|>, ChatML's <|im_end|>, Gemma's <end_of_turn>, Zephyr's </s>): a chat completion
stops there, whether or not the model's config names it an end token.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Callable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

# The special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
ROLES = ("system", "user", "assistant")
_PROBE = "Probe-7f3a"   # a content no template changes, to see what a template writes around it
Message = dict[str, Any]


class TemplateRaised(jinja2.TemplateError):
  """What the template's raise_exception(message) raises."""


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders its body (transformers also notes
  where, to mask the assistant's tokens in training)."""
  tags = {"generation"}

  def parse(self, parser: Any) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller: Callable[[], str]) -> str:
    return caller()


def _raise_exception(message: str) -> None:
  raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
  # jinja2's own escapes <, >, & and ' for HTML; a prompt wants them as they are.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
  """The named special tokens a tokenizer_config.json sets, as strings (an AddedToken's
  serialised form is a dict with its "content")."""
  found = {}
  for name in SPECIAL_TOKENS:
    value = config.get(name)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      found[name] = value
  return found


class ChatTemplate:
  """A compiled chat template (`source`) with the special tokens of its tokenizer_config
  (`config`); ValueError naming the line where it does not compile."""

  def __init__(self, source: str, config: dict[str, Any] | None = None):
    self.source = source
    self.special_tokens = _special_tokens(config or {})
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template does not compile: {e.message} (its line "
                       f"{e.lineno})") from None
    self.takes_parts = self._takes_parts()

  def _takes_parts(self) -> bool:
    """Whether the template walks a list of content parts (rather than printing the list)."""
    try:
      text = self._render([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}],
                          True)
    except ValueError:
      return False
    return _PROBE in text and "'type'" not in text and '"type"' not in text

  def render(self, messages: Any, add_generation_prompt: bool = True) -> str:
    """The conversation as the model reads it; ValueError naming the message and field at
    fault, or with the template's own message where it refuses the conversation (Gemma's
    alternation of user and assistant)."""
    return self._render(self._checked(messages), add_generation_prompt)

  def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
    try:
      return self._template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
    except TemplateRaised as e:
      raise ValueError(f"the model's chat template refuses these messages: {e}") from None
    except Exception as e:  # noqa: BLE001  (a model's template is foreign code: any failure)
      raise ValueError(f"the model's chat template fails on these messages "
                       f"({type(e).__name__}: {e})") from None

  def _checked(self, messages: Any) -> list[Message]:
    """The messages, checked, as the template takes them (parts joined where it takes a
    string)."""
    if not isinstance(messages, list) or not messages:
      raise ValueError('messages: expected a non-empty list of {"role", "content"} objects')
    return [self._message(m, i) for i, m in enumerate(messages)]

  def _message(self, message: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
      raise ValueError(f'{where}: expected an object {{"role", "content"}}, got '
                       f"{type(message).__name__}")
    for key in message:
      if key not in ("role", "content", "name"):
        raise ValueError(f"{where}.{key}: not supported (a message has role, content and "
                         "name; tools are not served)")
    role = message.get("role")
    if role not in ROLES:
      raise ValueError(f"{where}.role: {json.dumps(role)}; expected one of {', '.join(ROLES)}")
    if not isinstance(message.get("name", ""), str):
      raise ValueError(f"{where}.name: expected a string")
    content = message.get("content")
    if isinstance(content, str):
      return dict(message)
    if not isinstance(content, list) or not content:
      raise ValueError(f"{where}.content: expected a string or a non-empty list of "
                       '{"type": "text", "text": ...} parts')
    texts = [_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    parts = [{"type": "text", "text": text} for text in texts]
    return {**message, "content": parts if self.takes_parts else "\n".join(texts)}


def _part_text(part: Any, where: str) -> str:
  if not isinstance(part, dict) or part.get("type") != "text":
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f'{where}: {json.dumps(kind)}: only {{"type": "text", "text": ...}} '
                     "parts are served")
  if set(part) != {"type", "text"} or not isinstance(part["text"], str):
    raise ValueError(f'{where}: expected {{"type": "text", "text": a string}}')
  return part["text"]


def chat_template(config: dict[str, Any]) -> ChatTemplate | None:
  """The chat template of a tokenizer_config.json dict (None: it has none); ValueError where
  it is not usable."""
  source = config.get("chat_template")
  if isinstance(source, list):   # named templates: the default one (tool_use is not served)
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"tokenizer_config.json's chat_template names {sorted(map(str, named))}"
                       " and no \"default\" template")
    source = named["default"]
  if source is None:
    return None
  if not isinstance(source, str):
    raise ValueError(f"tokenizer_config.json's chat_template is a {type(source).__name__}; "
                     "expected the template's text")
  return ChatTemplate(source, config)


def end_of_turn(template: ChatTemplate, encode: Callable[[str], Sequence[int]]) -> int | None:
  """The id (`encode`'s) of the token the template writes right after an assistant's content,
  where that is one token (Llama 3's <|eot_id|>, ChatML's <|im_end|>); None where the
  template writes none (or something longer)."""
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
  try:
    text = template.render(messages, add_generation_prompt=False)
  except ValueError:
    return None
  at = text.rfind(_PROBE)
  after = text[at + len(_PROBE):] if at >= 0 else ""
  marker = after.split()[0] if after.strip() and not after[0].isspace() else ""
  ids = list(encode(marker)) if marker else []
  return int(ids[0]) if len(ids) == 1 else None
