"""Host-side input checks: the checked entry point in front of the jitted model.

JAX does not bounds-check gathers and raises nothing: with the embedding lookup's jnp.take, a
token id >= vocab_size reads a row of NaNs (older JAX clamped it to the last row) and a negative
id wraps around to the end of the table, and a position >= max_len does the same in the
positional table. These checks run on NumPy arrays before data reaches the device, which keeps
the jitted step free of host synchronisation.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.errors import UserError


class InputError(UserError):
  """Input data that the model cannot take; the message names the array and the problem."""


def check_token_ids(tokens: Any, vocab_size: int, max_len: int, name: str) -> np.ndarray:
  """Returns `tokens` as an int32 array of shape (batch, length), or raises InputError."""
  array = np.asarray(tokens)
  if array.ndim != 2:
    raise InputError(f"{name}: expected a 2-D array (batch, length), got shape {array.shape}")
  if array.size and not np.issubdtype(array.dtype, np.integer):
    raise InputError(f"{name}: token ids must be integers, got dtype {array.dtype}")
  if array.shape[1] > max_len:
    raise InputError(f"{name}: length {array.shape[1]} exceeds the model's max_len={max_len}; "
                     "truncate or filter the input, or raise max_len in the config")
  bad = (array < 0) | (array >= vocab_size)
  if bad.any():
    row, col = (int(i) for i in np.argwhere(bad)[0])
    raise InputError(f"{name}: token id {int(array[row, col])} at [{row}, {col}] is outside "
                     f"the vocabulary [0, {vocab_size}); {int(bad.sum())} id(s) out of range")
  return array.astype(np.int32)


def check_inputs(config: TransformerConfig, src: Any,
                 tgt: Any | None = None) -> tuple[np.ndarray, np.ndarray | None]:
  """Checks source (and target) token ids against the config's vocabularies and max_len."""
  src = check_token_ids(src, config.vocab_size, config.max_len, "source tokens")
  if tgt is not None:
    tgt = check_token_ids(tgt, config.tgt_vocab_size, config.max_len, "target tokens")
    if tgt.shape[0] != src.shape[0]:
      raise InputError(f"source and target batch sizes differ: {src.shape[0]} vs "
                       f"{tgt.shape[0]}")
  return src, tgt


def character_ids(words: list[str], max_chars: int) -> np.ndarray:
  """(len(words), max_chars) int32: each word's first `max_chars` UTF-8 bytes + 1, then 0
  (the input of the heads' character features). Bytes need no vocabulary to train or save,
  and every word, seen in training or not, keeps its spelling."""
  out = np.zeros((len(words), max_chars), np.int32)
  for i, word in enumerate(words):
    data = np.frombuffer(word.encode("utf-8")[:max_chars], np.uint8)
    out[i, :len(data)] = data.astype(np.int32) + 1
  return out


def bucket_lengths(max_length: int, smallest: int = 16) -> list[int]:
  """Powers of two from `smallest` below `max_length`, then `max_length` itself: the padded
  lengths of evaluation, predict and serving batches (each compiles once)."""
  out, length = [], smallest
  while length < max_length:
    out.append(length)
    length *= 2
  return out + [max_length]


def power_of_two(n: int) -> int:
  """The least power of two >= n: the row counts of predict's and the server's batches
  (each compiles once)."""
  return 1 << (max(n, 1) - 1).bit_length()


def bucket_for(length: int, buckets: Sequence[int]) -> int:
  """The smallest of `buckets` (ascending, from bucket_lengths) that holds `length`
  tokens; the largest for a longer one (which the caller truncates or refuses)."""
  return next((b for b in buckets if b >= length), buckets[-1])
