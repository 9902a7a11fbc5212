"""A symbol vocabulary for whitespace-separated symbols (synthetic tasks).

Ids 0-3 are PAD, BOS, EOS, UNK (see transformer_jax.config); symbols follow. It shares the
interface of the SentencePiece tokenizer: encode, decode, vocab_size, save, load.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)


def strip_special(ids: Any, end_ids: Sequence[int] = ()) -> list[int]:
  """Token ids up to (not including) the first EOS (or other `end_ids`: a language model's
  further end tokens), without padding."""
  out = []
  for token in np.asarray(ids).tolist():
    if token == EOS_ID or token in end_ids:
      break
    if token != PAD_ID:
      out.append(token)
  return out


class UnknownSymbolError(UserError):
  """Input text holds a symbol the vocabulary does not know."""


class SymbolVocab:
  """Maps whitespace-separated symbols to ids and back."""

  kind = "symbols"

  def __init__(self, symbols: Sequence[str]):
    if len(set(symbols)) != len(symbols):
      raise ValueError("SymbolVocab: symbols must be unique")
    self.symbols = list(symbols)
    self._ids = {s: i + len(SPECIALS) for i, s in enumerate(self.symbols)}

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.symbols)

  def encode(self, text: str) -> list[int]:
    ids = []
    for symbol in text.split():
      if symbol not in self._ids:
        raise UnknownSymbolError(f"unknown symbol {symbol!r}; the vocabulary has "
                                 f"{' '.join(self.symbols)}")
      ids.append(self._ids[symbol])
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    offset = len(SPECIALS)
    return " ".join(self.symbols[i - offset] for i in ids if i >= offset)

  def save(self, path: str) -> None:
    atomic_write_json(path, {"kind": self.kind, "symbols": self.symbols})

  @classmethod
  def load(cls, path: str) -> "SymbolVocab":
    with open(path) as f:
      data = json.load(f)
    return cls(data["symbols"])

