"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64] [--checkpoint DIR]

Translation: text in, text out. Classification: text in, label out. Tagging: space-separated
words in, one tag per word out. Loads the workdir's newest model: the highest-step export in
W/exports/ or checkpoint in W/checkpoints/ (an export wins at the same step; a damaged one is
skipped with a warning), or the export or checkpoint directory given as --checkpoint. The
model's config, tokenizer(s) and label names are read from that checkpoint. Input and output
default to stdin and stdout.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, TextIO

from absl import app, flags, logging
import flax.linen as nn
import jax

from transformer_jax import checkpoint
from transformer_jax.config import TransformerConfig
from transformer_jax.data import pipeline
from transformer_jax.inputs import InputError
from transformer_jax.training.tasks import make_task


class Predictor:
  """Loads a model once (see the module doc for which) and predicts batches of lines."""

  def __init__(self, workdir: str | None = None, checkpoint_path: str | None = None):
    if checkpoint_path is not None:
      if not os.path.isdir(checkpoint_path):
        raise FileNotFoundError(f"checkpoint {checkpoint_path!r} does not exist")
      candidates = [checkpoint_path]
    elif workdir is None or not os.path.isdir(workdir):
      raise FileNotFoundError(f"workdir {workdir!r} does not exist; train first with "
                              f"`python train.py --workdir {workdir}`")
    else:
      candidates = checkpoint.models(workdir)
      if not candidates:
        raise FileNotFoundError(f"workdir {workdir!r} has no checkpoint or export; was "
                                "training interrupted before the first checkpoint?")
    self.path, (model, self.params), _ = checkpoint.first_good(candidates, self._load)
    self.step, self.run_config = model.step, model.config
    self.kind, self.model_config, self.task = self._task(model)
    self.vocab, self.labels = model.assets.tokenizer, model.assets.labels
    self.featurizer = pipeline.Featurizer(self.kind, self.vocab, model.assets.target_tokenizer)

  @staticmethod
  def _task(model: checkpoint.Model) -> tuple[str, TransformerConfig, object]:
    kind = model.config.get("task", "seq2seq")
    if kind != "seq2seq" and not model.assets.labels:
      raise checkpoint.IncompatibleCheckpointError(
          f"{model.path} holds a {kind} model but no label names")
    model_config = TransformerConfig.from_dict(model.config["model"])
    task = make_task(kind, model_config, labels=model.assets.labels,
                     tokenizer=model.assets.target_tokenizer, decode=model.config.get("decode"),
                     pooling=model.config.get("pooling", "mean"))
    return kind, model_config, task

  @classmethod
  def _load(cls, path: str) -> tuple[checkpoint.Model, object]:
    model = checkpoint.read_model(path)
    _, _, task = cls._task(model)
    abstract = nn.meta.unbox(jax.eval_shape(task.init_params, jax.random.PRNGKey(0)))
    return model, checkpoint.restore_params(path, abstract)

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
      raise ValueError(f"translate needs a seq2seq model; this one is a {self.kind} model "
                       "(use predict_lines)")
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


def predict(workdir: str | None, infile: TextIO, outfile: TextIO, beam_size: int, alpha: float,
            batch_size: int, checkpoint_path: str | None = None) -> int:
  predictor = Predictor(workdir, checkpoint_path)
  count = 0
  for batch in _batches(infile, batch_size):
    for line in predictor.predict_lines(batch, beam_size, alpha):
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  return count


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (so that other
  commands can import it)."""
  flags.DEFINE_string("workdir", None, "Training workdir: its newest export or "
                      "checkpoint is used.")
  flags.DEFINE_string("checkpoint", None, "An export (W/exports/NAME) or checkpoint "
                      "(W/checkpoints/STEP) directory to use instead.")
  flags.DEFINE_string("input", "-", "Input file, one example per line ('-': stdin).")
  flags.DEFINE_string("output", "-", "Output file ('-': stdout).")
  flags.DEFINE_integer("beam_size", 4, "Beam size (1 = greedy).")
  flags.DEFINE_float("alpha", 0.6, "Length penalty exponent.")
  flags.DEFINE_integer("batch_size", 64, "Lines decoded together.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  del argv
  if FLAGS.workdir is None and FLAGS.checkpoint is None:
    sys.exit("error: give --workdir (a training workdir) or --checkpoint (an export or "
             "checkpoint directory)")
  infile = sys.stdin if FLAGS.input == "-" else open(FLAGS.input)
  outfile = sys.stdout if FLAGS.output == "-" else open(FLAGS.output, "w")
  try:
    predict(FLAGS.workdir, infile, outfile, FLAGS.beam_size, FLAGS.alpha, FLAGS.batch_size,
            FLAGS.checkpoint)
  except (FileNotFoundError, ValueError, checkpoint.DamagedCheckpointError) as e:
    sys.exit(f"error: {e}")  # Bad workdir, checkpoint or input: say what, no trace.
  finally:
    if infile is not sys.stdin:
      infile.close()
    if outfile is not sys.stdout:
      outfile.close()


if __name__ == "__main__":
  define_flags()
  app.run(main)
