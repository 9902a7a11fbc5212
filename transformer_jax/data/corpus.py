"""A corpus: the examples of one task by split, from local files or TFDS.

Examples are records (dicts) of one of three kinds:
  seq2seq:         {"source": str, "target": str}
  classification:  {"text": str, "label": int}           (index into `labels`)
  tagging:         {"words": list[str], "tags": list[int]} (indices into `labels`)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from transformer_jax.data import readers

KINDS = ("seq2seq", "classification", "tagging")


class Corpus:
  """Splits are loaded on first use; `labels` are the class or tag names (None for
  seq2seq)."""

  def __init__(self, kind: str, loaders: dict[str, Callable[[], Sequence[dict]]],
               labels: list[str] | None, description: str):
    if kind not in KINDS:
      raise ValueError(f"task {kind!r}: must be one of {KINDS}")
    self.kind, self.labels, self.description = kind, labels, description
    self._loaders, self._loaded = loaders, {}

  def split(self, name: str) -> Sequence[dict]:
    if name not in self._loaders:
      raise ValueError(f"{self.description}: no split {name!r}; it has "
                       f"{', '.join(self._loaders)}")
    if name not in self._loaded:
      self._loaded[name] = self._loaders[name]()
    return self._loaded[name]

  @property
  def split_names(self) -> list[str]:
    return list(self._loaders)


def split_names(data_config: Any) -> list[str]:
  """The configured splits, training first: train, eval and (if set) test."""
  names = [data_config.train_split, data_config.eval_split, data_config.get("test_split", "")]
  return list(dict.fromkeys(n for n in names if n))


def parse_labels(text: str) -> list[str]:
  """`"negative,positive"` -> ["negative", "positive"]; "" -> []."""
  return [name.strip() for name in text.split(",") if name.strip()]


def local_corpus(kind: str, data_config: Any) -> Corpus:
  """Files in data.dir named after their split: `{split}.{language}` (seq2seq),
  `{split}.tsv` (classification), `{split}.txt` (tagging), each optionally `.gz`."""
  directory = data_config.dir
  if not directory:
    raise ValueError("data.dir is empty: set --config.data.dir=PATH to the data folder")
  splits = split_names(data_config)
  description = f"local {kind} data in {directory}"
  if kind == "seq2seq":
    src, tgt = data_config.source_language, data_config.target_language
    def load_parallel(split: str) -> Callable[[], Sequence[dict]]:
      return lambda: readers.read_parallel(readers.find_file(directory, f"{split}.{src}"),
                                           readers.find_file(directory, f"{split}.{tgt}"))
    return Corpus(kind, {s: load_parallel(s) for s in splits}, None, description)

  if kind == "classification":
    labels = parse_labels(data_config.labels)
    if len(labels) < 2:
      raise ValueError(f"data.labels={data_config.labels!r}: give the class names, "
                       "comma-separated, in label-index order (e.g. 'negative,positive')")
    def load_tsv(split: str) -> Callable[[], Sequence[dict]]:
      return lambda: readers.read_tsv(readers.find_file(directory, f"{split}.tsv"), labels)
    return Corpus(kind, {s: load_tsv(s) for s in splits}, labels, description)

  # Tagging: the tag set is the configured one, or the training file's.
  paths = {s: readers.find_file(directory, f"{s}.txt") for s in splits}
  sentences = {s: readers.read_conll(paths[s]) for s in splits}
  labels = parse_labels(data_config.labels) or readers.tag_names_of(
      sentences[data_config.train_split])
  def load_conll(split: str) -> Callable[[], Sequence[dict]]:
    return lambda: readers.tag_ids(sentences[split], labels, paths[split])
  return Corpus(kind, {s: load_conll(s) for s in splits}, labels, description)
