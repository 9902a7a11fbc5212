"""Hugging Face fast tokenizers (a `tokenizer.json` of the `tokenizers` package, with its
`tokenizer_config.json`) as tokenizers of this project: Llama 2's and TinyLlama's
SentencePiece-derived BPE, Llama 3's and SmolLM's byte-level BPE, and GPT-2's (byte_bpe.py).
They are read from a model (convert --from=hf_llama, hf_gpt2), never trained here; the
`tokenizers` package is in requirements-interop.txt.

Ids. This project fixes PAD 0, BOS 1, EOS 2, UNK 3. The tokenizer's eos_token becomes our
EOS, its bos_token our BOS and its unk_token our UNK; every other id keeps its order after
them:

  ours     PAD 0   BOS 1       EOS 2       UNK 3       4, 5, ...
  theirs   -       bos_token   eos_token   unk_token   the other ids, in order

(Llama 2: <unk> 0, <s> 1, </s> 2, so ours = theirs + 1 past them; GPT-2, whose only special
token is its last id: ours = theirs + 4.) An id the vocabulary has no token for is in
`absent_ids` (PAD always; UNK where there is no unk_token or it is the eos_token; BOS where
the bos_token is the eos_token, `bos_is_eos`, as GPT-2's and SmolLM's <|endoftext|>): the
imported model scores them NO_TOKEN_LOGIT (TransformerConfig.absent_ids, bos_is_eos).

Prompts. `add_bos` says whether the tokenizer starts a text with its BOS: what
tokenizer.json's post-processor adds, as transformers 5 decides it (it ignores
tokenizer_config.json's add_bos_token where there is a tokenizer.json; Llama 2's, TinyLlama's
and Llama 3's files add <s> or <|begin_of_text|>, GPT-2's and SmolLM's nothing). A
post-processor that adds anything else (an EOS after the text) is refused. `encode` adds no
special token (the lm task adds BOS and EOS to training text); `data.tokenizer.prompt_ids`
applies the convention to a prompt. `decode` drops special tokens, as
`decode(skip_special_tokens=True)` does.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence, overload

import numpy as np

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json

FIRST_TOKEN = 4          # our id of the first token that is not BOS, EOS or UNK
_PROBE = "a b"           # a text to see what the post-processor adds around it


def tokenizers_package() -> Any:
  try:
    import tokenizers
  except ImportError:
    raise UserError("Hugging Face tokenizers need the tokenizers package: pip install -r "
                    "requirements-interop.txt") from None
  return tokenizers


@overload
def special_piece(config: dict, name: str, default: str) -> str: ...
@overload
def special_piece(config: dict, name: str, default: None = None) -> str | None: ...
def special_piece(config: dict, name: str, default: str | None = None) -> str | None:
  """tokenizer_config.json's special token `name` ("eos_token"), a string or a serialised
  AddedToken; `default` where it has none."""
  value = config.get(name, default)
  return value["content"] if isinstance(value, dict) else value


class HFTokenizer:
  """A tokenizer.json and its tokenizer_config.json (`config`: its special tokens and
  add_bos_token) in our ids (see the module doc)."""

  kind = "hf_tokenizer"

  def __init__(self, tokenizer_json: str, config: dict[str, Any]):
    self.tokenizer_json, self.config = tokenizer_json, dict(config)
    try:
      self._tokenizer = tokenizers_package().Tokenizer.from_str(tokenizer_json)
    except UserError:
      raise
    except Exception as e:   # the Rust side raises plain Exceptions
      raise UserError(f"not a tokenizer.json of the tokenizers package ({e})") from None
    self.size = self._tokenizer.get_vocab_size(with_added_tokens=True)   # theirs
    self.eos_token = special_piece(self.config, "eos_token")
    if self.eos_token is None:
      raise UserError("tokenizer_config.json names no eos_token: a language model's texts "
                      "end with it")
    self.end_id = self._id_of(self.eos_token, "eos_token")
    specials = {self.end_id: EOS_ID}
    bos = special_piece(self.config, "bos_token")
    self.bos_is_eos = bos is None or bos == self.eos_token
    self.bos_id = self.end_id if self.bos_is_eos else self._id_of(bos, "bos_token")   # theirs
    specials[self.bos_id] = BOS_ID if not self.bos_is_eos else EOS_ID
    unk = special_piece(self.config, "unk_token")
    if unk is not None and self._id_of(unk, "unk_token") not in specials:
      specials[self._id_of(unk, "unk_token")] = UNK_ID
    self.absent_ids = tuple(i for i in (PAD_ID, BOS_ID, UNK_ID) if i not in specials.values())
    self._ours = np.zeros(self.size, np.int32)
    others = np.setdiff1d(np.arange(self.size), list(specials))
    self._ours[others] = FIRST_TOKEN + np.arange(len(others))
    self._ours[list(specials)] = list(specials.values())
    self._theirs = np.full(self.vocab_size, -1, np.int64)
    self._theirs[self._ours] = np.arange(self.size)
    self.add_bos = self._adds_bos()
    self._untrimmed: Any = None   # encode_with_offsets' copy, made on first use

  def _id_of(self, token: str, name: str) -> int:
    found = self._tokenizer.token_to_id(token)
    if found is None:
      raise UserError(f"tokenizer_config.json's {name} {token!r} is not a token of "
                      "tokenizer.json")
    return int(found)

  def _adds_bos(self) -> bool:
    """Whether the tokenizer starts every text with its BOS, as tokenizer.json's
    post-processor says (see the module doc); one that adds anything else is refused."""
    plain = self._tokenizer.encode(_PROBE, add_special_tokens=False).ids
    full = self._tokenizer.encode(_PROBE, add_special_tokens=True).ids
    if full == plain:
      return False
    if full == [self.bos_id] + plain:   # (where BOS is EOS, our BOS reads its row)
      return True
    raise UserError(f"tokenizer.json's post-processor turns the ids {plain} into {full}; "
                    "only a bos_token before them converts")

  @property
  def vocab_size(self) -> int:
    """Our ids: theirs, and PAD, BOS, UNK where they have none."""
    return self.size + len(self.absent_ids)

  # ---------------------------------------------------------------------------- ids
  def to_ours(self, ids: Any) -> np.ndarray:
    """Their ids -> ours."""
    return self._ours[np.asarray(ids, np.int64)]

  def to_theirs(self, ids: Any) -> np.ndarray:
    """Our ids of their tokens -> theirs (the absent ids have none)."""
    ids = np.asarray(ids, np.int64)
    if np.any((ids < 0) | (ids >= self.vocab_size)) or np.any(self._theirs[ids] < 0):
      raise ValueError("ids without a token of the tokenizer (absent ids, or past the "
                       "vocabulary) have no id of theirs")
    return self._theirs[ids]

  # ------------------------------------------------------------------------- text
  def encode(self, text: str) -> list[int]:
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    return self.to_ours(ids).tolist()

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode(text)` and each token's (start, end) characters of `text`. The offsets are
    the model's and pre-tokenizer's, untrimmed: a post-processor that trims them (GPT-2's
    ByteLevel) would leave a whitespace token an empty span, so it is left out here (with
    no special tokens added it changes no id)."""
    if self._untrimmed is None:
      self._untrimmed = tokenizers_package().Tokenizer.from_str(self.tokenizer_json)
      self._untrimmed.post_processor = None
    encoding = self._untrimmed.encode(text, add_special_tokens=False)
    return self.to_ours(encoding.ids).tolist(), [tuple(o) for o in encoding.offsets]

  def decode(self, ids: Sequence[int]) -> str:
    kept = [int(i) for i in ids if int(i) >= FIRST_TOKEN]
    return self._tokenizer.decode(self.to_theirs(kept).tolist(), skip_special_tokens=True)

  def token_text(self, token: int) -> str:
    """One token's own text, a special token's written out ("" for an absent id): what a
    served model reports a token's log-probability under."""
    theirs = self._theirs[token] if 0 <= token < self.vocab_size else -1
    return "" if theirs < 0 else self._tokenizer.decode([int(theirs)],
                                                         skip_special_tokens=False)

  # ------------------------------------------------------------------------ files
  def save(self, path: str) -> None:
    """One JSON file holding tokenizer.json as a string (its bytes kept, so a workdir's
    copy equals the pretrained model's) and tokenizer_config.json."""
    atomic_write_json(path, {"kind": self.kind, "tokenizer_json": self.tokenizer_json,
                             "config": self.config})

  @classmethod
  def load(cls, path: str) -> "HFTokenizer":
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return cls(data["tokenizer_json"], data["config"])

  def write_hf_files(self, directory: str, **config: Any) -> None:
    """tokenizer.json and tokenizer_config.json (with `config`'s fields added), which
    transformers' AutoTokenizer loads as the tokenizer this was read from."""
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
      f.write(self.tokenizer_json)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump({**self.config, **config}, f, indent=2, ensure_ascii=False)
