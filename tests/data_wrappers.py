"""Wrappers around a data source's training batches, for tests that alter or hold them."""

from __future__ import annotations

from typing import Any, Callable


class BatchesWrapper:
  """A training-batch iterator that delegates to another, checkpointable state included;
  subclasses change what `__next__` does."""

  def __init__(self, batches: Any):
    self.batches = batches

  def __iter__(self) -> "BatchesWrapper":
    return self

  def __next__(self) -> dict:
    return next(self.batches)

  def get_state(self) -> dict:
    return self.batches.get_state()

  def set_state(self, state: dict) -> None:
    self.batches.set_state(state)

  def stats(self) -> dict:
    return self.batches.stats()

  def close(self) -> None:
    self.batches.close()


class SourceWrapper:
  """A data source whose training batches come wrapped by `wrap(batches)`."""

  def __init__(self, source: Any, wrap: Callable[[Any], BatchesWrapper]):
    self._source, self._wrap = source, wrap

  def __getattr__(self, name: str) -> Any:
    return getattr(self._source, name)

  def train_iterator(self, task: Any, batch_size: int) -> BatchesWrapper:
    return self._wrap(self._source.train_iterator(task, batch_size))
