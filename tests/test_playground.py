"""The server's playground page (GET /, serving/playground.html) in a real browser, Chromium
driven by Playwright, against serve.py with a tiny character-level language model: a
completion streamed into the page is the API's text for the same request; Stop aborts a
long generation midway, leaving a strict prefix of its text, and the server answers on;
an API error's message shows in the page; chat mode keeps the conversation and sends it
back (the chat API faked in the browser, as this model has no chat template).

The browser: Playwright's own Chromium (`python -m playwright install chromium`), else a
system Chromium on PATH; without either the browser tests skip, saying so.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
from test_lm import MODERN, lm_config
from test_streaming import CHARS

NAME = "tiny-lm"
MAX_LEN = 512             # room for a generation long enough to stop midway
LONG = MAX_LEN - 1        # its max_tokens
SYSTEM_CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")
SLOW_MS = 120_000         # a generation's deadline: shapes compile on first use


def _write_artifact(directory: str) -> str:
  """A random character LM whose greedy text is varied and never ends: weights scaled up
  (sharper, context-dependent logits) and PAD/EOS/UNK's tied embedding rows zeroed (their
  logit 0, under the best character's)."""
  import jax
  import jax.numpy as jnp

  from transformer_jax.data.tokenizer import CharVocab
  from transformer_jax.options import DecodeOptions
  from transformer_jax.serving import write_artifact
  from transformer_jax.tasks.lm import LanguageModelTask
  cfg = lm_config(**MODERN, vocab_size=4 + len(CHARS), max_len=MAX_LEN)
  task = LanguageModelTask(cfg, tokenizer=CharVocab(list(CHARS)))
  params = task.model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
  params = jax.tree.map(lambda p: p * 3.0, params)
  table = params["embedding"]["embedding"]
  params["embedding"]["embedding"] = table.replace_boxed(table.unbox().at[jnp.array([0, 2, 3])]
                                                         .set(0.0))
  write_artifact(task, params, DecodeOptions(max_new_tokens=8, temperature=0.0), directory,
                 lines=task.line_policy(None))
  return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  from benchmarks.serve_process import start_server
  artifact = _write_artifact(str(tmp_path_factory.mktemp("lm") / "artifact"))
  running = start_server(artifact, max_batch=4, max_wait_ms=5,
                         extra_args=[f"--model_name={NAME}", "--slots=2"])
  yield running
  running.stop()


@pytest.fixture(scope="module")
def browser():
  """Playwright's Chromium, else the first system one that launches; skips without."""
  sync_api = pytest.importorskip("playwright.sync_api",
                                 reason="pip install -r requirements-serving.txt (playwright)")
  with sync_api.sync_playwright() as playwright:
    tried = [None] + [path for name in SYSTEM_CHROMIUMS if (path := shutil.which(name))]
    for path in tried:
      try:
        launched = playwright.chromium.launch(executable_path=path)
      except sync_api.Error:
        continue
      yield launched
      launched.close()
      return
    pytest.skip("no Chromium to drive: run `python -m playwright install chromium` or "
                "install a system one (apt-get install chromium)")


@pytest.fixture
def page(browser, server):
  context = browser.new_context(base_url=server.url)
  opened = context.new_page()
  opened.set_default_timeout(SLOW_MS)
  yield opened
  context.close()


def _call(server, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
  connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
  try:
    connection.request(method, path, None if body is None else json.dumps(body).encode(),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()
  finally:
    connection.close()


def _api_text(server, prompt: str, max_tokens: int) -> str:
  """The unstreamed API's greedy text: what the page must show."""
  status, body = _call(server, "POST", "/v1/completions", dict(
      model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0))
  assert status == 200, body
  return json.loads(body)["choices"][0]["text"]


def _metric(server, name: str) -> float:
  body = _call(server, "GET", "/metrics")[1].decode()
  found = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
  assert found, name
  return float(found[1])


def _open(page, max_tokens: int, prompt: str) -> None:
  """The page in completion mode, greedy, with `max_tokens` and `prompt` filled in."""
  from playwright.sync_api import expect
  page.goto("/")
  expect(page.locator("#model")).to_contain_text(NAME)
  page.get_by_label("Completion").check()
  page.get_by_label("Temperature").fill("0")
  page.get_by_label("Max tokens").fill(str(max_tokens))
  page.get_by_label("Prompt").fill(prompt)


def test_the_page_is_served_whole_and_offline(server):
  """GET / and /index.html: the package's page as UTF-8 HTML, fetching nothing from
  elsewhere; POST / is a 405 and an unknown path's 404 names the page."""
  from transformer_jax.serving.server import PLAYGROUND
  for path in ("/", "/index.html"):
    connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    connection.request("GET", path)
    response = connection.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/html; charset=utf-8"
    assert response.read() == PLAYGROUND
  assert not re.search(rb"(src|href)=[\"']?(https?:)?//|@import|url\(", PLAYGROUND)
  assert _call(server, "POST", "/", {})[0] == 405
  status, body = _call(server, "GET", "/nowhere")
  assert status == 404 and "GET / (the playground)" in json.loads(body)["error"]


def test_a_streamed_completion_is_the_apis_text(page, server):
  """Greedy, 40 tokens: the text shown is the API's, a chunk per character, and the timing
  line gives numbers."""
  from playwright.sync_api import expect
  expected = _api_text(server, "the king", 40)
  assert len(expected) == 40
  _open(page, 40, "the king")
  page.get_by_role("button", name="Send").click()
  expect(page.locator("#status")).to_contain_text("Done (finish reason: length)")
  assert page.locator("#output").text_content() == expected
  timing = page.locator("#timing").text_content() or ""
  found = re.fullmatch(r"Time to first token: (\d+) ms · (\d+) tokens in ([\d.]+) s · "
                       r"([\d.]+) tokens/s", timing)
  assert found, timing
  assert int(found[2]) == 40 and float(found[3]) > 0 and float(found[4]) > 0


def test_stop_aborts_a_generation_midway(page, server):
  """Stop once text shows: the page says so, its text is a strict prefix of the whole
  greedy text, the server stops decoding it (the client went away) and answers on."""
  from playwright.sync_api import expect
  whole = _api_text(server, "", LONG)            # also compiles the long shapes first
  drawn = _metric(server, "transformer_jax_completion_tokens_total")
  _open(page, LONG, "")
  page.get_by_role("button", name="Send").click()
  page.wait_for_function("document.getElementById('output').textContent.length > 0")
  page.get_by_role("button", name="Stop").click()
  expect(page.locator("#status")).to_have_text("Stopped.")
  shown = page.locator("#output").text_content() or ""
  assert 0 < len(shown) < len(whole) and whole.startswith(shown), (len(shown), len(whole))
  expect(page.get_by_role("button", name="Send")).to_be_enabled()
  assert _call(server, "GET", "/healthz")[0] == 200
  for _ in range(300):                  # until its row is freed (at most 30 s)
    if _metric(server, "transformer_jax_slots_busy") == 0:
      break
    page.wait_for_timeout(100)
  assert _metric(server, "transformer_jax_completion_tokens_total") - drawn < LONG
  assert _api_text(server, "", 5) == whole[:5]


def test_an_api_error_shows_its_message(page, server):
  """max_tokens past the context (the page's own limit lifted): the API's 400 message."""
  from playwright.sync_api import expect
  _open(page, MAX_LEN + 5, "the king")
  page.locator("#max-tokens").evaluate("input => input.removeAttribute('max')")
  page.get_by_role("button", name="Send").click()
  expect(page.get_by_role("alert")).to_contain_text("max_tokens")
  expect(page.locator("#status")).to_have_text("Failed.")


def _sse(*chunks: dict) -> str:
  return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def test_chat_mode_keeps_the_conversation(page, server):
  """A model card with a chat template offers chat: each reply's deltas join into an
  assistant turn, and the next request sends the whole conversation."""
  from playwright.sync_api import expect
  card = {"object": "list", "data": [{"id": NAME, "object": "model", "max_model_len": MAX_LEN,
                                      "chat_template": True}]}
  page.route("/v1/models", lambda route: route.fulfill(json=card))
  sent: list[dict] = []

  def delta(d: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

  def chat(route):
    sent.append(json.loads(route.request.post_data or "{}"))
    route.fulfill(content_type="text/event-stream", body=_sse(
        delta({"role": "assistant", "content": ""}), delta({"content": "Hel"}),
        delta({"content": "lo"}), delta({}, "stop")))

  page.route("/v1/chat/completions", chat)
  page.goto("/")
  expect(page.get_by_label("Chat")).to_be_checked()
  for message in ("hi", "again"):
    page.get_by_label("Message").fill(message)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("Done (finish reason: stop)")
  turns = page.locator("#conversation .turn")
  assert turns.all_text_contents() == ["hi", "Hello", "again", "Hello"]
  assert sent[1]["messages"] == [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "Hello"},
                                 {"role": "user", "content": "again"}]
  assert sent[1]["stream"] is True and sent[1]["model"] == NAME
