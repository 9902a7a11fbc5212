"""The command lines: `python train.py` and `python -m transformer_jax.predict`, run as
subprocesses from the repository root. Each one pays the JAX import, so they are few, and
independent ones run concurrently."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ml_collections
import pytest
from cli_helpers import finish as _finish
from cli_helpers import start as _start

from transformer_jax.data.synthetic import SyntheticData
from transformer_jax.predict import Predictor

# A tiny model and run: a few seconds of training on a CPU.
TINY_OVERRIDES = [
    "--config.num_train_steps=4", "--config.log_every_steps=2",
    "--config.eval_every_steps=100", "--config.checkpoint_every_steps=100",
    "--config.batch_size=8", "--config.data.max_length=4", "--config.eval.examples=4",
    "--config.eval.batch_size=4",
    "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.d_ff=64",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.model.max_len=16", "--config.optimizer.warmup_steps=2",
]


def _run(*args: str) -> tuple[int, str]:
  return _finish(_start(*args))


def test_train_rejects_bad_config_overrides(tmp_path):
  workdir = tmp_path / "never"
  unknown = _start("train.py", "--config.no_such_field=1", f"--workdir={workdir}")
  bad_type = _start("train.py", "--config.num_train_steps=abc", f"--workdir={workdir}")
  # With --config=FILE, ml_collections applies overrides while absl parses the flags.
  unknown_in_file = _start("train.py", "--config=configs/sst2.py", "--config.model.crff=1",
                           f"--workdir={workdir}")
  code, output = _finish(unknown_in_file)
  assert code == 2 and "Traceback" not in output
  assert "unknown config field 'crff'" in output
  code, output = _finish(unknown)
  assert code != 0
  assert "no_such_field" in output
  code, output = _finish(bad_type)
  assert code != 0
  assert "num_train_steps" in output and "int" in output and "abc" in output
  assert not workdir.exists()                    # Failed before writing anything.


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("cli") / "run")
  code, output = _run("train.py", *TINY_OVERRIDES, f"--workdir={workdir}")
  assert code == 0, output
  assert "final:" in output
  return workdir


def test_train_cli_writes_a_workdir(trained_workdir):
  for name in ("config.json", "vocab.json", "metrics.jsonl", "checkpoints"):
    assert os.path.exists(os.path.join(trained_workdir, name)), name
  assert "4" in os.listdir(os.path.join(trained_workdir, "checkpoints"))
  with open(os.path.join(trained_workdir, "config.json")) as f:
    config = json.load(f)
  assert config["num_train_steps"] == 4 and config["model"]["d_model"] == 32
  with open(os.path.join(trained_workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert [l["step"] for l in lines if "train/loss" in l] == [2, 4]
  assert [l["step"] for l in lines if "eval/exact_match" in l] == [4]


def _sample_sources(workdir: str) -> list[str]:
  """Held-out sources of the run's own task, plus edge cases: one symbol, an empty line,
  and a source longer than any seen in training."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  data = config.data
  source = SyntheticData(data.synthetic_task, data.min_length, data.max_length, config.seed)
  return [s for s, _ in source.eval_examples(7)] + ["5", "", "9 8 7 6 5 4 3"]


def test_predict_cli_matches_in_process_predictor(trained_workdir, tmp_path):
  lines = _sample_sources(trained_workdir)
  infile, outfile = tmp_path / "in.txt", tmp_path / "out.txt"
  infile.write_text("".join(line + "\n" for line in lines))
  batch_size, beam_size, alpha = 4, 3, 0.8
  code, output = _run("-m", "transformer_jax.predict", f"--workdir={trained_workdir}",
                      f"--input={infile}", f"--output={outfile}", f"--beam_size={beam_size}",
                      f"--alpha={alpha}", f"--batch_size={batch_size}")
  assert code == 0, output
  predicted = outfile.read_text().split("\n")
  assert predicted[-1] == ""                       # Newline-terminated ...
  predicted = predicted[:-1]
  assert len(predicted) == len(lines)              # ... one line per input line.

  predictor = Predictor(trained_workdir)
  assert predictor.step == 4
  expected = []
  for start in range(0, len(lines), batch_size):   # The CLI decodes batch by batch.
    expected += predictor.predict_lines(lines[start:start + batch_size],
                                        predictor.decode_options(beam_size=beam_size, alpha=alpha))
  assert predicted == expected
  symbols = set(predictor.task.tokenizer.symbols)
  assert all(set(line.split()) <= symbols for line in predicted)


def test_predict_cli_errors(trained_workdir, tmp_path):
  missing = tmp_path / "no_such_workdir"
  bad_input = tmp_path / "bad.txt"
  bad_input.write_text("1 2 3\n4 x 5\n")
  no_workdir = _start("-m", "transformer_jax.predict", f"--workdir={missing}",
                      f"--input={bad_input}")
  unknown = _start("-m", "transformer_jax.predict", f"--workdir={trained_workdir}",
                   f"--input={bad_input}", f"--output={tmp_path / 'out.txt'}")

  code, output = _finish(no_workdir)
  assert code != 0
  assert str(missing) in output and "does not exist" in output
  assert "Traceback" not in output

  code, output = _finish(unknown)
  assert code != 0
  assert "unknown symbol 'x'" in output
  assert "Traceback" not in output
