"""Chat templates (transformer_jax/data/chat_template.py) render a conversation as
transformers' apply_chat_template does, for published models' templates (tests/chat_fixture.py:
Llama 3.2's with strftime_now, Qwen2.5's default system message, Gemma 3's folding of the
system message and raise_exception, Mistral v0.3's namespace(), loop controls and
{% generation %}): the same text, and through our import's tokenizer the same token ids;
a template's refusal is a ValueError with its message; each template's end-of-turn token is
found; messages are checked, naming the one at fault."""

from __future__ import annotations

import copy

import pytest
from chat_fixture import CHATS, base_tokenizer, write_chat_tokenizer

from transformer_jax.data.chat_template import ChatTemplate, chat_template, end_of_turn

SYSTEM = "You answer in verse. Be brief & kind <3"
CONVERSATIONS = {
    "system": [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "What light through yonder window breaks?"}],
    "turns": [{"role": "user", "content": "Good morrow, cousin."},
              {"role": "assistant", "content": "  Is the day so young?\n"},
              {"role": "user", "content": "But new struck nine. 🙂"}],
    "parts": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
              {"role": "user", "content": [{"type": "text", "text": "Speak, "},
                                           {"type": "text", "text": "Romeo."}]},
              {"role": "assistant", "content": "Ay me!"},
              {"role": "user", "content": [{"type": "text", "text": "Wherefore art thou?"}]}],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
  """Per chat of the fixture: transformers' AutoTokenizer, our import's tokenizer and its
  template, from one save_pretrained directory."""
  transformers = pytest.importorskip("transformers")
  from transformer_jax.convert.llama import read_tokenizer
  base = base_tokenizer()
  loaded = {}
  for name in CHATS:
    directory = str(tmp_path_factory.mktemp(name))
    write_chat_tokenizer(directory, name, base)
    ours = read_tokenizer(directory)
    loaded[name] = (transformers.AutoTokenizer.from_pretrained(directory), ours,
                    chat_template(ours.config))
  return loaded


def _as_strings(messages: list[dict]) -> list[dict]:
  """The messages with each list of parts as its texts joined by newlines."""
  return [{**m, "content": m["content"] if isinstance(m["content"], str)
           else "\n".join(p["text"] for p in m["content"])} for m in messages]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", CHATS)
def test_rendering_and_ids_are_apply_chat_template_s(tokenizers, name, conversation):
  hf, ours, template = tokenizers[name]
  messages = CONVERSATIONS[conversation]
  if name == "gemma3" and conversation == "parts":
    assert template.takes_parts    # Gemma 3 walks the parts itself
  theirs = messages if template.takes_parts else _as_strings(messages)
  kept = copy.deepcopy(messages)
  text = template.render(messages)
  assert messages == kept
  assert text == hf.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
  ids = ours.to_theirs(ours.encode(text)).tolist()
  assert ids == hf.apply_chat_template(theirs, add_generation_prompt=True, return_dict=False)
  assert template.render(messages, add_generation_prompt=False) == hf.apply_chat_template(
      theirs, add_generation_prompt=False, tokenize=False)


def test_the_templates_show_what_they_do(tokenizers):
  """What each template is here for, seen in its text."""
  def render(name: str, conversation: str) -> str:
    return tokenizers[name][2].render(CONVERSATIONS[conversation])
  import datetime
  assert datetime.datetime.now().strftime("%d %b %Y") in render("llama3", "turns")
  assert "You are Qwen, created by Alibaba Cloud" in render("qwen2.5", "turns")
  assert render("gemma3", "system").startswith(f"<bos><start_of_turn>user\n{SYSTEM}\n\nWhat")
  assert "<|user|>\nSpeak, \nRomeo.</s>" in render("zephyr", "parts")
  assert render("mistral", "system").endswith(f"[INST] {SYSTEM}\n\nWhat light through "
                                              "yonder window breaks?[/INST]")
  blank = [{"role": "user", "content": " "}, *CONVERSATIONS["turns"],
           {"role": "system", "content": "after"}, {"role": "user", "content": "unseen"}]
  text = tokenizers["training"][2].render(blank)
  assert text.startswith("<|im_start|>user\nGood morrow") and "unseen" not in text


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_a_template_s_refusal_is_a_value_error_with_its_message(tokenizers, name):
  import jinja2
  hf, _, template = tokenizers[name]
  twice = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
  with pytest.raises(jinja2.TemplateError) as theirs:
    hf.apply_chat_template(twice, add_generation_prompt=True, tokenize=False)
  with pytest.raises(ValueError, match="roles must alternate") as ours:
    template.render(twice)
  assert str(theirs.value) in str(ours.value) and "\n" not in str(ours.value)


@pytest.mark.parametrize("name", CHATS)
def test_the_end_of_turn_token_is_found(tokenizers, name):
  hf, ours, template = tokenizers[name]
  found = end_of_turn(template, ours.encode)
  assert found is not None
  assert ours.to_theirs([found]).tolist() == [hf.convert_tokens_to_ids(CHATS[name].end_of_turn)]


def test_a_template_that_ends_no_turn_has_no_end_of_turn():
  plain = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
  assert end_of_turn(plain, lambda text: [len(text)]) is None


def test_the_import_keeps_the_template(tokenizers, tmp_path):
  """save_pretrained writes the template to chat_template.jinja, not tokenizer_config.json;
  the import reads it into its config, which the tokenizer's own files keep."""
  import json
  import os

  from transformer_jax.data.hf_tokenizer import HFTokenizer
  _, ours, _ = tokenizers["llama3"]
  assert ours.config["chat_template"] == CHATS["llama3"].template
  path = str(tmp_path / "tokenizer.json")
  ours.save(path)
  assert HFTokenizer.load(path).config["chat_template"] == CHATS["llama3"].template
  ours.write_hf_files(str(tmp_path))
  with open(os.path.join(tmp_path, "tokenizer_config.json")) as f:
    assert json.load(f)["chat_template"] == CHATS["llama3"].template


def test_chat_template_of_a_config():
  assert chat_template({"eos_token": "</s>"}) is None
  named = chat_template({"chat_template": [{"name": "tool_use", "template": "T"},
                                           {"name": "default", "template": "{{ eos_token }}"}],
                         "eos_token": {"content": "</s>", "special": True}})
  assert named is not None and named.render([{"role": "user", "content": "x"}]) == "</s>"
  with pytest.raises(ValueError, match="no \"default\""):
    chat_template({"chat_template": [{"name": "tool_use", "template": "T"}]})
  with pytest.raises(ValueError, match="does not compile.*line 1"):
    chat_template({"chat_template": "{% for m in messages %}"})


@pytest.mark.parametrize("messages, match", [
    ([], r"^messages: expected a non-empty list"),
    ("hi", r"^messages: expected a non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], r"^messages\[1\]: expected an object"),
    ([{"role": "robot", "content": "a"}], r"^messages\[0\]\.role: \"robot\""),
    ([{"content": "a"}], r"^messages\[0\]\.role: null"),
    ([{"role": "user"}], r"^messages\[0\]\.content: expected a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     r"^messages\[0\]\.content\[0\]: \"image_url\": only"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}],
     r"^messages\[0\]\.content\[0\]: expected"),
    ([{"role": "assistant", "content": "a", "tool_calls": []}],
     r"^messages\[0\]\.tool_calls: not supported"),
])
def test_bad_messages_are_named(messages, match):
  template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
  with pytest.raises(ValueError, match=match) as error:
    template.render(messages)
  assert "\n" not in str(error.value)
