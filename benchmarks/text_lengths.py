"""Token lengths of a text task's examples under the vocabulary its config trains: the
percentiles that choose data.max_length and data.eval_max_length, and the share of each
split longer than them.

  python -m benchmarks.text_lengths --config=configs/imdb.py [--config.data.vocab_size=V]

The tokenizer is trained as the run would train it (on the training split, with the data
group's settings), in memory: nothing is written.
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags
from ml_collections import config_flags

from transformer_jax import errors, tasks
from transformer_jax.data.sources import make_source
from transformer_jax.options import RunOptions

PERCENTILES = (50, 75, 90, 95, 99, 100)


def split_lengths(task_cls, source, split: str) -> np.ndarray:
  """Tokens of each example of `split` (words for a word vocabulary)."""
  lengths = []
  for record in source.records(split):
    text = task_cls.tokenizer_texts(record)[0]
    lengths.append(len(text) if isinstance(text, list) else len(source.tokenizer.encode(text)))
  return np.asarray(lengths)


def main(argv) -> None:
  del argv
  options = RunOptions.from_config(_CONFIG.value)
  task_cls = tasks.task_class(options.train.task)
  started = time.perf_counter()
  source = make_source(task_cls, options.data, options.train.seed)
  print(f"{source.summary} ({time.perf_counter() - started:.0f} s)")
  data = options.data
  header = "split | examples | mean | " + " | ".join(f"p{p}" for p in PERCENTILES)
  print(header + f" | > max_length {data.max_length} | > eval_max_length {data.eval_max_length}")
  for split in data.split_names:
    n = split_lengths(task_cls, source, split)
    cells = " | ".join(f"{int(np.percentile(n, p))}" for p in PERCENTILES)
    print(f"{split} | {len(n):,} | {n.mean():.0f} | {cells} | "
          f"{(n > data.max_length).mean():.1%} | {(n > data.eval_max_length).mean():.1%}")


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", None, "A train.py config file.")
  flags.mark_flag_as_required("config")
  errors.run(main)
