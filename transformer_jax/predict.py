"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64] [--checkpoint DIR]
      [--too_long refuse|truncate]
      [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S]   (lm)
      [--chat]   (a language model with a chat template: each line is a user's message)

Translation: text in, text out. Classification: text in, label out. Tagging: words
separated by spaces or tabs in, one tag per word out. Language model: a prompt in, its
continuation out (`\n` in either stands for a newline, `\\` for a backslash). Loads the workdir's newest model: the
highest-step parameter snapshot in W/exports/ or checkpoint in W/checkpoints/ (a snapshot
wins at the same step; a damaged one is skipped with a warning), or the snapshot or
checkpoint directory given as --checkpoint. The model's config, tokenizer(s) and label
names are read from that checkpoint. Input and output default to stdin and stdout.

Lines are read, cleaned and fitted to the model as its training did, as the server does
(serving/line_policy.py): any bytes are read (not UTF-8: as Windows-1252, with a warning),
a blank line gives an empty output, a line longer than the model's max_len is truncated
by a classifier, tagged in overlapping windows by a tagger, and refused (an `error:` line
naming it) by translation or under --too_long=refuse.

Chat (--chat): each line is one user message, rendered with the model's chat template
(data/chat_template.py) with the assistant's turn begun, as POST /v1/chat/completions
renders it; the output is the assistant's answer, which ends at the model's end ids or the
template's end of turn. A conversation longer than the context leaves is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, BinaryIO, Iterable, TextIO, cast

import flax.linen as nn
import jax
import numpy as np
from absl import flags, logging

from transformer_jax import checkpoint, errors, tasks
from transformer_jax.config import EOS_ID
from transformer_jax.data import pipeline
from transformer_jax.errors import MissingFileError, UserError
from transformer_jax.files import atomic_output
from transformer_jax.inputs import InputError
from transformer_jax.modules import kernels
from transformer_jax.options import DataOptions, DecodeOptions, TrainOptions
from transformer_jax.renamed_fields import upgrade
from transformer_jax.sampling import check_room
from transformer_jax.serving.line_policy import (
  TOO_LONG_CHOICES,
  LineReader,
  escape_line,
  stitch,
  window_starts,
)


class _Prepared:
  """The task, over records that hold their featurized example: a line is featurized once
  (its length decides what becomes of it), and its windows are examples too."""

  def __init__(self, task: tasks.Task):
    self._task = task

  def featurize(self, record: dict) -> dict:
    return record["example"]

  def __getattr__(self, name: str) -> Any:
    return getattr(self._task, name)


class Predictor:
  """Loads a model once (see the module doc for which) and predicts batches of lines.
  `too_long`: the --too_long flag (None: what the model's training did)."""

  def __init__(self, workdir: str | None = None, checkpoint_path: str | None = None,
               too_long: str | None = None, portable: bool = False):
    """`portable`: attention through XLA's path whatever the model was trained with (a
    served artifact has symbolic lengths and may run on other platforms than a kernel's)."""
    load = functools.partial(self._load, portable=portable)
    self.path, (model, self.task, self.params) = checkpoint.load_newest(
        workdir, load, checkpoint_path)
    self.step, self.saved_config = model.step, upgrade(model.config)
    self.decode = DecodeOptions.from_dict(self.saved_config.get("decode"))
    self.policy = self.task.line_policy(DataOptions.from_dict(self.saved_config.get("data")))
    self.policy = self.policy.choose(too_long, self.task.name)

  @staticmethod
  def _task(model: checkpoint.ModelRecord, portable: bool = False) -> tasks.Task:
    saved = upgrade(model.config)
    if portable and saved["model"].get("attention_impl") in (*kernels.KERNELS, "auto"):
      saved = {**saved, "model": {**saved["model"], "attention_impl": "xla"}}
    task_name = TrainOptions.from_dict(saved).task
    if tasks.task_class(task_name).needs_labels and not model.assets.labels:
      raise checkpoint.IncompatibleCheckpointError(
          f"{model.path} holds a {task_name} model but no label names")
    return tasks.from_run_config(saved, tokenizer=model.assets.tokenizer,
                                 target_tokenizer=model.assets.target_tokenizer,
                                 labels=model.assets.labels)

  @classmethod
  def _load(cls, path: str, portable: bool = False
            ) -> tuple[checkpoint.ModelRecord, tasks.Task, object]:
    model = checkpoint.read_record(path)
    task = cls._task(model, portable)
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
    searched with `decode` (default: the run's decode options). Each line is cleaned and
    fitted to the model by the line policy (serving/line_policy.py); a line without input
    tokens gives an empty output. Lines are grouped in length buckets, so each bucket shape
    compiles once. An unusable line raises InputError naming its number (`first_line` is
    the number of lines[0])."""
    decode = decode or self.decode
    max_len = self.model_config.max_len
    rows: list[dict] = []              # the model's rows: a line's example or its windows
    lengths: dict[int, int] = {}       # line index -> its tokens
    for index, line in enumerate(lines):
      where = f"input line {first_line + index}"
      try:
        example = self.task.featurize(self.task.record_from_line(self.policy.clean(line)))
      except UserError as e:   # e.g. a symbol outside the vocabulary
        raise InputError(f"{where}: {e}") from None
      if not len(example[self.task.sequence_keys[0]]):
        continue                # no input tokens: an empty output, no model call
      lengths[index] = self.task.example_length(example)
      action = self.policy.action(lengths[index], max_len, where)
      if action == "truncate":
        example = self.task.truncate(example, max_len, self.policy.truncate)
      starts = window_starts(lengths[index], max_len) if action == "window" else [0]
      rows += [{"example": self.task.window(example, start, max_len), "line": index,
                "start": start} for start in starts]
    outputs: list[str] = [""] * len(lines)
    if not rows:
      return outputs
    batches, _ = pipeline.eval_batches(rows, _Prepared(self.task), batch_size=len(lines),
                                       max_length=max_len)
    if self.policy.too_long == "window":
      return self._stitched(batches, lengths, outputs, decode)
    for batch in batches:
      for record, output in zip(batch.records, self.task.predict(self.params, batch.arrays,
                                                                 decode)):
        outputs[record["line"]] = output
    return outputs

  def chat_template(self) -> Any:
    """The model's chat template (data/chat_template.py); UserError where it has none."""
    # Imported here: jinja2 is needed only to chat.
    from transformer_jax.data.chat_template import chat_template
    if self.task.name != "lm":
      raise UserError(f"--chat: {self.path} holds a {self.task.name} model; chat is for "
                      "language models")
    try:
      template = chat_template(getattr(self.task.tokenizer, "config", {}))
    except ValueError as e:
      raise UserError(f"--chat: {self.path}: {e}") from None
    if template is None:
      raise UserError(f"--chat: the model of {self.path} has no chat template (its "
                      "tokenizer_config.json had no \"chat_template\", nor chat_template.jinja "
                      "beside it, when imported); leave --chat out to continue the lines")
    return template

  def chat_lines(self, lines: list[str], template: Any, decode: DecodeOptions | None = None,
                 first_line: int = 1) -> list[str]:
    """Each line as a user's message (see the module doc, "Chat") -> the assistant's answer,
    escaped as a line; InputError naming a line the template refuses or the context cannot
    hold."""
    from transformer_jax.data.chat_template import end_of_turn
    decode, tokenizer, cfg = decode or self.decode, self.task.tokenizer, self.model_config
    check_room(cfg, decode.max_new_tokens)
    room = cfg.max_len - decode.max_new_tokens
    prompts = []
    for index, line in enumerate(lines):
      where = f"input line {first_line + index}"
      try:
        ids = tokenizer.encode(template.render([{"role": "user",
                                                 "content": self.policy.clean(line)}]))
      except ValueError as e:
        raise InputError(f"{where}: {e}") from None
      if len(ids) > room:
        raise InputError(f"{where}: the chat prompt is {len(ids)} tokens; the model's context "
                         f"of {cfg.max_len} holds {room} before --max_new_tokens="
                         f"{decode.max_new_tokens}: shorten the line or ask for fewer tokens")
      prompts.append(ids)
    end = end_of_turn(template, tokenizer.encode)   # ends the answer, as the server's does
    extra = () if end is None or end == EOS_ID else (end,)
    return [escape_line(text) for text in
            cast(Any, self.task).continue_prompts(self.params, prompts, decode, extra)]

  def _stitched(self, batches: list[pipeline.EvalBatch], lengths: dict[int, int],
                outputs: list[str], decode: DecodeOptions) -> list[str]:
    """`outputs` with each line's output from its windows' per-token scores, each token's
    from the window where it has the most context (one window: the line's own scores)."""
    windows: dict[int, dict[int, np.ndarray]] = {index: {} for index in lengths}
    for batch in batches:
      for record, row in zip(batch.records, self.task.predict_scores(self.params,
                                                                     batch.arrays)):
        windows[record["line"]][record["start"]] = row
    max_len = self.model_config.max_len
    scores = [stitch([windows[i][s] for s in sorted(windows[i])], sorted(windows[i]),
                     lengths[i], max_len) for i in lengths]
    for index, output in zip(lengths, self.task.outputs_from_scores(self.params, scores,
                                                                    decode)):
      outputs[index] = output
    return outputs


def _batches(lines: Iterable[str], size: int) -> Iterable[list[str]]:
  batch = []
  for line in lines:
    batch.append(line)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def predict(workdir: str | None, infile: BinaryIO, outfile: TextIO, beam_size: int | None,
            alpha: float | None, batch_size: int, checkpoint_path: str | None = None,
            too_long: str | None = None, chat: bool = False, **sampling: Any) -> int:
  """Predicts every line of `infile` (bytes, read as serving/line_policy.py says) into
  `outfile`; beam_size/alpha None: the run's own; too_long None: as the training did.
  `sampling`: a language model's decode options (max_new_tokens, temperature, top_k,
  top_p, seed; None: the run's). `chat`: each line is a user's message (the module doc)."""
  predictor = Predictor(workdir, checkpoint_path, too_long)
  template = predictor.chat_template() if chat else None
  decode = predictor.decode_options(beam_size=beam_size, alpha=alpha, **sampling)
  reader = LineReader(infile)
  lines: Iterable[str] = reader
  if getattr(predictor.task, "strict_utf8", False):
    lines = _utf8_only(reader)
  count = 0
  for batch in _batches(lines, batch_size):
    outputs = (predictor.predict_lines(batch, decode, first_line=count + 1) if template is None
               else predictor.chat_lines(batch, template, decode, first_line=count + 1))
    for line in outputs:
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  warning = reader.warning()
  if warning:
    print(warning, file=sys.stderr)
  return count


def _utf8_only(reader: LineReader) -> Iterable[str]:
  """The reader's lines, stopping at the first that is not UTF-8 (a prompt is not guessed
  at: its continuation would continue other characters)."""
  for line in reader:
    if reader.not_utf8:
      raise InputError(f"input line {reader.not_utf8[0]}: not valid UTF-8; convert the "
                       "file to UTF-8")
    yield line


FLAGS = flags.FLAGS
# A language model's sampling flags: (name, kind, help); None leaves the run's decode option.
_SAMPLING_FLAGS = (
    ("max_new_tokens", flags.DEFINE_integer, "Tokens to continue each prompt by (> 0)."),
    ("temperature", flags.DEFINE_float, "Sampling temperature (>= 0; 0: greedy)."),
    ("top_k", flags.DEFINE_integer, "Draw from the k most likely tokens only (> 0)."),
    ("top_p", flags.DEFINE_float, "Draw from the smallest set of tokens holding this share "
     "of the probability, in (0, 1]."),
    ("seed", flags.DEFINE_integer, "Random seed of the draws: the same seed, the same text."))


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
  flags.DEFINE_enum("too_long", None, list(TOO_LONG_CHOICES), "A line longer than the "
                    "model's max_len: 'truncate' does what training did (a classifier keeps "
                    "data.truncate's tokens, a tagger tags overlapping windows; translation "
                    "refuses), 'refuse' stops with an error naming the line. Default: "
                    "truncate (refuse for translation).", **define)
  flags.DEFINE_boolean("chat", False, "Language models with a chat template: each line is "
                       "a user's message, answered in the template's assistant turn.",
                       **define)

  for name, define_flag, help_text in _SAMPLING_FLAGS:
    define_flag(name, None, f"Language models: {help_text} Default: the run's decode.{name}.",
                **define)


def _check_sampling_flags() -> None:
  checks = {"max_new_tokens": (lambda v: v > 0, "> 0"), "temperature": (lambda v: v >= 0, ">= 0"),
            "top_k": (lambda v: v > 0, "> 0"), "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
            "seed": (lambda v: v >= 0, ">= 0")}
  for name, (valid, need) in checks.items():
    value = FLAGS[name].value
    if value is not None and not valid(value):     # `not valid`: NaN fails too
      raise UserError(f"--{name}={value}: must be {need}")


def _check_flags() -> None:
  """The flags, before a model is loaded."""
  if FLAGS.workdir is None and FLAGS.checkpoint is None:
    raise UserError("give --workdir (a training workdir) or --checkpoint (a parameter "
                    "snapshot or checkpoint directory)")
  for name, low in (("batch_size", 1), ("beam_size", 1), ("alpha", 0)):
    value = FLAGS[name].value
    if value is not None and not value >= low:    # `not >=`: NaN fails too
      raise UserError(f"--{name}={value}: must be >= {low}")
  _check_sampling_flags()
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
  # Bytes: the line reader decodes each line itself (serving/line_policy.py, "reading").
  try:
    infile = sys.stdin.buffer if FLAGS.input == "-" else open(FLAGS.input, "rb")
  except OSError as e:
    raise UserError(f"--input={FLAGS.input}: {e.strerror or e}") from None
  args = (FLAGS.beam_size, FLAGS.alpha, FLAGS.batch_size, FLAGS.checkpoint, FLAGS.too_long)
  sampling = {name: FLAGS[name].value for name, _, _ in _SAMPLING_FLAGS}
  sampling["chat"] = FLAGS.chat
  try:
    if FLAGS.output == "-":
      predict(FLAGS.workdir, infile, sys.stdout, *args, **sampling)
    else:   # Replaced only once every line is predicted: a failure keeps the old results.
      with atomic_output(FLAGS.output) as outfile:
        predict(FLAGS.workdir, infile, outfile, *args, **sampling)
  finally:
    if infile is not sys.stdin.buffer:
      infile.close()


if __name__ == "__main__":
  define_flags()
  errors.run(main)
