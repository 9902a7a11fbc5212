"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64]

Translation: text in, text out. Classification: text in, label out. Tagging: space-separated
words in, one tag per word out. Reads W/config.json, the tokenizer (W/vocab.json), the
class or tag names (W/labels.json) and the latest parameters in W/checkpoints. Input and
output default to stdin and stdout.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, TextIO

from absl import app, flags, logging
import flax.linen as nn
import jax

from transformer_jax.checkpoint import Checkpointer
from transformer_jax.config import TransformerConfig
from transformer_jax.data import pipeline
from transformer_jax.data.text_data import TARGET_VOCAB_FILE, load_labels
from transformer_jax.data.tokenizer import load_tokenizer
from transformer_jax.inputs import InputError
from transformer_jax.training.loop import CHECKPOINT_DIR, CONFIG_FILE, VOCAB_FILE
from transformer_jax.training.tasks import make_task


class Predictor:
  """Loads a workdir once and predicts batches of lines."""

  def __init__(self, workdir: str):
    missing = [name for name in (CONFIG_FILE, VOCAB_FILE, CHECKPOINT_DIR)
               if not os.path.exists(os.path.join(workdir, name))]
    if not os.path.isdir(workdir):
      raise FileNotFoundError(f"workdir {workdir!r} does not exist; train first with "
                              f"`python train.py --workdir {workdir}`")
    if missing:
      raise FileNotFoundError(f"workdir {workdir!r} is incomplete: missing {missing}; "
                              "was training interrupted before the first checkpoint?")
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      self.run_config = json.load(f)
    self.kind = self.run_config.get("task", "seq2seq")
    self.model_config = TransformerConfig.from_dict(self.run_config["model"])
    self.vocab = load_tokenizer(os.path.join(workdir, VOCAB_FILE))
    target_path = os.path.join(workdir, TARGET_VOCAB_FILE)
    target_vocab = load_tokenizer(target_path) if os.path.exists(target_path) else self.vocab
    self.labels = load_labels(workdir)
    if self.kind != "seq2seq" and not self.labels:
      raise FileNotFoundError(f"workdir {workdir!r} has no labels.json for its {self.kind} "
                              "model")
    self.task = make_task(self.kind, self.model_config, labels=self.labels,
                          tokenizer=target_vocab, pooling=self.run_config.get("pooling", "mean"))
    self.featurizer = pipeline.Featurizer(self.kind, self.vocab, target_vocab)
    checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR))
    if checkpointer.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)}")
    abstract = nn.meta.unbox(jax.eval_shape(lambda: self.task.init_params(jax.random.PRNGKey(0))))
    self.step = checkpointer.latest_step()
    self.params = checkpointer.restore_params(abstract)
    checkpointer.close()

  def _record(self, index: int, line: str) -> dict:
    if self.kind == "seq2seq":
      return {"index": index, "source": line, "target": ""}
    if self.kind == "classification":
      return {"index": index, "text": line, "label": 0}
    words = line.split()
    return {"index": index, "words": words, "tags": [0] * len(words)}

  def predict_lines(self, lines: list[str], beam_size: int = 4, alpha: float = 0.6,
                    max_extra_length: int | None = None) -> list[str]:
    """One output line per input line: a translation, a label, or space-separated tags.
    Lines are grouped in length buckets, so each bucket shape compiles once."""
    if not lines:
      return []
    records = [self._record(i, line) for i, line in enumerate(lines)]
    max_len = self.model_config.max_len
    for record in records:
      length = pipeline.example_length(self.kind, self.featurizer(record))
      if length > max_len:
        raise InputError(f"input line {record['index'] + 1}: {length} tokens exceed the "
                         f"model's max_len={max_len}; shorten or split it")
    if max_extra_length is None:
      max_extra_length = int(self.run_config.get("decode", {}).get("max_extra_length", 50))
    batches, _ = pipeline.eval_batches(records, self.featurizer, batch_size=len(lines),
                                       max_length=max_len)
    outputs: list[str] = [""] * len(lines)
    for batch in batches:
      if self.kind == "seq2seq":
        predicted = self.task.predict(self.params, batch.arrays, beam_size, alpha,
                                      max_extra_length)
      else:
        predicted = self.task.predict(self.params, batch.arrays)
      for record, output in zip(batch.records, predicted):
        outputs[record["index"]] = output if isinstance(output, str) else " ".join(output)
    return outputs

  def translate(self, lines: list[str], beam_size: int = 4, alpha: float = 0.6,
                max_extra_length: int | None = None) -> list[str]:
    if self.kind != "seq2seq":
      raise ValueError(f"translate needs a seq2seq model; this workdir holds a {self.kind} "
                       "model (use predict_lines)")
    return self.predict_lines(lines, beam_size, alpha, max_extra_length)


def _batches(lines: Iterable[str], size: int) -> Iterable[list[str]]:
  batch = []
  for line in lines:
    batch.append(line.rstrip("\n"))
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def predict(workdir: str, infile: TextIO, outfile: TextIO, beam_size: int, alpha: float,
            batch_size: int) -> int:
  predictor = Predictor(workdir)
  count = 0
  for batch in _batches(infile, batch_size):
    for line in predictor.predict_lines(batch, beam_size, alpha):
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  return count


_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to load.", required=True)
_INPUT = flags.DEFINE_string("input", "-", "Input file, one example per line ('-': stdin).")
_OUTPUT = flags.DEFINE_string("output", "-", "Output file ('-': stdout).")
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size (1 = greedy).")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty exponent.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Lines decoded together.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  del argv
  infile = sys.stdin if _INPUT.value == "-" else open(_INPUT.value)
  outfile = sys.stdout if _OUTPUT.value == "-" else open(_OUTPUT.value, "w")
  try:
    predict(_WORKDIR.value, infile, outfile, _BEAM.value, _ALPHA.value, _BATCH.value)
  except (FileNotFoundError, ValueError) as e:  # Bad workdir or input: say what, no trace.
    sys.exit(f"error: {e}")
  finally:
    if infile is not sys.stdin:
      infile.close()
    if outfile is not sys.stdout:
      outfile.close()


if __name__ == "__main__":
  app.run(main)
