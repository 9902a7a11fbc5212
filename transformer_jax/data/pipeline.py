"""The Grain input pipeline: records -> model batches of static shape.

Training: one global order, the same whatever the number of hosts: all records -> seeded
shuffle, reshuffled every epoch -> featurize -> length limit (too long: drop or truncate;
empty: drop; all counted) -> pack into global batches of [batch, length] rows with segment
ids and positions -> background prefetch -> this host's rows of each global batch. Global
batch s is thus a function of the seed, the records and s alone. The iterator's state
(get_state/set_state, JSON) is the global position: the same on every host, so a run
resumes on any number of hosts (see GLOBAL_ORDER). Every host featurizes and packs the
whole global batch and keeps its rows (the host cost is measured in benchmarks/RESULTS.md).

Evaluation: every example is kept; each goes to the smallest length bucket that holds it
(longer ones are truncated to the largest bucket and counted), one example per row, so
each bucket shape compiles once.

What a record holds and which batch keys it becomes is the task's business (see
transformer_jax/tasks): the pipeline calls the `Featurizing` methods below and never looks
inside an example. Packed rows restart positions at 0 in each sequence; segment ids are 1,
2, ... per sequence in a row and 0 on padding.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Protocol, Sequence

import grain
import numpy as np

from transformer_jax.errors import UserError

# In inputs.py, shared with the flax-free serving loader, which buckets lines the same way.
from transformer_jax.inputs import bucket_for, bucket_lengths
from transformer_jax.options import TOO_LONG_POLICIES, TRUNCATIONS, check_choice

Example = dict[str, np.ndarray]


class Featurizing(Protocol):
  """What the pipeline needs of a task (transformer_jax.tasks.Task provides it)."""

  def featurize(self, record: dict) -> Example: ...
  def is_empty(self, example: Example) -> bool: ...
  def example_length(self, example: Example) -> int: ...
  def truncate(self, example: Example, length: int, keep: str = "head") -> Example: ...
  def pieces(self, example: Example, length: int) -> list[Example]: ...
  def packing_lengths(self, length: int, max_per_row: int | None) -> dict[str, int]: ...
  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]: ...


# ------------------------------------------------------------------------- length limit
@dataclasses.dataclass
class Counts:
  """What the length limit saw: examples read, too long (dropped or truncated), empty
  (dropped)."""
  examples: int = 0
  too_long: int = 0
  empty: int = 0


_COUNTS = "counts"   # Rides along with each example: the running Counts after reading it.


class _LengthLimitIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, task: Featurizing, max_length: int,
               policy: str, keep: str):
    super().__init__(parent)
    self._task, self._max_length, self._policy, self._keep = task, max_length, policy, keep
    self._counts = Counts()
    # policy "split": the pieces of the example being split that are still to come, and
    # the parent's state before that example (the resume point: it is read again).
    self._pieces: list[Example] = []
    self._split_from: dict | None = None

  def __next__(self) -> Example:
    while not self._pieces:
      before = self._parent.get_state() if self._policy == "split" else None
      example = next(self._parent)
      self._counts.examples += 1
      if self._task.is_empty(example):
        self._counts.empty += 1
        continue
      if self._task.example_length(example) <= self._max_length:
        return self._counted(example)
      self._counts.too_long += 1
      if self._policy == "truncate":
        return self._counted(self._task.truncate(example, self._max_length, self._keep))
      if self._policy == "split":
        self._pieces, self._split_from = self._task.pieces(example, self._max_length), before
      # "drop": read on.
    return self._counted(self._pieces.pop(0))

  def _counted(self, example: Example) -> Example:
    return {**example, _COUNTS: np.asarray(dataclasses.astuple(self._counts), np.int64)}

  def get_state(self) -> dict:
    state = {"counts": dataclasses.asdict(self._counts)}
    if self._pieces:    # mid-split: the example is read again and its first pieces skipped
      return {**state, "parent": self._split_from, "pieces_left": len(self._pieces)}
    return {**state, "parent": self._parent.get_state()}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._counts = Counts(**state["counts"])   # already counts the example being split
    self._pieces, self._split_from = [], None
    if state.get("pieces_left"):
      self._split_from = state["parent"]
      example = next(self._parent)
      pieces = self._task.pieces(example, self._max_length)
      self._pieces = pieces[len(pieces) - state["pieces_left"]:]


class _LengthLimit(grain.IterDataset):
  """Drops empty examples and drops, truncates or splits (into consecutive pieces of
  `max_length` tokens: Task.pieces) ones longer than `max_length`, and counts each. Every
  example it passes carries the counts so far (key "counts"), which reach the batch it is
  packed into; the iterator state carries them too, so they survive a resume."""

  def __init__(self, parent: grain.IterDataset, task: Featurizing, max_length: int,
               policy: str, keep: str = "head"):
    super().__init__(parent)
    check_choice("data.", "too_long", policy, TOO_LONG_POLICIES)
    check_choice("data.", "truncate", keep, TRUNCATIONS)
    self._args = (task, max_length, policy, keep)

  def __iter__(self) -> grain.DatasetIterator:
    return _LengthLimitIterator(self._parent.__iter__(), *self._args)


# ------------------------------------------------------------------------------ packing
def _rows(ds: grain.IterDataset, task: Featurizing, length: int, batch_size: int, seed: int,
          max_per_row: int | None, counted: bool = False) -> grain.IterDataset:
  """Packs examples into rows of `length` tokens (at most `max_per_row` examples each; 1
  gives plain padded rows), `batch_size` rows per batch, in model-batch format. `counted`:
  the examples carry the length limit's counts, which stay under "counts"."""
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=task.packing_lengths(length, max_per_row), num_packing_bins=batch_size,
      seed=seed, shuffle_bins=max_per_row != 1, max_sequences_per_bin=max_per_row,
      meta_features=(_COUNTS,) if counted else ())

  def model_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    extra = {_COUNTS: packed[_COUNTS]} if _COUNTS in packed else {}
    return {**task.model_batch(packed, batch_size), **extra}
  return ds.batch(batch_size, batch_fn=_stack).map(model_batch)


def _stack(rows: Sequence[dict]) -> dict[str, np.ndarray]:
  """Stacks packed rows; the per-example counts of all rows reduce to their latest (max)."""
  batch = {k: np.stack([row[k] for row in rows]) for k in rows[0] if k != _COUNTS}
  counts = [c for row in rows for c in row.get(_COUNTS, ())]
  if counts:
    batch[_COUNTS] = np.max(counts, axis=0)
  return batch


# ---------------------------------------------------------------------------- training
# The "order" of a position in the global order. A state without it was written before
# elastic resume: per host, each reading `records[host::hosts]` into its own batches; it
# resumes only on the same number of hosts (see per_host_position).
GLOBAL_ORDER = "global"


def per_host_position(state: dict) -> bool:
  """Whether a training iterator state is a per-host position of the old format (as
  opposed to a global one, or a synthetic stream's index, which every host shares)."""
  return "pipeline" in state and "order" not in state


class TrainIterator:
  """This host's rows of each training batch (dicts of int32 arrays of one static shape),
  endlessly unless `num_epochs` is set. `get_state()` returns the data position as a
  JSON-serializable dict; `set_state()` returns to it; `stats()` counts what the length
  limit did up to the last batch returned.

  `build(per_host)` makes the Grain dataset: the global order, or (per_host=True) the old
  per-host order that an old-format state resumes into."""

  def __init__(self, build: Callable[[bool], grain.IterDataset], rows: slice, hosts: int):
    """rows: this host's rows of a global batch, one of `hosts`."""
    self._build, self._rows, self._hosts = build, rows, hosts
    self._iterator, self._counts, self._per_host = iter(build(False)), Counts(), False

  def __iter__(self) -> "TrainIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    if _COUNTS in batch:
      self._counts = Counts(*(int(c) for c in batch.pop(_COUNTS)))
    if self._per_host:      # already this host's own batch
      return batch
    return {k: v[self._rows] for k, v in batch.items()}

  def get_state(self) -> dict:
    order = {} if self._per_host else {"order": GLOBAL_ORDER}
    return {**order, "pipeline": self._iterator.get_state(),
            "counts": dataclasses.asdict(self._counts)}

  def set_state(self, state: dict) -> None:
    """Returns to a position. An old-format (per-host) one of several hosts continues in
    the old per-host order, which the caller must resume on as many hosts; on one host
    both orders are the same, so it continues in the global order."""
    per_host = per_host_position(state) and self._hosts > 1
    if per_host != self._per_host:
      self._iterator.close()
      self._per_host = per_host
      self._iterator = iter(self._build(per_host))
    self._iterator.set_state(state["pipeline"])
    self._counts = Counts(**state["counts"])

  def close(self) -> None:
    """Stops the background prefetch thread."""
    self._iterator.close()

  def stats(self) -> dict[str, int]:
    return {f"data/{k}": v for k, v in dataclasses.asdict(self._counts).items()}


def train_iterator(records: Sequence[dict], task: Featurizing, *, batch_size: int,
                   max_length: int, seed: int, too_long: str = "drop",
                   truncate: str = "head", pack: bool = True,
                   max_segments: int = 0, shard_index: int = 0, shard_count: int = 1,
                   num_epochs: int | None = None, prefetch: int = 2,
                   read_threads: int = 1) -> TrainIterator:
  """Host `shard_index` of `shard_count`'s rows of each global training batch of
  [batch_size, max_length]: the rows [i * n, (i + 1) * n) with n = batch_size / shard_count.

  pack: several examples per row (at most `max_segments`, or any number if 0; the
  classifier needs a bound as each example is one label slot); False: one per row.
  """
  if not 0 <= shard_index < shard_count:
    raise UserError(f"shard {shard_index} of {shard_count}: need 0 <= index < count")
  if batch_size % shard_count:
    raise UserError(f"batch_size={batch_size} does not split over {shard_count} hosts")
  max_per_row = (max_segments or None) if pack else 1
  rows_per_host = batch_size // shard_count

  def build(per_host: bool) -> grain.IterDataset:
    ds = grain.MapDataset.source(records)
    rows = batch_size
    if per_host:    # The order before elastic resume: hosts shuffle and pack their own shard.
      ds, rows = ds[shard_index::shard_count], rows_per_host
    ds = ds.shuffle(seed).repeat(num_epochs).map(task.featurize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                              prefetch_buffer_size=4 * rows))
    ds = _LengthLimit(ds, task, max_length, too_long, truncate)
    ds = _rows(ds, task, max_length, rows, seed, max_per_row, counted=True)
    if prefetch:
      ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds

  return TrainIterator(build, slice(shard_index * rows_per_host,
                                   (shard_index + 1) * rows_per_host), shard_count)


def window_iterator(count: int, window: Callable[[int], Example], *, batch_size: int,
                    seed: int, shard_index: int = 0, shard_count: int = 1,
                    num_epochs: int | None = None, prefetch: int = 2) -> TrainIterator:
  """Training batches of `count` fixed windows (`window(i)`: a model row, e.g. of a
  language model's token stream), in a seeded order reshuffled every epoch, `batch_size`
  rows each; this host's rows as `train_iterator` gives them."""
  if batch_size % shard_count:
    raise UserError(f"batch_size={batch_size} does not split over {shard_count} hosts")
  rows_per_host = batch_size // shard_count

  def build(per_host: bool) -> grain.IterDataset:
    del per_host   # one global order, as for every state this iterator writes
    ds = grain.MapDataset.range(count).shuffle(seed).repeat(num_epochs).map(window)
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=_stack).to_iter_dataset()
    if prefetch:
      ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds

  return TrainIterator(build, slice(shard_index * rows_per_host,
                                   (shard_index + 1) * rows_per_host), shard_count)


# --------------------------------------------------------------------------- evaluation
class EvalBatch(NamedTuple):
  """A static-shape batch and the records of its real rows (rows past them are padding)."""
  arrays: dict[str, np.ndarray]
  records: list[dict]


def eval_batches(records: Sequence[dict], task: Featurizing, *, batch_size: int,
                 max_length: int, truncate: str = "head",
                 batch_tokens: int = 0) -> tuple[list[EvalBatch], Counts]:
  """Every record, bucketed by length (see module doc); returns the batches and the count
  of examples truncated to `max_length` (keeping the tokens `truncate` says). A bucket's
  batches have `batch_size` rows, or fewer where `batch_tokens` > 0 bounds rows x length
  (long reviews would otherwise make one batch, and its attention, huge)."""
  buckets = bucket_lengths(max_length)
  counts = Counts(examples=len(records))
  grouped: dict[int, list[tuple[dict, Example]]] = {b: [] for b in buckets}
  for record in records:
    example = task.featurize(record)
    length = task.example_length(example)
    if length > max_length:
      counts.too_long += 1
      example = task.truncate(example, max_length, truncate)
    grouped[bucket_for(length, buckets)].append((record, example))
  batches = []
  for length, members in grouped.items():
    rows = min(batch_size, max(1, batch_tokens // length)) if batch_tokens else batch_size
    for start in range(0, len(members), rows):
      chunk = members[start:start + rows]
      ds = grain.MapDataset.source([e for _, e in chunk]).to_iter_dataset(
          grain.ReadOptions(num_threads=0))
      (arrays,) = list(_rows(ds, task, length, rows, 0, max_per_row=1))
      batches.append(EvalBatch(arrays, [r for r, _ in chunk]))
  return batches, counts
