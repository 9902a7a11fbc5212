"""The Grain input pipeline: records -> model batches of static shape.

Training: per-host shard (`records[host::hosts]`, so hosts read disjoint data) -> seeded
shuffle, reshuffled every epoch -> tokenize -> length limit (too long: drop or truncate;
empty: drop; all counted) -> pack into [batch, length] rows with segment ids and positions
-> background prefetch. The iterator's state (get_state/set_state, JSON) is its data
position.

Evaluation: every example is kept; each goes to the smallest length bucket that holds it
(longer ones are truncated to the largest bucket and counted), one example per row, so
each bucket shape compiles once.

Batch keys by task kind (all int32; positions restart at 0 in each sequence, segment ids
are 1, 2, ... per sequence in a row and 0 on padding):
  seq2seq:        src, src_positions, src_segment_ids, tgt_in (BOS + target),
                  tgt_out (target + EOS), tgt_positions, tgt_segment_ids
  classification: tokens, positions, segment_ids, labels (B, K), label_mask (B, K)
                  (slot k of a row holds the label of segment k + 1)
  tagging:        tokens, positions, segment_ids, tags (B, T)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import grain
import numpy as np

from transformer_jax.config import BOS_ID, EOS_ID

SEQUENCES = {"seq2seq": ("src", "tgt_in", "tgt_out"), "classification": ("tokens",),
             "tagging": ("tokens", "tags")}
TOO_LONG_POLICIES = ("drop", "truncate")

Example = dict[str, np.ndarray]


class Featurizer:
  """Record -> one unpadded example: int32 arrays per sequence feature (a scalar label for
  classification)."""

  def __init__(self, kind: str, tokenizer: Any, target_tokenizer: Any | None = None):
    self.kind, self.tokenizer = kind, tokenizer
    self.target_tokenizer = target_tokenizer or tokenizer

  def __call__(self, record: dict) -> Example:
    ids = lambda values: np.asarray(values, np.int32)
    if self.kind == "seq2seq":
      target = self.target_tokenizer.encode(record["target"])
      return {"src": ids(self.tokenizer.encode(record["source"])),
              "tgt_in": ids([BOS_ID] + target), "tgt_out": ids(target + [EOS_ID])}
    if self.kind == "classification":
      return {"tokens": ids(self.tokenizer.encode(record["text"])),
              "label": np.asarray(record["label"], np.int32)}
    return {"tokens": ids(self.tokenizer.encode_words(record["words"])),
            "tags": ids(record["tags"])}


def example_length(kind: str, example: Example) -> int:
  return max(len(example[k]) for k in SEQUENCES[kind])


def is_empty(kind: str, example: Example) -> bool:
  """No input tokens, or (seq2seq) no target tokens: nothing to learn from."""
  if kind == "seq2seq":
    return len(example["src"]) == 0 or len(example["tgt_out"]) == 1
  return len(example["tokens"]) == 0


def truncate(kind: str, example: Example, length: int) -> Example:
  return {k: v[:length] if k in SEQUENCES[kind] else v for k, v in example.items()}


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

  def __init__(self, parent: grain.DatasetIterator, kind: str, max_length: int, policy: str):
    super().__init__(parent)
    self._kind, self._max_length, self._policy = kind, max_length, policy
    self._counts = Counts()

  def __next__(self) -> Example:
    while True:
      example = next(self._parent)
      self._counts.examples += 1
      if is_empty(self._kind, example):
        self._counts.empty += 1
        continue
      if example_length(self._kind, example) > self._max_length:
        self._counts.too_long += 1
        if self._policy == "drop":
          continue
        example = truncate(self._kind, example, self._max_length)
      return {**example, _COUNTS: np.asarray(dataclasses.astuple(self._counts), np.int64)}

  def get_state(self) -> dict:
    return {"parent": self._parent.get_state(), "counts": dataclasses.asdict(self._counts)}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._counts = Counts(**state["counts"])


class _LengthLimit(grain.IterDataset):
  """Drops empty examples and drops or truncates ones longer than `max_length`, and counts
  each. Every example it passes carries the counts so far (key "counts"), which reach the
  batch it is packed into; the iterator state carries them too, so they survive a resume."""

  def __init__(self, parent: grain.IterDataset, kind: str, max_length: int, policy: str):
    super().__init__(parent)
    if policy not in TOO_LONG_POLICIES:
      raise ValueError(f"data.too_long={policy!r}: must be one of {TOO_LONG_POLICIES}")
    self._args = (kind, max_length, policy)

  def __iter__(self) -> grain.DatasetIterator:
    return _LengthLimitIterator(self._parent.__iter__(), *self._args)


# ------------------------------------------------------------------------------ packing
def _rows(ds: grain.IterDataset, kind: str, length: int, batch_size: int, seed: int,
          max_per_row: int | None, counted: bool = False) -> grain.IterDataset:
  """Packs examples into rows of `length` tokens (at most `max_per_row` examples each; 1
  gives plain padded rows), `batch_size` rows per batch, in model-batch format. `counted`:
  the examples carry the length limit's counts."""
  lengths = {k: length for k in SEQUENCES[kind]}
  if kind == "classification":
    lengths["label"] = max_per_row or length  # One label slot per packed example.
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=lengths, num_packing_bins=batch_size, seed=seed,
      shuffle_bins=max_per_row != 1, max_sequences_per_bin=max_per_row,
      meta_features=(_COUNTS,) if counted else ())
  return ds.batch(batch_size, batch_fn=_stack).map(lambda b: model_batch(kind, b, batch_size))


def _stack(rows: Sequence[dict]) -> dict[str, np.ndarray]:
  """Stacks packed rows; the per-example counts of all rows reduce to their latest (max)."""
  batch = {k: np.stack([row[k] for row in rows]) for k in rows[0] if k != _COUNTS}
  counts = [c for row in rows for c in row.get(_COUNTS, ())]
  if counts:
    batch[_COUNTS] = np.max(counts, axis=0)
  return batch


def model_batch(kind: str, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """Grain's packed features ({k}, {k}_positions, {k}_segment_ids) -> the batch keys above,
  padded with empty rows to `rows` (a last, partial batch keeps the static shape). Counts
  from the length limit, if any, stay under "counts"."""
  extra = {_COUNTS: packed[_COUNTS]} if _COUNTS in packed else {}
  def get(key):
    x = packed[key].astype(np.int32)
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  if kind == "seq2seq":
    return {"src": get("src"), "src_positions": get("src_positions"),
            "src_segment_ids": get("src_segment_ids"), "tgt_in": get("tgt_in"),
            "tgt_out": get("tgt_out"), "tgt_positions": get("tgt_in_positions"),
            "tgt_segment_ids": get("tgt_in_segment_ids"), **extra}
  batch = {"tokens": get("tokens"), "positions": get("tokens_positions"),
           "segment_ids": get("tokens_segment_ids"), **extra}
  if kind == "classification":
    batch.update(labels=get("label"), label_mask=get("label_segment_ids") > 0)
  else:
    batch["tags"] = get("tags")
  return batch


# ---------------------------------------------------------------------------- training
class TrainIterator:
  """Training batches (dicts of int32 arrays of one static shape), endlessly unless
  `num_epochs` is set. `get_state()` returns the data position as a JSON-serializable dict;
  `set_state()` returns to it; `stats()` counts what the length limit did up to the last
  batch returned."""

  def __init__(self, dataset: grain.IterDataset):
    self._iterator, self._counts = iter(dataset), Counts()

  def __iter__(self) -> "TrainIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    if _COUNTS in batch:
      self._counts = Counts(*(int(c) for c in batch.pop(_COUNTS)))
    return batch

  def get_state(self) -> dict:
    return {"pipeline": self._iterator.get_state(), "counts": dataclasses.asdict(self._counts)}

  def set_state(self, state: dict) -> None:
    self._iterator.set_state(state["pipeline"])
    self._counts = Counts(**state["counts"])

  def close(self) -> None:
    """Stops the background prefetch thread."""
    self._iterator.close()

  def stats(self) -> dict[str, int]:
    return {f"data/{k}": v for k, v in dataclasses.asdict(self._counts).items()}


def train_iterator(records: Sequence[dict], featurizer: Featurizer, *, batch_size: int,
                   max_length: int, seed: int, too_long: str = "drop", pack: bool = True,
                   max_segments: int = 0, shard_index: int = 0, shard_count: int = 1,
                   num_epochs: int | None = None, prefetch: int = 2,
                   read_threads: int = 1) -> TrainIterator:
  """Training batches of [batch_size, max_length] from this host's shard of `records`.

  pack: several examples per row (at most `max_segments`, or any number if 0; the
  classifier needs a bound as each example is one label slot); False: one per row.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard {shard_index} of {shard_count}: need 0 <= index < count")
  if len(records) < shard_count:
    raise ValueError(f"{len(records)} training examples cannot be split over "
                     f"{shard_count} hosts")
  kind = featurizer.kind
  max_per_row = (max_segments or None) if pack else 1
  if kind == "classification" and max_per_row is None:
    raise ValueError("data.max_segments must be > 0 when packing classification examples")
  ds = grain.MapDataset.source(records)[shard_index::shard_count]
  ds = ds.shuffle(seed).repeat(num_epochs).map(featurizer)
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                            prefetch_buffer_size=4 * batch_size))
  ds = _LengthLimit(ds, kind, max_length, too_long)
  ds = _rows(ds, kind, max_length, batch_size, seed, max_per_row, counted=True)
  if prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
  return TrainIterator(ds)


# --------------------------------------------------------------------------- evaluation
class EvalBatch(NamedTuple):
  """A static-shape batch and the records of its real rows (rows past them are padding)."""
  arrays: dict[str, np.ndarray]
  records: list[dict]


def bucket_lengths(max_length: int, smallest: int = 16) -> list[int]:
  """Powers of two from `smallest` below `max_length`, then `max_length` itself."""
  out, length = [], smallest
  while length < max_length:
    out.append(length)
    length *= 2
  return out + [max_length]


def eval_batches(records: Sequence[dict], featurizer: Featurizer, *, batch_size: int,
                 max_length: int) -> tuple[list[EvalBatch], Counts]:
  """Every record, bucketed by length (see module doc); returns the batches and the count
  of examples truncated to `max_length`."""
  kind, buckets = featurizer.kind, bucket_lengths(max_length)
  counts = Counts(examples=len(records))
  grouped: dict[int, list[tuple[dict, Example]]] = {b: [] for b in buckets}
  for record in records:
    example = featurizer(record)
    length = example_length(kind, example)
    if length > max_length:
      counts.too_long += 1
      example = truncate(kind, example, max_length)
    grouped[next(b for b in buckets if b >= length or b == max_length)].append(
        (record, example))
  batches = []
  for length, members in grouped.items():
    for start in range(0, len(members), batch_size):
      chunk = members[start:start + batch_size]
      ds = grain.MapDataset.source([e for _, e in chunk]).to_iter_dataset(
          grain.ReadOptions(num_threads=0))
      (arrays,) = list(_rows(ds, kind, length, batch_size, 0, max_per_row=1))
      batches.append(EvalBatch(arrays, [r for r, _ in chunk]))
  return batches, counts
