"""TFDS datasets by name, read through `tfds.data_source` (ArrayRecord, random access, no
TensorFlow). Preparing a dataset needs the internet; where it is missing, opening it fails
with a message that says how to prepare it elsewhere.

Feature names per dataset: translation reads the two language features
(`data.source_language`, `data.target_language`, e.g. wmt14_translate/de-en: de, en);
classification reads ("text", "label") or, for glue/*, ("sentence", "label"); tagging reads
("tokens", "ner") as in conll2003.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from transformer_jax.data.corpus import Corpus, split_names
from transformer_jax.data.readers import DataFormatError

_CLASSIFICATION_FEATURES = {"glue": ("sentence", "label")}
_DEFAULT_CLASSIFICATION_FEATURES = ("text", "label")
_TAGGING_FEATURES = ("tokens", "ner")


class DatasetNotPreparedError(RuntimeError):
  """A TFDS dataset that is not prepared in the data directory and cannot be downloaded."""


def _tfds():
  import tensorflow_datasets as tfds
  # Builders outside tfds' lazily registered `datasets/` package (glue, conll2003, wmt*)
  # register when their package is imported.
  import tensorflow_datasets.text  # noqa: F401
  import tensorflow_datasets.translate  # noqa: F401
  return tfds


def _text(value: Any) -> str:
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


def _open(name: str, split: str, data_config: Any) -> Any:
  tfds = _tfds()
  data_dir = data_config.get("tfds_data_dir") or None
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir,
                            download=bool(data_config.get("download", False)))
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(f"data.name={name!r}: TFDS has no such dataset") from None
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


def _converter(kind: str, name: str, data_config: Any) -> Callable[[dict, int], dict]:
  if kind == "seq2seq":
    src, tgt = data_config.source_language, data_config.target_language
    return lambda ex, i: {"source": _text(ex[src]), "target": _text(ex[tgt])}
  if kind == "classification":
    text, label = _CLASSIFICATION_FEATURES.get(name.split("/")[0],
                                               _DEFAULT_CLASSIFICATION_FEATURES)
    return lambda ex, i: {"text": _text(ex[text]), "label": int(ex[label])}
  words_key, tags_key = _TAGGING_FEATURES

  def tagging(ex: dict, index: int) -> dict:
    words = [_text(w) for w in np.asarray(ex[words_key]).tolist()]
    tags = [int(t) for t in np.asarray(ex[tags_key]).tolist()]
    if len(words) != len(tags):
      raise DataFormatError(f"TFDS {name} example {index}: {len(words)} {words_key} but "
                            f"{len(tags)} {tags_key} tags; they must align one to one")
    return {"words": words, "tags": tags}
  return tagging


def _label_names(kind: str, name: str, data_config: Any) -> list[str] | None:
  """Class or tag names from the dataset's feature description."""
  if kind == "seq2seq":
    return None
  features = _tfds().builder(name, data_dir=data_config.get("tfds_data_dir") or None).info.features
  if kind == "classification":
    key = _CLASSIFICATION_FEATURES.get(name.split("/")[0], _DEFAULT_CLASSIFICATION_FEATURES)[1]
    return list(features[key].names)
  return list(features[_TAGGING_FEATURES[1]].feature.names)


def tfds_corpus(kind: str, data_config: Any) -> Corpus:
  name = data_config.name
  if not name:
    raise ValueError("data.name is empty: give a TFDS dataset, e.g. wmt14_translate/de-en")
  splits = split_names(data_config)
  train = _open(name, data_config.train_split, data_config)  # Fails early if not prepared.
  convert = _converter(kind, name, data_config)

  def loader(split: str) -> Callable[[], Sequence[dict]]:
    source = train if split == data_config.train_split else None
    return lambda: _Records(source or _open(name, split, data_config), convert)
  return Corpus(kind, {s: loader(s) for s in splits}, _label_names(kind, name, data_config),
                f"TFDS {name}")
