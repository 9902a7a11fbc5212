"""Synthetic sequence-to-sequence tasks generated in-process (the offline default job).

Each task maps a random string of digit symbols to a target that needs attention over the
whole source, not a copy:
  reverse: 3 1 4 1 5   -> 5 1 4 1 3
  sort:    3 1 4 1 5   -> 1 1 3 4 5
  add:     4 7 + 1 9 5 -> 2 4 2   (decimal addition)
Batch i of a stream is a pure function of (seed, stream, i), so the training iterator's
position is just the index of its next batch (`get_state()` -> {"next_index": i}), and a
resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer_jax import sharding
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.data.pipeline import EvalBatch
from transformer_jax.data.vocab import SymbolVocab
from transformer_jax.errors import UserError
from transformer_jax.options import check_synthetic

RECORD_KEYS = ("source", "target")   # the records it makes (a translation task reads them)
DIGITS = tuple(str(d) for d in range(10))
_STREAMS = {"train": 0, "eval": 1}


def make_vocab() -> SymbolVocab:
  return SymbolVocab(DIGITS + ("+",))


class SyntheticData:
  """Generates (source text, target text) pairs and padded id batches for one synthetic
  task. Offers the trainer's data interface (see data/sources.py): fixed-width batches, no
  packing; the batches are encoded here, so the run's task is not needed to featurize."""

  labels = None
  BATCH_KEYS = ("src", "tgt_in", "tgt_out")    # padded rows: no positions or segment ids

  def __init__(self, task: str, min_length: int, max_length: int, seed: int):
    self.check(task, min_length, max_length)
    self.task, self.min_length, self.max_length, self.seed = task, min_length, max_length, seed
    self.vocab = make_vocab()
    self.tokenizer = self.target_tokenizer = self.vocab
    self.summary = f"synthetic task {task!r}, lengths {min_length}-{max_length}"
    self.src_length, self.tgt_length = self.widths(task, max_length)

  check = staticmethod(check_synthetic)   # The schema owns the task list and its check.

  @staticmethod
  def widths(task: str, max_length: int) -> tuple[int, int]:
    """The fixed array widths of a task's batches: source, and target + EOS."""
    if task == "add":
      return 2 * max_length + 1, max_length + 2
    return max_length, max_length + 1

  def _digits(self, rng: np.random.Generator) -> list[str]:
    n = int(rng.integers(self.min_length, self.max_length + 1))
    return [str(d) for d in rng.integers(0, 10, size=n)]

  def example(self, rng: np.random.Generator) -> tuple[str, str]:
    a = self._digits(rng)
    if self.task == "reverse":
      return " ".join(a), " ".join(reversed(a))
    if self.task == "sort":
      return " ".join(a), " ".join(sorted(a))
    b = self._digits(rng)
    total = int("".join(a)) + int("".join(b))
    return " ".join(a + ["+"] + b), " ".join(str(total))

  def examples(self, stream: str, index: int, count: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng([self.seed, _STREAMS[stream], index])
    return [self.example(rng) for _ in range(count)]

  def encode_batch(self, pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    """Pads to the task's fixed widths: src, tgt_in (BOS + target), tgt_out (target + EOS)."""
    n = len(pairs)
    src = np.full((n, self.src_length), PAD_ID, np.int32)
    tgt_in = np.full((n, self.tgt_length), PAD_ID, np.int32)
    tgt_out = np.full((n, self.tgt_length), PAD_ID, np.int32)
    for row, (source, target) in enumerate(pairs):
      s, t = self.vocab.encode(source), self.vocab.encode(target)
      src[row, : len(s)] = s
      tgt_in[row, : len(t) + 1] = [BOS_ID] + t
      tgt_out[row, : len(t) + 1] = t + [EOS_ID]
    return dict(zip(self.BATCH_KEYS, (src, tgt_in, tgt_out)))

  def batch(self, stream: str, index: int, batch_size: int) -> dict[str, np.ndarray]:
    return self.encode_batch(self.examples(stream, index, batch_size))

  def eval_examples(self, count: int) -> list[tuple[str, str]]:
    """Held-out pairs, from a random stream separate from the training stream."""
    return self.examples("eval", 0, count)

  def train_iterator(self, task: Any, batch_size: int) -> "SyntheticBatches":
    """The endless training stream, this host's rows of each global batch of `batch_size`
    (every host generates the same batch, so the run does not depend on the host count)."""
    return SyntheticBatches(self, batch_size)

  def eval_batches(self, task: Any, split: str, batch_size: int, limit: int) -> list[EvalBatch]:
    """`limit` held-out pairs in batches of `batch_size` rows (the last padded)."""
    if split != "eval":
      raise UserError(f"synthetic data has one held-out split, 'eval', not {split!r}")
    pairs = self.eval_examples(limit)
    batches = []
    for start in range(0, len(pairs), batch_size):
      chunk = pairs[start:start + batch_size]
      arrays = self.encode_batch(chunk + [("", "")] * (batch_size - len(chunk)))
      batches.append(EvalBatch(arrays, [dict(zip(RECORD_KEYS, pair)) for pair in chunk]))
    return batches


class SyntheticBatches:
  """Iterator over a task's training batches whose state is the index of the next batch,
  with the `get_state()` / `set_state(state)` interface of Grain's DatasetIterator."""

  def __init__(self, task: SyntheticData, batch_size: int, start: int = 0):
    self.task, self.batch_size = task, batch_size
    self.rows = sharding.local_rows(batch_size)
    self.set_state({"next_index": start})

  def __iter__(self) -> "SyntheticBatches":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.task.batch("train", self._next_index, self.batch_size)
    self._next_index += 1
    return {k: v[self.rows] for k, v in batch.items()}

  def get_state(self) -> dict[str, Any]:
    return {"next_index": self._next_index}

  def set_state(self, state: dict[str, Any]) -> None:
    valid = (isinstance(state, dict) and set(state) == {"next_index"}
             and isinstance(state["next_index"], int) and state["next_index"] >= 0)
    if not valid:
      raise UserError(f"synthetic data iterator state {state!r}: expected "
                      "{'next_index': <int >= 0>}")
    self._next_index = state["next_index"]

  def stats(self) -> dict[str, int]:
    return {}   # Generated examples are never too long or empty.

  def close(self) -> None:
    pass
