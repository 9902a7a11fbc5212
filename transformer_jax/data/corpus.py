"""A corpus: the records of one task by split, from local files or TFDS. What a record
holds, and how a file or a TFDS example becomes one, is the task's (transformer_jax/tasks)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence


class CorpusReading(Protocol):
  """What a corpus needs of a task class (transformer_jax.tasks.Task provides it)."""
  name: str

  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data_config: Any) -> tuple[
      dict[str, Callable[[], Sequence[dict]]], list[str] | None]: ...


class Corpus:
  """Splits are loaded on first use; `labels` are the class or tag names (None for tasks
  without labels)."""

  def __init__(self, loaders: dict[str, Callable[[], Sequence[dict]]],
               labels: list[str] | None, description: str):
    self.labels, self.description = labels, description
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


def local_corpus(task: CorpusReading, data_config: Any) -> Corpus:
  """The task's files in data.dir, named after their split (see each task's local_splits)."""
  directory = data_config.dir
  if not directory:
    raise ValueError("data.dir is empty: set --config.data.dir=PATH to the data folder")
  loaders, labels = task.local_splits(directory, split_names(data_config), data_config)
  return Corpus(loaders, labels, f"local {task.name} data in {directory}")
