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
from transformer_jax.errors import UserError
from transformer_jax.options import DataOptions


def check_data_for_task(task: Any, data: DataOptions) -> None:
  """What the `data` group asks must suit the task class: synthetic pairs only for a task
  that reads them, a tokenizer kind the task can use."""
  if data.synthetic and tuple(task.record_keys) != RECORD_KEYS:
    raise UserError(f"data.source='synthetic' makes {RECORD_KEYS} pairs, which a "
                    f"{task.name} task cannot read; use data.source=local or tfds")
  data.check_tokenizer_for(task.name, task.tokenizer_kinds)
  if not data.synthetic:
    task.check_data(data)
  if not data.synthetic and data.too_long == "split" and not task.can_split:
    raise UserError(f"data.too_long='split' cuts an example into pieces along its tokens, "
                    f"which a {task.name} task's examples cannot be: use 'truncate' or 'drop'")


def training_widths(data: DataOptions) -> tuple[int, int]:
  """The (source, target) widths in tokens of the training batches the `data` group gives
  (packed rows: both data.max_length; synthetic tasks: their fixed widths)."""
  if data.synthetic:
    return SyntheticData.widths(data.synthetic_task, data.max_length)
  return data.max_length, data.max_length


def training_width(data: DataOptions) -> int:
  """The least model.max_len that can take the training batches (evaluation batches are
  checked once built)."""
  return max(training_widths(data))


def make_source(task: Any, data: DataOptions, seed: int, workdir: str | None = None,
                tokenizers: tuple[Any, Any] | None = None) -> SyntheticData | TextData:
  """The data of the config's `data` group for a task class (transformer_jax.tasks). With
  a workdir, tokenizers are loaded from it (refused if made for other data or settings),
  or taken from `tokenizers` (source, target: a pretrained model's) or trained, and saved
  there."""
  check_data_for_task(task, data)
  if data.synthetic:
    if tokenizers:
      raise UserError("init_from: synthetic data has its own fixed vocabulary; fine-tune "
                      "on text data (data.source=local or tfds)")
    synthetic = SyntheticData(data.synthetic_task, data.min_length, data.max_length, seed)
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      synthetic.vocab.save(os.path.join(workdir, VOCAB_FILE))
    return synthetic
  if data.source == "local":
    corpus = local_corpus(task, data)
  else:
    from transformer_jax.data.tfds_source import tfds_corpus  # Imports TFDS only if used.
    corpus = tfds_corpus(task, data)
  return TextData(task, corpus, data, seed, workdir, tokenizers, check_identity=True)
