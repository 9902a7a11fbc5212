"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64] [--checkpoint DIR]

Translation: text in, text out. Classification: text in, label out. Tagging: space-separated
words in, one tag per word out. Loads the workdir's newest model: the highest-step parameter
snapshot in W/exports/ or checkpoint in W/checkpoints/ (a snapshot wins at the same step; a
damaged one is skipped with a warning), or the snapshot or checkpoint directory given as
--checkpoint. The
model's config, tokenizer(s) and label names are read from that checkpoint. Input and output
default to stdin and stdout.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Iterable, TextIO

import flax.linen as nn
import jax
from absl import flags, logging

from transformer_jax import checkpoint, errors, tasks
from transformer_jax.data import pipeline
from transformer_jax.errors import MissingFileError, UserError
from transformer_jax.files import atomic_output
from transformer_jax.inputs import InputError
from transformer_jax.options import DecodeOptions, TrainOptions
from transformer_jax.renamed_fields import upgrade


class Predictor:
  """Loads a model once (see the module doc for which) and predicts batches of lines."""

  def __init__(self, workdir: str | None = None, checkpoint_path: str | None = None):
    self.path, (model, self.task, self.params) = checkpoint.load_newest(
        workdir, self._load, checkpoint_path)
    self.step, self.saved_config = model.step, upgrade(model.config)
    self.decode = DecodeOptions.from_dict(self.saved_config.get("decode"))

  @staticmethod
  def _task(model: checkpoint.ModelRecord) -> tasks.Task:
    saved = upgrade(model.config)
    task_name = TrainOptions.from_dict(saved).task
    if tasks.task_class(task_name).needs_labels and not model.assets.labels:
      raise checkpoint.IncompatibleCheckpointError(
          f"{model.path} holds a {task_name} model but no label names")
    return tasks.from_run_config(saved, tokenizer=model.assets.tokenizer,
                                 target_tokenizer=model.assets.target_tokenizer,
                                 labels=model.assets.labels)

  @classmethod
  def _load(cls, path: str) -> tuple[checkpoint.ModelRecord, tasks.Task, object]:
    model = checkpoint.read_record(path)
    task = cls._task(model)
    abstract = nn.meta.unbox(jax.eval_shape(task.init_params, jax.random.PRNGKey(0)))
    return model, task, checkpoint.restore_params(path, abstract)

  @property
  def model_config(self):
    return self.task.model_config

  @property
  def labels(self) -> list[str] | None:
    return self.task.labels

  def decode_options(self, **overrides) -> DecodeOptions:
    """The run's decode options with the given (non-None) fields replaced."""
    return dataclasses.replace(self.decode,
                               **{k: v for k, v in overrides.items() if v is not None})

  def predict_lines(self, lines: list[str], decode: DecodeOptions | None = None,
                    first_line: int = 1) -> list[str]:
    """One output line per input line: a translation, a label, or space-separated tags,
    searched with `decode` (default: the run's decode options). Lines are grouped in
    length buckets, so each bucket shape compiles once. An unusable line raises InputError
    naming its number (`first_line` is the number of lines[0])."""
    if not lines:
      return []
    decode = decode or self.decode
    records = [self.task.record_from_line(line) for line in lines]
    max_len = self.model_config.max_len
    for number, record in enumerate(records, first_line):
      try:
        length = self.task.example_length(self.task.featurize(record))
      except UserError as e:   # e.g. a symbol outside the vocabulary
        raise InputError(f"input line {number}: {e}") from None
      if length > max_len:
        raise InputError(f"input line {number}: {length} tokens exceed the "
                         f"model's max_len={max_len}; shorten or split it")
    for index, record in enumerate(records):
      record["index"] = index     # where its output goes once the buckets are decoded
    batches, _ = pipeline.eval_batches(records, self.task, batch_size=len(lines),
                                       max_length=max_len)
    outputs: list[str] = [""] * len(lines)
    for batch in batches:
      for record, output in zip(batch.records, self.task.predict(self.params, batch.arrays,
                                                                 decode)):
        outputs[record["index"]] = output
    return outputs


def _batches(lines: Iterable[str], size: int) -> Iterable[list[str]]:
  batch = []
  for line in lines:
    batch.append(line.rstrip("\n"))
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def predict(workdir: str | None, infile: TextIO, outfile: TextIO, beam_size: int | None,
            alpha: float | None, batch_size: int, checkpoint_path: str | None = None) -> int:
  """Predicts every line of `infile` into `outfile`; beam_size/alpha None: the run's own."""
  predictor = Predictor(workdir, checkpoint_path)
  decode = predictor.decode_options(beam_size=beam_size, alpha=alpha)
  count = 0
  for batch in _batches(infile, batch_size):
    for line in predictor.predict_lines(batch, decode, first_line=count + 1):
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  return count


FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The command-line flags, defined only when this module is the program (so that other
  commands can import it); tests pass a FlagValues of their own."""
  define: dict[str, Any] = {"flag_values": flag_values}
  flags.DEFINE_string("workdir", None, "Training workdir: its newest parameter "
                      "snapshot or checkpoint is used.", **define)
  flags.DEFINE_string("checkpoint", None, "A parameter snapshot (W/exports/NAME) or checkpoint "
                      "(W/checkpoints/STEP) directory to use instead.", **define)
  flags.DEFINE_string("input", "-", "Input file, one example per line ('-': stdin).",
                      **define)
  flags.DEFINE_string("output", "-", "Output file ('-': stdout).", **define)
  flags.DEFINE_integer("beam_size", None, "Beam size (1 = greedy); default: the run's "
                       "decode.beam_size.", **define)
  flags.DEFINE_float("alpha", None, "Length penalty exponent; default: the run's "
                     "decode.alpha.", **define)
  flags.DEFINE_integer("batch_size", 64, "Lines decoded together.", **define)

def _check_flags() -> None:
  """The flags, before a model is loaded."""
  if FLAGS.workdir is None and FLAGS.checkpoint is None:
    raise UserError("give --workdir (a training workdir) or --checkpoint (a parameter "
                    "snapshot or checkpoint directory)")
  for name, low in (("batch_size", 1), ("beam_size", 1), ("alpha", 0)):
    value = FLAGS[name].value
    if value is not None and not value >= low:    # `not >=`: NaN fails too
      raise UserError(f"--{name}={value}: must be >= {low}")
  if FLAGS.input != "-" and not os.path.isfile(FLAGS.input):
    raise MissingFileError(f"--input={FLAGS.input}: no such file")
  if FLAGS.output != "-":
    directory = os.path.dirname(os.path.abspath(FLAGS.output))
    if not os.path.isdir(directory):
      raise MissingFileError(f"--output={FLAGS.output}: directory {directory} does not exist")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  del argv
  _check_flags()
  # utf-8-sig: a byte-order mark (Windows editors) is not part of the first line.
  infile = sys.stdin if FLAGS.input == "-" else open(FLAGS.input, encoding="utf-8-sig")
  args = (FLAGS.beam_size, FLAGS.alpha, FLAGS.batch_size, FLAGS.checkpoint)
  try:
    if FLAGS.output == "-":
      predict(FLAGS.workdir, infile, sys.stdout, *args)
    else:   # Replaced only once every line is predicted: a failure keeps the old results.
      with atomic_output(FLAGS.output) as outfile:
        predict(FLAGS.workdir, infile, outfile, *args)
  finally:
    if infile is not sys.stdin:
      infile.close()


if __name__ == "__main__":
  define_flags()
  errors.run(main)
