"""Served models (transformer_jax/serving/, serve.py): the StableHLO artifact of each task
kind gives predict's outputs (the same translations token for token, the same labels and
tags), serves any batch and length from one export, and loads in a fresh process where Flax
cannot be imported. The HTTP server: tests/test_serve.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import pytest
from cli_helpers import ROOT

from transformer_jax.inputs import InputError

KINDS = ("seq2seq", "classification", "tagging")
# Inputs per task kind: varied lengths, an empty line, words outside the training data.
LINES = {
    "seq2seq": ["eins zwei", "", "neun acht sieben", "drei", "vier fünf sechs sieben acht",
                "null null", "zwei drei vier"],
    "classification": ["the film is good", "a dull plot", "", "bad", "the plot is fine film",
                       "good good dull", "is"],
    "tagging": ["Jones visited Oslo .", "", "Brown visited", "Smith visited Rome . Jones",
                "Paris", "Unknown visited Nowhere .", "Oslo Oslo Oslo"],
}


def train_workdir(kind: str, folder: str) -> str:
  """A tiny trained run of `kind` in folder/run (seconds of training on local files)."""
  import pathlib

  from test_tasks import (
    _number_corpus,
    _shrink,
    _tiny_seq2seq_config,
    entity_corpus,
    sentiment_corpus,
  )

  from configs import conll2003, sst2
  from transformer_jax.training import loop
  folder = pathlib.Path(folder)
  workdir = str(folder / "run")
  if kind == "seq2seq":
    config = _tiny_seq2seq_config(_number_corpus(folder / "data"), 80)
  else:
    (folder / "data").mkdir()
    (sentiment_corpus if kind == "classification" else entity_corpus)(folder / "data")
    config = _shrink((sst2 if kind == "classification" else conll2003).get_config(), 20,
                     dir=str(folder / "data"))
  loop.train_and_evaluate(config, workdir)
  return workdir


@pytest.fixture(scope="module")
def workdirs(trained_runs) -> dict[str, str]:
  return {kind: trained_runs.workdir(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def artifacts(trained_runs) -> dict[str, str]:
  """Each workdir exported with the export command (default decode options)."""
  return {kind: trained_runs.artifact(kind) for kind in KINDS}


@functools.lru_cache(maxsize=None)
def _served(directory: str):
  from transformer_jax.serving import Served
  return Served.load(directory)


def _ids_as_text(ids) -> str:
  """A stand-in detokenizer: the output's ids themselves, so outputs compare id for id."""
  return " ".join(str(int(i)) for i in ids)


@pytest.mark.parametrize("kind", KINDS)
def test_artifact_outputs_equal_predict(kind, workdirs, artifacts, monkeypatch):
  from transformer_jax.predict import Predictor
  predictor = Predictor(workdirs[kind])
  served = _served(artifacts[kind])
  lines = LINES[kind]
  expected = predictor.predict_lines(lines)
  assert served.predict(lines) == expected
  # Outputs that depend on the input: a constant output would also be "equal".
  assert len(set(expected)) > 1, expected
  if kind == "seq2seq":   # Token for token: the searched ids, before detokenizing.
    monkeypatch.setattr(predictor.task.target_tokenizer, "decode", _ids_as_text)
    monkeypatch.setattr(served.target_tokenizer, "decode", _ids_as_text)
    ids = predictor.predict_lines(lines)
    assert served.predict(lines) == ids
    assert len(set(ids)) > 1 and any(ids), ids
  assert served.manifest["task"] == predictor.task.name
  assert served.labels == predictor.labels
  if kind == "tagging":   # The CoNLL config's tagger: character features and a CRF.
    assert predictor.task.head["crf"] and predictor.task.head["char_features"]
    assert served.manifest["inputs"]["chars"]["shape"] == [
        "batch", "length", predictor.task.head["char_max_length"]]
    assert len(served.constants["crf"]["transitions"]) == len(served.labels)


def test_greedy_artifact_equals_greedy_predict(workdirs, tmp_path):
  from transformer_jax.export import export_stablehlo
  from transformer_jax.predict import Predictor
  from transformer_jax.serving import Served
  directory = export_stablehlo(workdirs["seq2seq"], None, str(tmp_path / "greedy"), None, 1)
  served = Served.load(directory)
  predictor = Predictor(workdirs["seq2seq"])
  assert served.manifest["decode"]["beam_size"] == 1
  lines = LINES["seq2seq"][:3]
  expected = predictor.predict_lines(lines, predictor.decode_options(beam_size=1))
  assert served.predict(lines) == expected
  assert len(set(expected)) > 1, expected


def test_one_artifact_serves_any_batch_and_length(artifacts):
  """Rows are independent: every row of a (B, S) call equals the row alone, for B in
  1, 7, 32 and S from 3 to max_len, without re-exporting."""
  served = _served(artifacts["classification"])
  rng = np.random.default_rng(0)
  vocab = served.manifest["vocab_size"]
  for batch, length in ((1, 3), (7, 16), (32, 9), (7, served.max_len)):
    tokens = rng.integers(4, vocab, (batch, length)).astype(np.int32)
    chars = None
    if served.word_bytes:   # the SST-2 config's character features: each word's bytes
      chars = rng.integers(1, 257, (batch, length, served.word_bytes)).astype(np.int32)
    out = served.run(tokens, chars)
    assert out.shape == (batch, len(served.labels))
    for row in (0, batch - 1):
      one = None if chars is None else chars[row:row + 1]
      np.testing.assert_allclose(out[row], served.run(tokens[row:row + 1], one)[0],
                                 rtol=1e-5, atol=1e-6)
  translation = _served(artifacts["seq2seq"])
  lines = [" ".join(["eins", "zwei", "drei"][: 1 + i % 3]) for i in range(32)]
  outputs = {n: translation.predict(lines[:n]) for n in (1, 7, 32)}
  assert outputs[32][:7] == outputs[7] and outputs[7][:1] == outputs[1]
  spec = json.load(open(os.path.join(artifacts["seq2seq"], "manifest.json")))
  assert spec["inputs"]["tokens"]["shape"] == ["batch", "length"]
  assert spec["output_shape"][0] == "batch" and "length" in spec["output_shape"][1]


def test_inputs_are_checked_before_the_model(artifacts):
  served = _served(artifacts["tagging"])
  with pytest.raises(InputError, match="input 1: expected a string"):
    served.predict(["Jones", 7])
  translation = _served(artifacts["seq2seq"])   # a tagger windows a long line instead
  with pytest.raises(InputError, match="input 1: .* exceed the model's max_len"):
    translation.predict(["eins", " ".join(["eins"] * (translation.max_len + 1))])


def test_damaged_artifact_is_refused(artifacts, tmp_path):
  import shutil

  from transformer_jax.serving import ArtifactError, Served
  copy = str(tmp_path / "copy")
  shutil.copytree(artifacts["classification"], copy)
  with open(os.path.join(copy, "labels.json"), "w") as f:
    json.dump({"labels": ["x", "y"]}, f)
  with pytest.raises(ArtifactError, match="labels.json .* SHA-256"):
    Served.load(copy)
  with pytest.raises(ArtifactError, match="manifest.json is missing"):
    Served.load(str(tmp_path))


# A fresh interpreter where importing Flax (and the training stack) fails.
_NO_FLAX = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("flax", "optax", "orbax", "grain", "tensorflow_datasets"):
      raise ImportError(f"{name} is not allowed in the served process")
    return None
sys.meta_path.insert(0, Refuse())
"""


def test_export_and_load_round_trip_in_a_fresh_process_without_flax(workdirs, artifacts,
                                                                      tmp_path):
  # Exported by the command line, in its own process: for three platforms, from a chosen
  # step (through an orbax export, the path --step/--average take).
  directory = str(tmp_path / "cli")
  run = subprocess.run([sys.executable, "-m", "transformer_jax.export",
                        f"--workdir={workdirs['tagging']}", "--format=stablehlo",
                        f"--output={directory}", "--platforms=cpu,cuda,tpu", "--step=20"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
  assert run.returncode == 0, run.stderr
  lines = LINES["tagging"]
  script = _NO_FLAX + f"""
import json
from transformer_jax.serving import Served
served = Served.load({directory!r})
outputs = served.predict({lines!r})
try:
  import flax
except ImportError:
  pass
else:
  raise SystemExit("flax imported")
heavy = sorted(m for m in sys.modules if m.startswith(("flax", "transformer_jax.modules",
               "transformer_jax.tasks", "transformer_jax.training", "transformer_jax.decoding")))
print(json.dumps({{"outputs": outputs, "heavy": heavy}}))
"""
  child = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
  assert child.returncode == 0, child.stderr
  result = json.loads(child.stdout.strip().splitlines()[-1])
  assert result["heavy"] == []
  manifest = json.load(open(os.path.join(directory, "manifest.json")))
  assert manifest["platforms"] == ["cpu", "cuda", "tpu"] and manifest["source"]["step"] == 20
  assert result["outputs"] == _served(artifacts["tagging"]).predict(lines)
  assert len(set(result["outputs"])) > 1, result["outputs"]   # not one answer for all


def test_export_user_errors_exit_2(workdirs, artifacts, tmp_path):
  common = [sys.executable, "-m", "transformer_jax.export", "--format=stablehlo"]
  env = {**os.environ, "PYTHONPATH": ROOT}
  for args, message in (
      ([f"--workdir={tmp_path / 'none'}", f"--output={tmp_path / 'a'}"], "does not exist"),
      ([f"--workdir={workdirs['classification']}", f"--output={artifacts['classification']}"],
       "not empty")):
    run = subprocess.run(common + args, cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 2 and message in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
