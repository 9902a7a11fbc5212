"""POST /v1/chat/completions (serving/chat_api.py) and predict --chat on a tiny random
Qwen2 checkpoint (a Llama-shaped family) whose tokenizer carries Qwen2.5's chat template
(tests/chat_fixture.py), imported with `convert --from=hf`, exported and served: the openai
client's chat answers at temperature 0, streamed and not, are transformers' greedy
`generate` from `apply_chat_template`'s ids, up to the first end id, the template's end of
turn (<|im_end|>, which the model's config does not name: its eos is <|endoftext|>, as a
base model's) among them; n, seed, stop and usage; bad fields get 400s naming them; a model
without a chat template gets a 400 saying so; predict --chat answers as the server does."""

from __future__ import annotations

import http.client
import io
import json
import os
from types import SimpleNamespace

import pytest
from chat_fixture import base_tokenizer, write_chat_tokenizer

NAME, MAX_LEN, NEW = "tiny-chat", 128, 12
SYSTEM = [{"role": "system", "content": "Speak as Juliet."},
          {"role": "user", "content": "What light through yonder window breaks?"}]
CONVERSATIONS = [
    SYSTEM,
    [{"role": "user", "content": "Good morrow, cousin."},
     {"role": "assistant", "content": "Is the day so young?"},
     {"role": "user", "content": "But new struck nine."}],
    [{"role": "user", "content": [{"type": "text", "text": "Speak,"},
                                  {"type": "text", "text": "Romeo."}]}]]


def _write_model(directory: str):
  """The tokenizer (eos <|endoftext|>) and a random Qwen2ForCausalLM whose <|im_end|> row of
  lm_head is made to win a few tokens into its greedy answer to SYSTEM."""
  import torch
  import transformers
  write_chat_tokenizer(directory, "qwen2.5", base_tokenizer(1000), eos_token="<|endoftext|>")
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  end, turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
  config = transformers.Qwen2Config(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=72, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
      rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=end,
      eos_token_id=end)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    head = model.lm_head.weight
    fourth = _greedy(model, tokenizer, SYSTEM, NEW)[3]
    for scale in (1.02, 1.05, 1.1, 1.2, 1.5):   # the first that ends the answer, not at once
      head[turn] = scale * head[fourth]
      drawn = _greedy(model, tokenizer, SYSTEM, NEW)
      if turn in drawn[1:]:
        break
  assert turn in drawn[1:], drawn
  model.save_pretrained(directory)
  return model, tokenizer, (end, turn)


def _greedy(model, tokenizer, messages: list[dict], count: int) -> list[int]:
  """transformers' greedy continuation ids of the conversation, as its users call it."""
  import torch
  inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         return_tensors="pt")
  with torch.no_grad():
    out = model.generate(**inputs, do_sample=False, max_new_tokens=count,
                         pad_token_id=tokenizer.eos_token_id)
  return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
  """The checkpoint, transformers' model and tokenizer of it, its import and the served
  export on a server (4 slots, at most 4 choices a request)."""
  pytest.importorskip("transformers")
  from benchmarks.serve_process import start_server
  from transformer_jax import convert
  from transformer_jax.export import export_stablehlo
  root = tmp_path_factory.mktemp("chat")
  source, workdir = str(root / "hf"), str(root / "w")
  os.makedirs(source)
  model, tokenizer, ends = _write_model(source)
  convert.run(from_="hf", input=source, workdir=workdir)
  artifact = export_stablehlo(workdir, None, str(root / "artifact"), None, None)
  running = start_server(artifact, max_batch=4, max_wait_ms=5, extra_args=[
      f"--model_name={NAME}", "--slots=4", "--max_inputs=4"])
  yield SimpleNamespace(model=model, tokenizer=tokenizer, ends=ends, workdir=workdir,
                        server=running)
  running.stop()


def _client(chat):
  openai = pytest.importorskip("openai")
  return openai.OpenAI(base_url=chat.server.url + "/v1", api_key="unused", max_retries=0)


def _expected(chat, messages: list[dict]) -> tuple[str, str, int]:
  """transformers' greedy answer's text up to its first end id, its finish reason, and the
  prompt's token count. (Qwen2.5's template takes content as a string: a list of parts is
  sent as their texts joined by newlines, as vLLM sends them.)"""
  messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
               else "\n".join(p["text"] for p in m["content"])} for m in messages]
  drawn = _greedy(chat.model, chat.tokenizer, messages, NEW)
  cut = next((i for i, t in enumerate(drawn) if t in chat.ends), None)
  text = chat.tokenizer.decode(drawn[:cut], skip_special_tokens=True)
  prompt = chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=False)
  return text, "length" if cut is None else "stop", len(prompt)


def _streamed(stream) -> tuple[dict[int, str], dict[int, str], object, list]:
  """A chat stream's content and finish reason per choice, its usage, and its chunks."""
  texts: dict[int, str] = {}
  reasons: dict[int, str] = {}
  usage, chunks = None, []
  for chunk in stream:
    chunks.append(chunk)
    usage = chunk.usage or usage
    for choice in chunk.choices:
      if choice.delta.role:
        assert choice.index not in texts and choice.delta.role == "assistant"
        texts[choice.index] = ""
      texts[choice.index] += choice.delta.content or ""
      if choice.finish_reason:
        assert not choice.delta.content and choice.index not in reasons
        reasons[choice.index] = choice.finish_reason
  return texts, reasons, usage, chunks


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_answers_are_transformers_greedy_answers(chat, conversation):
  client, messages = _client(chat), CONVERSATIONS[conversation]
  text, reason, prompt = _expected(chat, messages)
  if conversation == 0:    # it ends at <|im_end|>: the template's end of turn, not the eos
    assert reason == "stop" and text
  whole = client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                         max_tokens=NEW)
  assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
  [choice] = whole.choices
  assert (choice.message.role, choice.message.content, choice.finish_reason) == (
      "assistant", text, reason)
  assert whole.usage.prompt_tokens == prompt
  texts, reasons, usage, chunks = _streamed(client.chat.completions.create(
      model=NAME, messages=messages, temperature=0, max_completion_tokens=NEW, stream=True,
      stream_options={"include_usage": True}))
  assert texts == {0: text} and reasons == {0: reason} and usage == whole.usage
  assert {c.object for c in chunks} == {"chat.completion.chunk"}
  assert {c.id for c in chunks} == {chunks[0].id} and chunks[-1].choices == []


def test_n_seed_and_stop(chat):
  client = _client(chat)
  request = dict(model=NAME, messages=CONVERSATIONS[1], temperature=1.0, max_tokens=NEW,
                 n=3, seed=7)
  whole = client.chat.completions.create(**request)
  texts = [c.message.content for c in whole.choices]
  assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) > 1
  assert [c.message.content for c in client.chat.completions.create(**request).choices] == texts
  streamed, _, usage, _ = _streamed(client.chat.completions.create(
      **request, stream=True, stream_options={"include_usage": True}))
  assert streamed == dict(enumerate(texts)) and usage == whole.usage
  greedy, _, _ = _expected(chat, SYSTEM)
  stop = greedy[2:4]
  cut = client.chat.completions.create(model=NAME, messages=SYSTEM, temperature=0,
                                       max_tokens=NEW, stop=[stop, "never"])
  assert cut.choices[0].message.content == greedy[:greedy.index(stop)]
  assert cut.choices[0].finish_reason == "stop"


def _post(chat, body: dict | bytes, path: str = "/v1/chat/completions",
          method: str = "POST") -> tuple[int, dict]:
  connection = http.client.HTTPConnection(chat.server.url.removeprefix("http://"), timeout=60)
  try:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request(method, path, data if method == "POST" else None)
    response = connection.getresponse()
    return response.status, json.loads(response.read())
  finally:
    connection.close()


USER = [{"role": "user", "content": "Hi"}]
BAD = [  # (fields over {"model", "messages"}, status, param)
    ({"messages": None}, 400, "messages"), ({"model": None}, 400, "model"),
    ({"model": "gpt-4o"}, 404, "model"), ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"tool_choice": "auto"}, 400, "tool_choice"), ({"logprobs": True}, 400, "logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"), ({"presence_penalty": 0.5}, 400,
                                                 "presence_penalty"),
    ({"logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
    ({"max_tokens": MAX_LEN}, 400, "max_tokens"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
    ({"temperature": 3}, 400, "temperature"), ({"n": 5}, 413, "n"),
    ({"stop": ["a"] * 5}, 400, "stop"), ({"stream_options": {"include_usage": True}}, 400,
                                         "stream_options"),
    ({"functions": []}, 400, "functions"), ({"seed": "x"}, 400, "seed"),
]


def test_bad_requests_get_400s_naming_the_field(chat):
  for fields, status, param in BAD:
    code, answer = _post(chat, {"model": NAME, "messages": USER, **fields})
    assert (code, answer["error"]["param"]) == (status, param), (fields, answer)
    assert answer["error"]["message"] and "\n" not in answer["error"]["message"]
  assert _post(chat, b"{not json")[0] == 400
  assert _post(chat, {}, method="GET")[0] == 405
  code, answer = _post(chat, {"model": NAME, "messages": USER, "logprobs": False,
                              "tools": [], "response_format": {"type": "text"}, "user": "u",
                              "max_tokens": 2})
  assert code == 200 and answer["choices"][0]["message"]["role"] == "assistant", answer
  code, models = _post(chat, {}, "/v1/models", "GET")
  assert code == 200 and models["data"][0]["chat_template"] is True


def test_a_model_without_a_template_answers_400():
  """The check comes before the body's: whatever the request, the model cannot chat."""
  from transformer_jax.data.tokenizer import CharVocab
  from transformer_jax.serving.chat_api import Chats
  from transformer_jax.serving.openai_api import OpenAIError
  served = SimpleNamespace(tokenizer=CharVocab(list("ab")), max_len=24,
                           manifest={"task": "lm"})
  chats = Chats(served, object(), NAME, "v1", 4)   # type: ignore[arg-type]
  with pytest.raises(OpenAIError) as error:
    chats.start(json.dumps({"model": NAME, "messages": USER}).encode())
  assert error.value.status == 400 and error.value.code == "no_chat_template"
  assert "chat_template" in str(error.value) and "/v1/completions" in str(error.value)


def test_predict_chat_answers_as_the_server_does(chat):
  from transformer_jax import predict
  from transformer_jax.errors import UserError
  message = SYSTEM[1]["content"]
  out = io.StringIO()
  predict.predict(chat.workdir, io.BytesIO(f"{message}\nBut new struck nine.\n".encode()),
                  out, None, None, 8, chat=True, max_new_tokens=NEW, temperature=0.0)
  client = _client(chat)
  answers = [client.chat.completions.create(
      model=NAME, messages=[{"role": "user", "content": m}], temperature=0,
      max_tokens=NEW).choices[0].message.content
      for m in (message, "But new struck nine.")]
  from transformer_jax.serving.line_policy import escape_line
  assert out.getvalue() == "".join(escape_line(a) + "\n" for a in answers)
  predictor = predict.Predictor(chat.workdir)
  del predictor.task.tokenizer.config["chat_template"]
  with pytest.raises(UserError, match=r"no chat template.*chat_template\.jinja"):
    predictor.chat_template()
