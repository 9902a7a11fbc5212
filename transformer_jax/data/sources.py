"""Builds the task data named by the config: synthetic tasks, local files or TFDS.

Every kind offers the same interface to the trainer: `kind` ("seq2seq", "classification",
"tagging"), `tokenizer` and `target_tokenizer`, `labels` (class or tag names, or None),
`train_iterator(batch_size)` (batches of static shape; the iterator has get_state/set_state
and stats) and `eval_batches(split, batch_size, limit)` (static-shape batches with the
records of their rows).
"""

from __future__ import annotations

import os
from typing import Any

from transformer_jax.data.corpus import local_corpus
from transformer_jax.data.synthetic import SyntheticTask
from transformer_jax.data.text_data import VOCAB_FILE, TextData

SOURCES = ("synthetic", "local", "tfds")


def make_source(config: Any, workdir: str | None = None) -> SyntheticTask | TextData:
  """`config` is the whole run config (its `task`, `seed` and `data` group). With a
  workdir, tokenizers are loaded from it or trained and saved there."""
  data = config.data
  kind = config.get("task", "seq2seq")
  if data.source == "synthetic":
    if kind != "seq2seq":
      raise ValueError(f"task={kind!r}: synthetic data is seq2seq only")
    task = SyntheticTask(data.task, data.min_length, data.max_length, config.seed)
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      task.vocab.save(os.path.join(workdir, VOCAB_FILE))
    return task
  if data.source == "local":
    corpus = local_corpus(kind, data)
  elif data.source == "tfds":
    from transformer_jax.data.tfds_source import tfds_corpus  # Imports TFDS only if used.
    corpus = tfds_corpus(kind, data)
  else:
    raise ValueError(f"data.source={data.source!r}: must be one of {SOURCES}")
  return TextData(corpus, data, config.seed, workdir)
