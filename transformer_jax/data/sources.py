"""Builds the data a config names: synthetic tasks, local files or TFDS.

Every source offers the same interface to the trainer: `tokenizer` and `target_tokenizer`,
`labels` (class or tag names, or None), `summary`, `train_iterator(task, batch_size)`
(batches of static shape; the iterator has get_state/set_state and stats) and
`eval_batches(task, split, batch_size, limit)` (static-shape batches with the records of
their rows). `task` is the run's task (transformer_jax.tasks): it featurizes the records.
"""

from __future__ import annotations

import os
from typing import Any

from transformer_jax.data.corpus import local_corpus
from transformer_jax.data.synthetic import RECORD_KEYS, SyntheticData
from transformer_jax.data.text_data import TextData
from transformer_jax.data.tokenizer import VOCAB_FILE

SOURCES = ("synthetic", "local", "tfds")


def make_source(task: Any, data: Any, seed: int, workdir: str | None = None,
                tokenizers: tuple[Any, Any] | None = None) -> SyntheticData | TextData:
  """The data of the config's `data` group for a task class (transformer_jax.tasks). With
  a workdir, tokenizers are loaded from it, or taken from `tokenizers` (source, target: a
  pretrained model's) or trained, and saved there."""
  if data.source == "synthetic":
    if tokenizers:
      raise ValueError("init_from: synthetic data has its own fixed vocabulary; fine-tune "
                       "on text data (data.source=local or tfds)")
    if tuple(task.record_keys) != RECORD_KEYS:
      raise ValueError(f"data.source='synthetic' makes {RECORD_KEYS} pairs, which a "
                       f"{task.name} task cannot read; use data.source=local or tfds")
    synthetic = SyntheticData(data.synthetic_task, data.min_length, data.max_length, seed)
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      synthetic.vocab.save(os.path.join(workdir, VOCAB_FILE))
    return synthetic
  if data.source == "local":
    corpus = local_corpus(task, data)
  elif data.source == "tfds":
    from transformer_jax.data.tfds_source import tfds_corpus  # Imports TFDS only if used.
    corpus = tfds_corpus(task, data)
  else:
    raise ValueError(f"data.source={data.source!r}: must be one of {SOURCES}")
  return TextData(task, corpus, data, seed, workdir, tokenizers)
