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

import argparse
import datetime
import gzip
import json
import os
import platform
import tempfile
import time
from typing import Callable, Sequence


def _read_lines(path: str, count: int) -> list[str]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return [line.rstrip("\n") for line, _ in zip(f, range(count))]


def _timed(translate: Callable[[list[str]], list[str]], lines: list[str],
           batch_size: int) -> tuple[float, list[str]]:
  batches = [lines[i:i + batch_size] for i in range(0, len(lines), batch_size)]
  for batch in batches:                 # warm-up: compiles, allocates, fills caches
    translate(batch)
  start = time.perf_counter()
  outputs = [out for batch in batches for out in translate(batch)]
  return time.perf_counter() - start, outputs


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--inputs", required=True, help="source lines (.gz read as gzip)")
  parser.add_argument("--lines", type=int, default=500)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                      help="CTranslate2 intra_threads (JAX uses every core)")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  import ctranslate2

  from transformer_jax import convert
  from transformer_jax.config import EOS_ID, UNK_ID
  from transformer_jax.convert import marian
  from transformer_jax.predict import Predictor

  lines = _read_lines(args.inputs, args.lines)
  predictor = Predictor(checkpoint_path=args.checkpoint)
  decode = predictor.decode_options(beam_size=1)
  tokenizer = predictor.task.tokenizer
  target = predictor.task.target_tokenizer
  pieces = marian.pieces(tokenizer)
  pieces[UNK_ID] = "<unk>"
  our_id = {piece: i for i, piece in enumerate(marian.pieces(target))}
  our_id["<unk>"] = UNK_ID

  def predict(batch: list[str]) -> list[str]:
    return predictor.predict_lines(batch, decode)

  results = {"predict (JAX)": _timed(predict, lines, args.batch_size)}
  lengths = {"predict (JAX)": [len(target.encode(out)) for out in results["predict (JAX)"][1]]}
  with tempfile.TemporaryDirectory() as tmp:
    hf, ct2 = os.path.join(tmp, "hf"), os.path.join(tmp, "ct2")
    convert.run(to="hf_marian", checkpoint_path=args.checkpoint, output=hf)
    ctranslate2.converters.TransformersConverter(hf).convert(ct2)
    for compute_type in ("float32", "int8"):
      translator = ctranslate2.Translator(ct2, device="cpu", compute_type=compute_type,
                                          inter_threads=1, intra_threads=args.threads)
      out_lengths: list[int] = []

      def translate(batch: list[str]) -> list[str]:
        tokens = [[pieces[i] for i in tokenizer.encode(line)] for line in batch]
        budget = max(map(len, tokens)) + decode.max_extra_length
        found = translator.translate_batch(tokens, beam_size=1, max_decoding_length=budget,
                                           max_batch_size=args.batch_size)
        ids = [[our_id.get(t, UNK_ID) for t in r.hypotheses[0]] for r in found]
        out_lengths.extend(len(i) for i in ids)
        return [target.decode([i for i in row if i != EOS_ID]) for row in ids]

      name = f"CTranslate2 {compute_type}"
      results[name] = _timed(translate, lines, args.batch_size)
      lengths[name] = out_lengths[len(lines):]          # the timed pass
  reference = results["predict (JAX)"][1]
  report = {
      "date": datetime.date.today().isoformat(), "machine": platform.platform(),
      "cpus": os.cpu_count(), "checkpoint": args.checkpoint, "lines": len(lines),
      "batch_size": args.batch_size, "threads": args.threads,
      "systems": {name: {"seconds": seconds, "sentences_per_s": len(lines) / seconds,
                         "same_as_predict": sum(a == b for a, b in zip(outs, reference)),
                         "mean_output_tokens": sum(lengths[name]) / len(lines)}
                  for name, (seconds, outs) in results.items()}}
  if args.json:
    print(json.dumps(report))
    return
  for name, row in report["systems"].items():
    print(f"{name:22s} {row['sentences_per_s']:8.1f} sentences/s  ({row['seconds']:.2f} s; "
          f"{row['same_as_predict']}/{len(lines)} outputs equal predict's; "
          f"{row['mean_output_tokens']:.1f} tokens per output)")


if __name__ == "__main__":
  main()
