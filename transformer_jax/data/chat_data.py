"""Chat conversations for supervised fine-tuning (the lm task's data.layout="chat"): JSONL
files in OpenAI's fine-tuning shape, one conversation a line,

  {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

rendered with the model's own chat template (chat_template.py, which the server's
/v1/chat/completions renders with too) and encoded by its tokenizer, with a weight per
token: 1 on each assistant message's tokens (its content and the end of turn that closes
it, as TRL's assistant-only loss and transformers' `return_assistant_tokens_mask` count
them), 0 on system and user turns and on the template's scaffolding (turn headers, the
"<|im_start|>assistant\\n" before a reply, the newline after its end). An assistant message
with "weight": 0 (OpenAI's field) weighs 0 too.

The ids trained are the tokenizer's encoding of the whole conversation rendered without a
generation prompt, as transformers' `apply_chat_template(messages, tokenize=True)` gives
them (no special token added: the template writes its own BOS). The tokens of assistant
message i are found by rendering twice more: the conversation before it with the
generation prompt ends where the message starts, and the conversation through it ends
(trailing whitespace aside) where its turn ends. Both renders must begin the whole one,
else the conversation is refused, naming its line (a template that rewrites earlier turns,
as Qwen3's drops their reasoning, or moves a message, as Mistral's puts the system message
in the last user turn). The tokens that overlap those characters (the tokenizer's offsets:
HFTokenizer.encode_with_offsets) weigh 1, up to the template's end-of-turn token where it
writes one (`chat_template.end_of_turn`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from transformer_jax.data import readers
from transformer_jax.data.chat_template import ROLES, chat_template, end_of_turn
from transformer_jax.data.readers import DataFormatError
from transformer_jax.errors import UserError

MESSAGE_FIELDS = ("role", "content", "name", "weight")
_SHAPE = '{"messages": [{"role": ..., "content": ...}, ...]}'


def read_chat_jsonl(path: str) -> list[dict]:
  """The file's conversations as records {"messages", "text" (the weighted assistant
  contents: what bits per character count), "where" ("path:line")}; DataFormatError naming
  the line and field of the first malformed one."""
  records = []
  for number, line in readers.read_lines(path):
    if line.strip():
      where = f"{path}:{number}"
      messages = checked_messages(_json(line, where), where)
      records.append({"messages": messages, "text": "\n".join(assistant_texts(messages)),
                      "where": where})
  if not records:
    raise readers.no_examples(path)
  return records


def _json(line: str, where: str) -> Any:
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    raise DataFormatError(f"{where}: not JSON ({e.msg} at column {e.colno}); each line is "
                          f"one conversation, {_SHAPE}") from None


def checked_messages(value: Any, where: str) -> list[dict]:
  """A line's messages, checked: roles, contents and weights (a content's parts are checked
  when the template renders them)."""
  if not isinstance(value, dict) or "messages" not in value:
    found = "no \"messages\" field" if isinstance(value, dict) else f"a {type(value).__name__}"
    raise DataFormatError(f"{where}: {found}; each line is one conversation, {_SHAPE}")
  messages = value["messages"]
  if not isinstance(messages, list) or not messages:
    raise DataFormatError(f"{where}: messages: expected a non-empty list of {{\"role\", "
                          "\"content\"} objects")
  for i, message in enumerate(messages):
    _check_message(message, f"{where}: messages[{i}]")
  if messages[0]["role"] == "assistant":
    raise DataFormatError(f"{where}: messages[0]: the conversation starts with the "
                          "assistant; start it with a system or user message")
  if not any(m["role"] == "assistant" for m in messages):
    raise DataFormatError(f"{where}: no assistant message, nothing to learn (the loss "
                          "counts the assistant's tokens only); add the reply")
  return messages


def _check_message(message: Any, where: str) -> None:
  if not isinstance(message, dict):
    raise DataFormatError(f"{where}: expected an object {{\"role\", \"content\"}}, got "
                          f"{type(message).__name__}")
  for key in message:
    if key not in MESSAGE_FIELDS:
      raise DataFormatError(f"{where}.{key}: not a message field ({', '.join(MESSAGE_FIELDS)};"
                            " tool calls are not supported)")
  if "role" not in message:
    raise DataFormatError(f"{where}: no \"role\"; give one of {', '.join(ROLES)}")
  if message["role"] not in ROLES:
    raise DataFormatError(f"{where}.role: {json.dumps(message['role'])}; expected one of "
                          f"{', '.join(ROLES)}")
  if not isinstance(message.get("content"), (str, list)):
    raise DataFormatError(f"{where}.content: expected a string (or a list of {{\"type\": "
                          "\"text\", \"text\"}} parts)")
  if "weight" in message and (message["role"] != "assistant"
                              or message["weight"] not in (0, 1)
                              or isinstance(message["weight"], bool)):
    raise DataFormatError(f"{where}.weight: {json.dumps(message['weight'])}; an assistant "
                          "message's weight is 0 (not trained) or 1")


def assistant_texts(messages: list[dict]) -> list[str]:
  """The contents of the assistant messages that are trained (weight 1), parts joined."""
  return [m["content"] if isinstance(m["content"], str)
          else "\n".join(str(p.get("text", "")) for p in m["content"] if isinstance(p, dict))
          for m in messages if m["role"] == "assistant" and m.get("weight", 1)]


class ChatEncoder:
  """A tokenizer's chat template, turning conversations into weighted ids (module doc).
  `tokenizer`: an HFTokenizer whose config holds a chat template."""

  def __init__(self, tokenizer: Any):
    config = getattr(tokenizer, "config", None)
    try:
      template = chat_template(config) if isinstance(config, dict) else None
    except ValueError as e:
      raise UserError(f"data.layout='chat': {e}") from None
    if template is None:
      raise UserError("data.layout='chat' renders conversations with the model's chat "
                      "template, and init_from's tokenizer has none (tokenizer_config.json's "
                      "chat_template): fine-tune an import of a chat (Instruct) model")
    self.template, self.tokenizer = template, tokenizer
    self.end_of_turn = end_of_turn(template, tokenizer.encode)

  def encode(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights), int32 each, of a record's conversation; DataFormatError naming its
    line where the template refuses it or its assistant tokens cannot be found."""
    try:
      return self.encode_messages(record["messages"])
    except ValueError as e:
      raise DataFormatError(f"{record['where']}: {e}") from None

  def encode_messages(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """`encode` of checked messages (ValueError where the template cannot serve them)."""
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    text = self.template.render(plain, add_generation_prompt=False)
    ids, offsets = self.tokenizer.encode_with_offsets(text)
    tokens = np.asarray(ids, np.int32)
    spans = np.asarray(offsets, np.int64).reshape(-1, 2)   # each token's characters
    weights = np.zeros(len(tokens), np.int32)
    for i, message in enumerate(messages):
      if message["role"] != "assistant" or not message.get("weight", 1):
        continue
      start, end = self._span(plain, i, text)
      inside = np.flatnonzero((spans[:, 0] < end) & (spans[:, 1] > start))
      if self.end_of_turn is not None:   # what follows the turn's end is scaffolding
        closing = inside[tokens[inside] == self.end_of_turn]
        inside = inside[inside <= closing[0]] if len(closing) else inside
      weights[inside] = 1
    return tokens, weights

  def _span(self, messages: list[dict], i: int, text: str) -> tuple[int, int]:
    """The characters of `text` (the whole conversation) that assistant message i's turn
    writes after the generation prompt: its content and what closes it."""
    before = self.template.render(messages[:i], add_generation_prompt=True)
    through = (text if i == len(messages) - 1   # the last message's: the whole render
               else self.template.render(messages[:i + 1], add_generation_prompt=False))
    through = through.rstrip()
    if not (len(before) <= len(through) and text.startswith(before)
            and text.startswith(through)):
      raise ValueError(f"messages[{i}]: the chat template writes the conversation up to this "
                       "assistant message otherwise than the whole conversation begins (it "
                       "rewrites earlier turns or moves a message), so its tokens cannot be "
                       "found; end the conversation at this message")
    return len(before), len(through)
