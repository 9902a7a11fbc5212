"""A corpus: the records of one task by split, from local files or TFDS. What a record
holds, and how a file or a TFDS example becomes one, is the task's (transformer_jax/tasks)."""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol, Sequence

from transformer_jax.errors import MissingFileError, UserError
from transformer_jax.options import DataOptions


class CorpusReading(Protocol):
  """What a corpus needs of a task class (transformer_jax.tasks.Task provides it)."""
  name: str

  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions) -> tuple[
      dict[str, Callable[[], Sequence[dict]]], list[str] | None]: ...


class Corpus:
  """Splits are loaded on first use; `labels` are the class or tag names (None for tasks
  without labels). `origin(split)` says where a split comes from (file names and sizes,
  or a TFDS name), so that a tokenizer trained on it can be recognised later."""

  def __init__(self, loaders: dict[str, Callable[[], Sequence[dict]]],
               labels: list[str] | None, description: str,
               origin: Callable[[str], dict[str, Any]] = lambda split: {"split": split}):
    self.labels, self.description, self.origin = labels, description, origin
    self._loaders, self._loaded = loaders, {}

  def split(self, name: str) -> Sequence[dict]:
    if name not in self._loaders:
      raise UserError(f"{self.description}: no split {name!r}; it has "
                      f"{', '.join(self._loaders)}")
    if name not in self._loaded:
      self._loaded[name] = self._loaders[name]()
    return self._loaded[name]

  @property
  def split_names(self) -> list[str]:
    return list(self._loaders)

  def check_splits(self, names: Sequence[str]) -> None:
    """Reads every split in `names` (a malformed file raises, naming its line) and refuses
    an empty one: before any tokenizer is trained or step run."""
    for name in names:
      if len(self.split(name)) == 0:
        raise UserError(f"no examples in the {name!r} split of {self.description}")


def local_corpus(task: CorpusReading, data: DataOptions) -> Corpus:
  """The task's files in data.dir, named after their split (see each task's local_splits)."""
  directory = data.dir
  if not directory:
    raise UserError("data.dir is empty: set --config.data.dir=PATH to the data folder")
  if not os.path.isdir(directory):
    raise MissingFileError(f"data.dir={directory}: no such directory")
  loaders, labels = task.local_splits(directory, data.split_names, data)

  def origin(split: str) -> dict[str, Any]:
    """The split's files (`{split}.*`) by name and size."""
    return {name: os.path.getsize(os.path.join(directory, name))
            for name in sorted(os.listdir(directory)) if name.startswith(f"{split}.")}
  return Corpus(loaders, labels, f"local {task.name} data in {directory}", origin)
