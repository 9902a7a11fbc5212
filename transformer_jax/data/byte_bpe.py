"""GPT-2's byte-level BPE (Radford et al., 2019) as a tokenizer of this project, through the
`tokenizers` package (Hugging Face's; requirements-interop.txt). It is read from a model
(convert --from=hf_gpt2), never trained here.

GPT-2's vocabulary has one special token, <|endoftext|>, which ends a text and starts the
next. It is our EOS; a model with this tokenizer sets `bos_is_eos`, so BOS reads the same
embedding row, and PAD, BOS and UNK (which GPT-2 lacks: any text encodes without unknown
tokens) are ids without a token. Every other id keeps its order:

  ours    PAD 0   BOS 1   EOS 2           UNK 3   4, 5, ..., V + 2
  GPT-2   -       -       <|endoftext|>   -       0, 1, ..., V - 1 but <|endoftext|>

(V = 50,257 for GPT-2, whose <|endoftext|> is its last id, 50,256: ours = GPT-2's + 4.)
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from transformer_jax.config import EOS_ID
from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json

END_OF_TEXT = "<|endoftext|>"
_FIRST_TOKEN = 4          # our id of GPT-2's id 0 (after PAD, BOS, EOS, UNK)


def _tokenizers() -> Any:
  try:
    import tokenizers
  except ImportError:
    raise UserError("GPT-2's tokenizer needs the tokenizers package: pip install -r "
                    "requirements-interop.txt") from None
  return tokenizers


class ByteLevelBPE:
  """GPT-2's tokenizer (`tokenizer_json`: Hugging Face's tokenizer.json) in our ids (see the
  module doc). Encoding adds no special token (GPT2Tokenizer adds none either; the task adds
  BOS and EOS); decoding drops them, as `decode(skip_special_tokens=True)` does."""

  kind = "byte_bpe"

  def __init__(self, tokenizer_json: str, end_token: str = END_OF_TEXT):
    self.tokenizer_json, self.end_token = tokenizer_json, end_token
    try:
      self._tokenizer = _tokenizers().Tokenizer.from_str(tokenizer_json)
    except Exception as e:   # the Rust side raises plain Exceptions
      raise UserError(f"not a tokenizer.json of the tokenizers package ({e})") from None
    end = self._tokenizer.token_to_id(end_token)
    if end is None:
      raise UserError(f"the tokenizer has no {end_token} token: GPT-2's byte-level BPE ends "
                      "texts with it")
    self.end_id = int(end)
    self.size = self._tokenizer.get_vocab_size(with_added_tokens=True)   # GPT-2's V

  @classmethod
  def from_files(cls, vocab_file: str, merges_file: str, add_prefix_space: bool = False,
                 end_token: str = END_OF_TEXT) -> "ByteLevelBPE":
    """From vocab.json and merges.txt, built as GPT2Tokenizer builds them."""
    tk = _tokenizers()
    bpe = tk.models.BPE.from_file(vocab_file, merges_file, dropout=None,
                                  continuing_subword_prefix="", end_of_word_suffix="",
                                  fuse_unk=False)
    tokenizer = tk.Tokenizer(bpe)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.add_special_tokens([end_token])
    return cls(tokenizer.to_str(), end_token)

  @property
  def vocab_size(self) -> int:
    return self.size + _FIRST_TOKEN - 1

  # ---------------------------------------------------------------------------- ids
  def to_ours(self, ids: Any) -> np.ndarray:
    """GPT-2's ids -> ours."""
    ids = np.asarray(ids, np.int64)
    return np.where(ids == self.end_id, EOS_ID,
                    ids + _FIRST_TOKEN - (ids > self.end_id)).astype(np.int32)

  def to_theirs(self, ids: Any) -> np.ndarray:
    """Our ids of GPT-2's tokens -> GPT-2's (PAD, BOS and UNK have none)."""
    ids = np.asarray(ids, np.int64)
    if np.any((ids < _FIRST_TOKEN) & (ids != EOS_ID)) or np.any(ids >= self.vocab_size):
      raise ValueError("PAD, BOS, UNK and ids past the vocabulary have no GPT-2 id")
    shifted = ids - _FIRST_TOKEN
    return np.where(ids == EOS_ID, self.end_id, shifted + (shifted >= self.end_id))

  # ------------------------------------------------------------------------- text
  def encode(self, text: str) -> list[int]:
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    return self.to_ours(ids).tolist()

  def decode(self, ids: Sequence[int]) -> str:
    kept = [int(i) for i in ids if int(i) >= _FIRST_TOKEN]
    return self._tokenizer.decode(self.to_theirs(kept).tolist(), skip_special_tokens=True)

  # ------------------------------------------------------------------------ files
  def save(self, path: str) -> None:
    """One JSON file holding tokenizer.json as a string (its bytes kept, so a workdir's
    copy equals the pretrained model's)."""
    atomic_write_json(path, {"kind": self.kind, "end_token": self.end_token,
                             "tokenizer_json": self.tokenizer_json})

  def write_hf_files(self, directory: str) -> None:
    """tokenizer.json, and the BPE's vocab.json and merges.txt, as GPT2Tokenizer saves
    them (Hugging Face's files, in GPT-2's ids)."""
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
      f.write(self.tokenizer_json)
    self._tokenizer.model.save(directory)

  @classmethod
  def load(cls, path: str) -> "ByteLevelBPE":
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return cls(data["tokenizer_json"], data["end_token"])
