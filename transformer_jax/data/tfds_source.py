"""TFDS datasets by name, read through `tfds.data_source` (ArrayRecord, random access, no
TensorFlow). Preparing a dataset needs the internet; where it is missing, opening it fails
with a message that says how to prepare it elsewhere.

Which features a task reads, and how, is the task's `tfds_converter` (e.g. translation reads
`data.source_language` and `data.target_language`; classification ("text", "label") or, for
glue/*, ("sentence", "label"); tagging ("tokens", "ner") as in conll2003).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from transformer_jax.data.corpus import Corpus
from transformer_jax.errors import UserError
from transformer_jax.options import DataOptions


class TfdsReading(Protocol):
  """What reading TFDS needs of a task class (transformer_jax.tasks.Task provides it)."""
  name: str
  needs_labels: bool

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]: ...

  @classmethod
  def tfds_labels(cls, features: Any, name: str) -> list[str] | None: ...


class DatasetNotPreparedError(UserError, RuntimeError):
  """A TFDS dataset that is not prepared in the data directory and cannot be downloaded."""


def _tfds():
  import tensorflow_datasets as tfds

  # Builders outside tfds' lazily registered `datasets/` package (glue, conll2003, wmt*)
  # register when their package is imported.
  import tensorflow_datasets.text  # noqa: F401
  import tensorflow_datasets.translate  # noqa: F401
  return tfds


def feature_text(value: Any) -> str:
  """A TFDS text feature (bytes, str or a 0-d array) as str."""
  if isinstance(value, np.ndarray):
    value = value.item()
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class _Records(Sequence):
  """A random-access view of a TFDS data source that converts each example to a record."""

  def __init__(self, source: Any, convert: Callable[[dict, int], dict]):
    self._source, self._convert = source, convert

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < len(self._source):
      raise IndexError(index)
    return self._convert(self._source[index], index)


def _open(name: str, split: str, data: DataOptions) -> Any:
  tfds = _tfds()
  data_dir = data.tfds_data_dir or None
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir,
                            download=bool(data.download))
  except tfds.core.registered.DatasetNotFoundError:
    raise UserError(f"data.name={name!r}: TFDS has no such dataset") from None
  except Exception as e:  # tfds raises many types here; all mean "cannot read it".
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = data_dir or "the default TFDS directory (~/tensorflow_datasets)"
    raise DatasetNotPreparedError(
        f"TFDS dataset {name!r} (split {split!r}) cannot be opened from {where}: {reason}. "
        f"It must be prepared in ArrayRecord format, which needs the internet: run "
        f"`tfds build {name} --file_format=array_record --data_dir=DIR` on a machine that "
        f"has it, copy DIR here and pass --config.data.tfds_data_dir=DIR (or set "
        f"--config.data.download=True where downloads work). The same data as local files: "
        f"--config.data.source=local --config.data.dir=PATH.") from e


def _label_names(task: TfdsReading, name: str, data: DataOptions) -> list[str] | None:
  """Class or tag names from the dataset's feature description."""
  if not task.needs_labels:
    return None
  builder = _tfds().builder(name, data_dir=data.tfds_data_dir or None)
  return task.tfds_labels(builder.info.features, name)


def tfds_corpus(task: TfdsReading, data: DataOptions) -> Corpus:
  name = data.name
  if not name:
    raise UserError("data.name is empty: give a TFDS dataset, e.g. wmt14_translate/de-en")
  splits = data.split_names
  train = _open(name, data.train_split, data)  # Fails early if not prepared.
  convert = task.tfds_converter(name, data)

  def loader(split: str) -> Callable[[], Sequence[dict]]:
    source = train if split == data.train_split else None
    return lambda: _Records(source or _open(name, split, data), convert)
  return Corpus({s: loader(s) for s in splits}, _label_names(task, name, data),
                f"TFDS {name}", origin=lambda split: {"tfds": name, "split": split,
                                                      "examples": len(train)})
