"""Long and messy input lines in predict and the served artifact (serving/line_policy.py):
a classifier truncates a line longer than the model as its training did, a tagger tags it in
overlapping windows stitched per word, translation refuses it naming the line, and
--too_long=refuse refuses it for every task; any bytes a file holds (a byte-order mark,
CRLF, text that is not UTF-8, NULs, tabs, markup, blank lines) are answered line for line,
by predict and the server alike. The models are the tiny trained runs of conftest.py."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import featurizing_task
from test_bad_inputs import run_main, write

from transformer_jax import predict, serve
from transformer_jax.data.tokenizer import WordVocab
from transformer_jax.errors import UserError
from transformer_jax.inputs import InputError, character_ids
from transformer_jax.options import DataOptions
from transformer_jax.serving.line_policy import (
  LinePolicy,
  LineReader,
  best_windows,
  clean_text,
  kept_tokens,
  kept_words,
  stitch,
  window_starts,
)
from transformer_jax.serving.lines import OUTPUTS

KINDS = ("seq2seq", "classification", "tagging")


# ------------------------------------------------------------------ without a model
def _context(token: int, start: int, length: int, total: int) -> int:
  """Tokens of context a window gives `token` on its poorer side (an edge at the line's
  own start or end cuts nothing)."""
  left = token - start if start > 0 else total
  right = start + length - 1 - token if start + length < total else total
  return min(left, right)


@pytest.mark.parametrize("length", [1, 2, 3, 8, 32])
def test_windows_cover_the_line_and_each_token_gets_its_most_central_one(length):
  for total in range(1, 4 * length + 3):
    starts = window_starts(total, length)
    assert starts[0] == 0 and starts == sorted(set(starts))
    if total <= length:
      assert starts == [0]
      continue
    assert all(0 <= s and s + length <= total for s in starts)   # full windows only
    assert starts[-1] + length == total
    best = best_windows(total, starts, length)
    for token in range(total):
      holding = [w for w, s in enumerate(starts) if s <= token < s + length]
      assert best[token] in holding
      contexts = [_context(token, starts[w], length, total) for w in holding]
      assert _context(token, starts[best[token]], length, total) == max(contexts)
      assert best[token] == holding[contexts.index(max(contexts))]   # the first on a tie


def test_stitching_takes_each_token_from_its_best_window_at_its_own_position():
  total, length = 45, 8
  starts = window_starts(total, length)
  # Row w holds, per token, (token index, window) as token * 100 + w, and a second column.
  rows = [np.stack([(s + np.arange(length)) * 100 + w, -np.ones(length)], -1)
          for w, s in enumerate(starts)]
  stitched = stitch(rows, starts, total, length)
  assert stitched.shape == (total, 2)
  assert (stitched[:, 0] // 100 == np.arange(total)).all()
  assert (stitched[:, 0] % 100 == best_windows(total, starts, length)).all()
  assert (stitch([rows[0][:5]], [0], 5, length) == rows[0][:5]).all()   # one window: itself


@pytest.mark.parametrize("keep", ["head", "tail", "head_tail"])
def test_truncation_keeps_the_tokens_it_names(keep):
  x = np.arange(100)
  kept = kept_tokens(x, 12, keep)
  words = kept_words(keep, 12).split()
  first = int(words[words.index("first") + 1]) if "first" in words else 0
  assert len(kept) == 12 and (kept[:first] == x[:first]).all()
  assert (kept[first:] == x[100 - (12 - first):]).all()
  assert (kept_tokens(x[:7], 12, keep) == x[:7]).all()      # a line that fits is kept whole


@pytest.mark.parametrize("text, clean", [
    ("\ufeffthe film\r", "the film"),                     # BOM, a CR left by a CRLF line
    ("a\tdull\t\tplot", "a dull  plot"),                   # tabs between words
    ("bad\x00 film\x1b[0m\x7f", "bad  film [0m"),         # NUL, ESC, DEL
    ("Changed. \x96 Ken\x85 ok", "Changed. \x96 Ken\x85 ok"),   # C1, as in IMDB
    ("one\u2028two\u2029three", "one two three"),          # Unicode line separators
    ("lone \ud800 surrogate", "lone \ufffd surrogate"),   # from JSON's "\ud800"
    ("zero\ufeffwidth", "zerowidth"),                      # a BOM inside a line
    ("   \t \r ", ""),
    ("a <br />review &amp; <i>more</i>", "a <br />review &amp; <i>more</i>"),   # markup: text
])
def test_messy_text_is_cleaned(text, clean):
  assert clean_text(text) == clean
  assert clean_text(clean) == clean


def test_breaks_become_spaces_only_where_training_made_them_so():
  line = "Great film.<br /><br />But the end <BR>drags."
  assert LinePolicy(br_tags="space").clean(line) == "Great film. But the end drags."
  assert LinePolicy().clean(line) == line
  assert LinePolicy(br_tags="space").clean("<br /> <br/>") == ""


@pytest.mark.parametrize("raw, lines, not_utf8", [
    (b"\xef\xbb\xbfone\r\ntwo\r\n", ["\ufeffone", "two"], []),
    (b"caf\xc3\xa9\ncaf\xe9 \x93quoted\x94\n\xff\x81\n", ["café", "café “quoted”", "ÿ\ufffd"],
     [2, 3]),
    (b"a\n\n\nb", ["a", "", "", "b"], []),                 # blank lines; no final LF
    (b"a\rb\n", ["a\rb"], []),                              # a lone CR does not end a line
    ("\ufeffeins\r\nzwei\n".encode("utf-16-le"), ["eins", "zwei"], []),   # Windows
    ("\ufeffeins\nzwei".encode("utf-16-be"), ["eins", "zwei"], []),         # "Unicode"
    (b"", [], []),
])
def test_any_bytes_are_read_line_for_line(raw, lines, not_utf8):
  reader = LineReader(io.BytesIO(raw))
  assert list(reader) == lines
  assert reader.not_utf8 == not_utf8
  assert (reader.warning() is None) == (not not_utf8)
  if not_utf8:
    assert f"line {not_utf8[0]}" in reader.warning()


def test_each_task_records_what_its_training_did():
  vocab = WordVocab(["good", "film"])
  data = DataOptions(source="local", truncate="head_tail", br_tags="space")
  policies = {kind: featurizing_task(kind, vocab).line_policy(data)
              for kind in ("classification", "tagging", "seq2seq")}
  assert policies["classification"] == LinePolicy("truncate", "head_tail", "space")
  assert policies["tagging"] == LinePolicy("window", "head_tail", "keep")
  assert policies["seq2seq"].too_long == "refuse"
  for policy in policies.values():
    assert LinePolicy.from_manifest(json.loads(json.dumps(policy.manifest()))) == policy
  assert LinePolicy.from_manifest(None) == LinePolicy()     # an older artifact: refuses
  with pytest.raises(UserError, match="--too_long=truncate: a seq2seq model refuses"):
    policies["seq2seq"].choose("truncate", "seq2seq")
  refusing = policies["tagging"].choose("refuse", "tagging")
  assert refusing.action(8, 8, "x") == "whole"
  with pytest.raises(InputError, match="line 3: 9 tokens exceed .*max_len=8.*windows"):
    refusing.action(9, 8, "line 3")
  assert policies["tagging"].choose(None, "tagging").action(9, 8, "x") == "window"
  assert policies["classification"].action(9, 8, "x") == "truncate"


# ---------------------------------------------------------------- with trained models
@pytest.fixture(scope="module")
def models(trained_runs) -> dict:
  """kind -> (Predictor, Served) of the tiny trained runs (max_len 32; translation 64)."""
  from transformer_jax.predict import Predictor
  from transformer_jax.serving import Served
  return {kind: (Predictor(trained_runs.workdir(kind)), Served.load(trained_runs.artifact(kind)))
          for kind in KINDS}


def _with(model, **policy):
  """A shallow copy of a Predictor or Served whose line policy has `policy` replaced."""
  other = copy.copy(model)
  other.policy = dataclasses.replace(model.policy, **policy)
  return other


def test_artifacts_carry_the_training_policy(models):
  for kind, (predictor, served) in models.items():
    assert served.policy == predictor.policy
    assert served.manifest["lines"]["too_long"] == {
        "seq2seq": "refuse", "classification": "truncate", "tagging": "window"}[kind]


def test_a_classifier_truncates_a_long_line_as_its_training_did(models):
  predictor, served = models["classification"]
  max_len = served.max_len
  words = ["good", "film"] * max_len + ["dull", "plot"] * max_len   # head and tail differ
  lines = [" ".join(words), " ".join(words[::-1]), "the film is good"]
  expected = {}
  for keep in ("head", "head_tail"):
    cut = [" ".join(kept_tokens(np.asarray(line.split()), max_len, keep)) for line in lines]
    expected[keep] = predictor.predict_lines(cut)
    assert _with(predictor, truncate=keep).predict_lines(lines) == expected[keep], keep
    assert _with(served, truncate=keep).predict(lines) == expected[keep], keep
    encoded = _with(served, truncate=keep).encode(lines[:1])[0]
    assert encoded.ids == served.tokenizer.encode(cut[0])
    assert (encoded.chars == character_ids(cut[0].split(), served.word_bytes)).all()
  assert expected["head"] != expected["head_tail"]   # the kept tokens decide: it matters
  with pytest.raises(InputError, match=r"input line 2: 128 tokens exceed .*max_len=32.*"
                                       r"--too_long=refuse .*the first 32 tokens"):
    _with(predictor, refuse=True).predict_lines(lines[2:] + lines[:1])
  with pytest.raises(InputError, match="input 1: 128 tokens exceed"):
    _with(served, refuse=True).predict(lines[2:] + lines[:1])


def _windowed_oracle(served, words: list[str]) -> str:
  """The tags of a long sentence from its windows run one by one, stitched by hand."""
  length = served.max_len
  starts = window_starts(len(words), length)
  rows = []
  for start in starts:
    window = words[start:start + length]
    tokens = np.asarray([served.tokenizer.encode(" ".join(window))], np.int32)
    chars = character_ids(window, served.word_bytes)[None] if served.word_bytes else None
    rows.append(served.run(tokens, chars)[0])
  scores = stitch(rows, starts, len(words), length)
  return OUTPUTS["tag_scores"](served, [scores], [len(words)])[0]


def test_a_tagger_tags_a_long_sentence_in_windows_each_word_once(models):
  predictor, served = models["tagging"]
  cycle = "Jones visited Oslo . Brown visited Paris Smith visited Rome . Jones".split()
  lengths = [4, 31, 32, 33, 47, 80]           # max_len 32: around it, and windows
  sentences = [" ".join(cycle[i % len(cycle)] for i in range(n)) for n in lengths]
  tags = predictor.predict_lines(sentences)
  assert served.predict(sentences) == tags
  assert [len(t.split()) for t in tags] == lengths             # one tag per word
  for sentence, sentence_tags in zip(sentences, tags):
    if len(sentence.split()) > served.max_len:
      assert sentence_tags == _windowed_oracle(served, sentence.split())
  # A sentence that fits: what the whole-sentence path (the task's predict) gives.
  fits = [s for s in sentences if len(s.split()) <= served.max_len]
  assert [t for s, t in zip(sentences, tags) if s in fits] == _whole(predictor, fits)
  with pytest.raises(InputError, match="input line 4: 33 tokens exceed .*windows"):
    _with(predictor, refuse=True).predict_lines(sentences)
  with pytest.raises(InputError, match="input 3: 33 tokens exceed"):
    _with(served, refuse=True).predict(sentences)


def _whole(predictor, lines: list[str]) -> list[str]:
  """The task's own predict on `lines` (that fit), batched as evaluation does."""
  from transformer_jax.data import pipeline
  task = predictor.task
  records = [{**task.record_from_line(line), "index": i} for i, line in enumerate(lines)]
  batches, _ = pipeline.eval_batches(records, task, batch_size=len(lines),
                                     max_length=task.model_config.max_len)
  outputs = [""] * len(lines)
  for batch in batches:
    for record, output in zip(batch.records, task.predict(predictor.params, batch.arrays,
                                                          predictor.decode)):
      outputs[record["index"]] = output
  return outputs


def test_translation_refuses_a_long_line_naming_it(models):
  predictor, served = models["seq2seq"]
  long = " ".join(["eins"] * (served.max_len + 1))
  for model in (predictor, _with(predictor, refuse=True)):
    with pytest.raises(InputError, match="input line 2: 65 tokens exceed .*max_len=64; "
                                         "shorten or split it$"):
      model.predict_lines(["zwei", long])
  with pytest.raises(InputError, match="input 1: 65 tokens"):
    served.predict(["zwei", long])


# Messy lines per task: the raw bytes of a file, and each line as clean text.
MESSY = {
    "seq2seq": [(b"\xef\xbb\xbfeins zwei\r\n", "eins zwei"), (b"drei\tvier\n", "drei vier"),
                (b"\r\n", ""), (b"f\xfcnf\x00 sechs\n", "fünf sechs"),
                (b"<b>sieben</b> acht<br />\n", "<b>sieben</b> acht<br />")],
    "classification": [
        (b"\xef\xbb\xbfthe film is good\r\n", "the film is good"), (b"  \t \n", ""),
        (b"a dull\tplot\r\n", "a dull plot"), (b"caf\xe9 plot is \x93good\x94\n",
                                               "café plot is “good”"),
        (b"the plot<br /><br />is dull\n", "the plot<br /><br />is dull"),
        (b"good film " * 40 + b"\n", "good film " * 40)],
    "tagging": [(b"\xef\xbb\xbfJones\tvisited\tOslo\t.\r\n", "Jones visited Oslo ."),
                (b"\n", ""), (b"Jos\xe9 visited <b>Rome</b> .\n", "José visited <b>Rome</b> ."),
                (b"Brown visited Paris . " * 12 + b"\r\n", "Brown visited Paris . " * 12)],
}
NOT_UTF8 = {"seq2seq": 4, "classification": 4, "tagging": 3}   # the first such line


@pytest.mark.parametrize("kind", KINDS)
def test_a_messy_file_is_answered_line_for_line(kind, models, capsys, monkeypatch):
  predictor, served = models[kind]
  raw = b"".join(line for line, _ in MESSY[kind])
  clean = [text for _, text in MESSY[kind]]
  out = io.StringIO()
  monkeypatch.setattr(predict, "Predictor", lambda *args: predictor)   # no second load
  count = predict.predict(None, io.BytesIO(raw), out, None, None, len(clean))
  outputs = out.getvalue().split("\n")[:-1]
  assert count == len(outputs) == len(MESSY[kind])
  assert outputs == predictor.predict_lines(clean)
  assert served.predict(list(LineReader(io.BytesIO(raw)))) == outputs   # the server's way
  for output, text in zip(outputs, clean):
    if not text.strip():
      assert output == ""            # a blank line: an empty output
    elif kind != "seq2seq":          # (a translation may be empty)
      assert output
    if kind == "tagging":
      assert len(output.split()) == len(text.split())
  warned = [line for line in capsys.readouterr().err.splitlines() if "not UTF-8" in line]
  assert len(warned) == 1 and f"line {NOT_UTF8[kind]}" in warned[0], warned


# ----------------------------------------------------------------- the command lines
@pytest.mark.parametrize("kind, argv, expect", [
    ("seq2seq", [], "input line 3: 65 tokens exceed the model's max_len=64; shorten or split"),
    ("seq2seq", ["--too_long=truncate"], "--too_long=truncate: a seq2seq model refuses"),
    ("classification", ["--too_long=refuse"], "input line 3: 65 tokens exceed"),
])
def test_predict_stops_with_one_error_line_naming_the_input_line(kind, argv, expect,
                                                                 trained_runs, tmp_path,
                                                                 capsys, monkeypatch):
  long = " ".join(["eins" if kind == "seq2seq" else "good"] * 65)
  infile = write(tmp_path / "in.txt", f"eins\n\n{long}\r\n")
  status, lines = run_main(predict, [f"--workdir={trained_runs.workdir(kind)}",
                                     f"--input={infile}", f"--output={tmp_path}/out.txt",
                                     *argv], capsys, monkeypatch)
  assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
  assert expect in lines[0], lines


def test_serve_refuses_to_truncate_for_translation(trained_runs, capsys, monkeypatch):
  status, lines = run_main(serve, [f"--model={trained_runs.artifact('seq2seq')}",
                                   "--too_long=truncate"], capsys, monkeypatch)
  assert status == 2 and len(lines) == 1 and "a seq2seq model refuses" in lines[0], lines


def _post(url: str, inputs: list) -> tuple[int, dict]:
  request = urllib.request.Request(url + "/v1/predict", method="POST",
                                   data=json.dumps({"inputs": inputs}).encode())
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_the_server_answers_long_and_messy_lines_as_predict_does(models):
  from transformer_jax.serving.batching import Batcher
  from transformer_jax.serving.server import InFlight, Limits, Server, make_handler
  predictor, served = models["tagging"]
  long = " ".join(["Jones visited Oslo ."] * 20)
  inputs = [long, "\ufeffBrown\tvisited\r\nRome .", "", " \u2028 ", "lone \ud800 ."]
  servers = []
  for model in (served, _with(served, refuse=True)):
    handler = make_handler(model, Batcher(model, 4, 0.001), Limits(),
                           {"name": "t", "version": "1"}, InFlight())
    server = Server(("127.0.0.1", 0), handler, 16)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append((server, f"http://127.0.0.1:{server.server_address[1]}"))
  try:
    status, answer = _post(servers[0][1], inputs)
    assert status == 200 and answer["outputs"] == predictor.predict_lines(inputs)
    assert len(answer["outputs"][0].split()) == 80 and answer["outputs"][2:4] == ["", ""]
    status, answer = _post(servers[1][1], inputs)
    assert status == 400 and answer["error"].startswith("input 0: 80 tokens exceed")
    assert _post(servers[1][1], inputs[1:])[0] == 200          # and it stays up
  finally:
    for server, _ in servers:
      server.shutdown()
      server.server_close()
