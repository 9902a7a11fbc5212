"""Translation speed of one model three ways on this CPU: `predict` (JAX), and CTranslate2
float32 and int8 reading its `convert --to=hf_marian` export; sentences/s, greedy.

  python -m benchmarks.ctranslate2_speed --checkpoint=DIR --inputs=FILE [--lines=500]
      [--batch_size=64] [--threads=2] [--json]

DIR is a checkpoint or parameter snapshot of a translation model (W/checkpoints/STEP or
W/exports/NAME). Every system gets the same lines, the same source tokens (the model's own
SentencePiece pieces, as `predict` encodes them) and the same output budget (the batch's
source width + the run's decode.max_extra_length), in batches of --batch_size in input order.
Times are line in -> line out (tokenizing and detokenizing included), after an untimed
warm-up pass over the same lines (JAX compiles each bucket shape once). Also reported: how
many outputs equal predict's, and the mean output length in tokens.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import platform
import tempfile
import time
from typing import Callable

from absl import flags

from transformer_jax import errors

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (absl flags are
  global: tests import modules that define --checkpoint, --batch_size and --json)."""
  flags.DEFINE_string("checkpoint", None, "A translation model's checkpoint or parameter "
                      "snapshot (W/checkpoints/STEP or W/exports/NAME).", required=True)
  flags.DEFINE_string("inputs", None, "Source lines (.gz read as gzip).", required=True)
  flags.DEFINE_integer("lines", 500, "How many of the first lines to translate.",
                       lower_bound=1)
  flags.DEFINE_integer("batch_size", 64, "Lines per batch, in input order.", lower_bound=1)
  flags.DEFINE_integer("threads", os.cpu_count() or 1, "CTranslate2 intra_threads (JAX "
                       "uses every core).", lower_bound=1)
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def _read_lines(path: str, count: int) -> list[str]:
  if not os.path.isfile(path):
    raise errors.MissingFileError(f"--inputs={path}: no such file")
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    lines = [line.rstrip("\n") for line, _ in zip(f, range(count))]
  if not lines:
    raise errors.UserError(f"--inputs={path} has no lines")
  return lines


def _timed(translate: Callable[[list[str]], list[str]], lines: list[str],
           batch_size: int) -> tuple[float, list[str]]:
  batches = [lines[i:i + batch_size] for i in range(0, len(lines), batch_size)]
  for batch in batches:                 # warm-up: compiles, allocates, fills caches
    translate(batch)
  start = time.perf_counter()
  outputs = [out for batch in batches for out in translate(batch)]
  return time.perf_counter() - start, outputs


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  lines = _read_lines(FLAGS.inputs, FLAGS.lines)
  try:
    import ctranslate2
  except ImportError as e:
    raise errors.UserError("this benchmark needs CTranslate2: pip install -r "
                           "requirements-interop.txt") from e

  from transformer_jax import convert
  from transformer_jax.config import EOS_ID, UNK_ID
  from transformer_jax.convert import marian
  from transformer_jax.predict import Predictor

  predictor = Predictor(checkpoint_path=FLAGS.checkpoint)
  decode = predictor.decode_options(beam_size=1)
  tokenizer = predictor.task.tokenizer
  target = predictor.task.target_tokenizer
  pieces = marian.pieces(tokenizer)
  pieces[UNK_ID] = "<unk>"
  our_id = {piece: i for i, piece in enumerate(marian.pieces(target))}
  our_id["<unk>"] = UNK_ID

  def predict(batch: list[str]) -> list[str]:
    return predictor.predict_lines(batch, decode)

  results = {"predict (JAX)": _timed(predict, lines, FLAGS.batch_size)}
  lengths = {"predict (JAX)": [len(target.encode(out)) for out in results["predict (JAX)"][1]]}
  with tempfile.TemporaryDirectory() as tmp:
    hf, ct2 = os.path.join(tmp, "hf"), os.path.join(tmp, "ct2")
    convert.run(to="hf_marian", checkpoint_path=FLAGS.checkpoint, output=hf)
    ctranslate2.converters.TransformersConverter(hf).convert(ct2)
    for compute_type in ("float32", "int8"):
      translator = ctranslate2.Translator(ct2, device="cpu", compute_type=compute_type,
                                          inter_threads=1, intra_threads=FLAGS.threads)
      out_lengths: list[int] = []

      def translate(batch: list[str]) -> list[str]:
        tokens = [[pieces[i] for i in tokenizer.encode(line)] for line in batch]
        budget = max(map(len, tokens)) + decode.max_extra_length
        found = translator.translate_batch(tokens, beam_size=1, max_decoding_length=budget,
                                           max_batch_size=FLAGS.batch_size)
        ids = [[our_id.get(t, UNK_ID) for t in r.hypotheses[0]] for r in found]
        out_lengths.extend(len(i) for i in ids)
        return [target.decode([i for i in row if i != EOS_ID]) for row in ids]

      name = f"CTranslate2 {compute_type}"
      results[name] = _timed(translate, lines, FLAGS.batch_size)
      lengths[name] = out_lengths[len(lines):]          # the timed pass
  reference = results["predict (JAX)"][1]
  report = {
      "date": datetime.date.today().isoformat(), "machine": platform.platform(),
      "cpus": os.cpu_count(), "checkpoint": FLAGS.checkpoint, "lines": len(lines),
      "batch_size": FLAGS.batch_size, "threads": FLAGS.threads,
      "systems": {name: {"seconds": seconds, "sentences_per_s": len(lines) / seconds,
                         "same_as_predict": sum(a == b for a, b in zip(outs, reference)),
                         "mean_output_tokens": sum(lengths[name]) / len(lines)}
                  for name, (seconds, outs) in results.items()}}
  if FLAGS.json:
    print(json.dumps(report))
    return
  for name, row in report["systems"].items():
    print(f"{name:22s} {row['sentences_per_s']:8.1f} sentences/s  ({row['seconds']:.2f} s; "
          f"{row['same_as_predict']}/{len(lines)} outputs equal predict's; "
          f"{row['mean_output_tokens']:.1f} tokens per output)")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
