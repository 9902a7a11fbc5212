"""Tokenizers: SentencePiece trained on the training text, and a word vocabulary for
tagging (one id per word, so tags align to words); Hugging Face's tokenizers (tokenizer.json,
GPT-2's byte-level BPE among them), read from a model, are in hf_tokenizer.py and
byte_bpe.py. All share the interface of the symbol vocabulary: encode, decode, vocab_size,
save, load. `prompt_ids` encodes a language model's prompt (predict, serving).

Ids are fixed project-wide: PAD 0, BOS 1, EOS 2, UNK 3 (transformer_jax.config).
A tokenizer is saved as `NAME.json` in the workdir (SentencePiece adds `NAME.model`, the
model file itself, which `sentencepiece` can load directly). A checkpoint carries the same
files as base64 in JSON (`tokenizer_item`), so it is usable without its workdir.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import os
import re
import tempfile
from typing import Any, Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.data.byte_bpe import ByteLevelBPE
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.vocab import SPECIALS, SymbolVocab
from transformer_jax.errors import MissingFileError, UserError
from transformer_jax.files import atomic_write, atomic_write_json

# The workdir's tokenizer files (the target one only when source and target vocabularies
# are separate); checkpoints store them under the same names.
VOCAB_FILE, TARGET_VOCAB_FILE = "vocab.json", "target_vocab.json"


class SentencePieceTokenizer:
  """Subword tokenizer (SentencePiece unigram or BPE) over raw, untokenized text."""

  kind = "sentencepiece"

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    assert (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id()) == (
        PAD_ID, BOS_ID, EOS_ID, UNK_ID)

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int, model_type: str = "unigram",
            character_coverage: float = 1.0) -> "SentencePieceTokenizer":
    """Trains on `texts` (every one is used). `vocab_size` is an upper bound: a small
    corpus may give fewer pieces."""
    import io
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        hard_vocab_limit=False, input_sentence_size=0, pad_id=PAD_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, unk_id=UNK_ID, pad_piece=SPECIALS[0], bos_piece=SPECIALS[1],
        eos_piece=SPECIALS[2], unk_piece=SPECIALS[3], num_threads=os.cpu_count() or 1,
        minloglevel=2)
    return cls(model.getvalue())

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def pieces(self, text: str) -> list[str]:
    return self._sp.encode(text, out_type=str)

  def save(self, path: str) -> None:
    """`path` (JSON) and the model file next to it, the JSON last: a reader that finds it
    finds the model."""
    model_file = os.path.splitext(os.path.basename(path))[0] + ".model"
    atomic_write(os.path.join(os.path.dirname(path), model_file), self.model_proto)
    atomic_write_json(path, {"kind": self.kind, "model_file": model_file})

  @classmethod
  def load(cls, path: str) -> "SentencePieceTokenizer":
    with open(path) as f:
      model_file = json.load(f).get("model_file")
    # A bare name next to `path`: a JSON file must not make us read files elsewhere.
    if (not isinstance(model_file, str) or os.path.basename(model_file) != model_file
        or model_file in ("", ".", "..")):
      raise UserError(f"{path}: model_file={model_file!r} must be a bare file name in the "
                      "same directory (no directories, no '..')")
    with open(os.path.join(os.path.dirname(path), model_file), "rb") as f:
      return cls(f.read())


_DIGIT = re.compile(r"\d")


def word_shape(word: str) -> str:
  """A coarse shape for a word outside the vocabulary: capitalisation is strong evidence
  for names, digits for numbers."""
  if any(c.isdigit() for c in word):
    return "<unk:0>"
  if word.isupper():
    return "<unk:X>"
  if word[:1].isupper():
    return "<unk:Xx>"
  if word.islower():
    return "<unk:x>"
  return "<unk:.>"


SHAPES = ("<unk:0>", "<unk:X>", "<unk:Xx>", "<unk:x>", "<unk:.>")


class WordVocab:
  """One id per (case-kept) word; digits optionally mapped to 0 ("1996" -> "0000"). Words
  outside the vocabulary map to an id for their shape (see `word_shape`), so a rare name
  still reads as a capitalised unknown word."""

  kind = "words"

  def __init__(self, words: Sequence[str], normalize_digits: bool = True):
    self.words, self.normalize_digits = list(words), normalize_digits
    self._itos = list(SPECIALS) + list(SHAPES) + self.words
    self._ids = {w: i for i, w in enumerate(self._itos)}
    if len(self._ids) != len(self._itos):
      raise UserError("WordVocab: words must be unique and differ from the special tokens")

  @classmethod
  def build(cls, sentences: Iterable[Sequence[str]], min_count: int = 1, max_size: int = 0,
            normalize_digits: bool = True) -> "WordVocab":
    """Words seen at least `min_count` times, most frequent first (at most `max_size` if
    > 0). Words seen fewer times are left to their shape id, which then gets trained."""
    counts = collections.Counter()
    for words in sentences:
      counts.update(cls._normalize(w, normalize_digits) for w in words)
    kept = [w for w, c in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
            if c >= min_count and w not in SPECIALS and w not in SHAPES]
    return cls(kept[:max_size] if max_size > 0 else kept, normalize_digits)

  @staticmethod
  def _normalize(word: str, normalize_digits: bool) -> str:
    return _DIGIT.sub("0", word) if normalize_digits else word

  @property
  def vocab_size(self) -> int:
    return len(self._itos)

  def encode_words(self, words: Sequence[str]) -> list[int]:
    out = []
    for word in words:
      word = self._normalize(word, self.normalize_digits)
      out.append(self._ids.get(word, self._ids[word_shape(word)]))
    return out

  def encode(self, text: str) -> list[int]:
    return self.encode_words(text.split())

  def decode(self, ids: Sequence[int]) -> str:
    return " ".join(self._itos[i] for i in ids if i >= len(SPECIALS))

  def save(self, path: str) -> None:
    atomic_write_json(path, {"kind": self.kind, "words": self.words,
                             "normalize_digits": self.normalize_digits})

  @classmethod
  def load(cls, path: str) -> "WordVocab":
    with open(path) as f:
      data = json.load(f)
    return cls(data["words"], data["normalize_digits"])


class CharVocab:
  """One id per character of the training text, in code point order after the special ids:
  exact for any text made of those characters (whitespace and newlines included, which a
  SentencePiece "char" model normalises away). A character it has not seen encodes to UNK
  and decodes to U+FFFD."""

  kind = "chars"

  def __init__(self, chars: Sequence[str]):
    if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
      raise UserError("CharVocab: characters must be unique single characters")
    self.chars = list(chars)
    self._ids = {c: i + len(SPECIALS) for i, c in enumerate(self.chars)}

  @classmethod
  def build(cls, texts: Iterable[str]) -> "CharVocab":
    seen: set[str] = set()
    for text in texts:
      seen.update(text)
    return cls(sorted(seen))

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.chars)

  def encode(self, text: str) -> list[int]:
    return [self._ids.get(c, UNK_ID) for c in text]

  def unknown(self, text: str) -> list[str]:
    """The distinct characters of `text` outside the vocabulary."""
    return sorted({c for c in text if c not in self._ids})

  def decode(self, ids: Sequence[int]) -> str:
    offset = len(SPECIALS)
    return "".join(self.chars[i - offset] if i >= offset else "\ufffd" if i == UNK_ID else ""
                   for i in (int(i) for i in ids))

  def save(self, path: str) -> None:
    atomic_write_json(path, {"kind": self.kind, "chars": "".join(self.chars)})

  @classmethod
  def load(cls, path: str) -> "CharVocab":
    with open(path) as f:
      return cls(list(json.load(f)["chars"]))


def check_known_characters(tokenizer: Any, text: str) -> None:
  """Refuses a prompt with characters a character vocabulary lacks: a language model never
  saw their unknown id in training, so it would continue noise (other tokenizers pass)."""
  unknown = tokenizer.unknown(text) if isinstance(tokenizer, CharVocab) else []
  if unknown:
    raise UserError(f"characters {''.join(unknown)!r} are not in the model's vocabulary of "
                    f"{tokenizer.vocab_size} ids; leave them out of the prompt")


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
  """The ids a language model continues `text` from, as the model's own tokenizer encodes a
  prompt: BOS first where its texts start with BOS (models trained here, whose training rows
  do; a Hugging Face tokenizer that adds its BOS, as Llama's does), none where they do not
  (GPT-2's, `add_bos` False); an empty prompt is BOS alone (GPT-2's reads <|endoftext|>).
  A character a character vocabulary lacks is refused. The one encoding of a prompt:
  predict and every server use it."""
  check_known_characters(tokenizer, text)
  ids = tokenizer.encode(text)
  return [BOS_ID] + ids if getattr(tokenizer, "add_bos", True) or not ids else ids


def prompt_tail(ids: np.ndarray, length: int, head: int | None = None) -> np.ndarray:
  """A prompt (`prompt_ids`) cut to `length` ids: its last ones, after its first `head`
  (default: its BOS where it starts with one; a long prompt is continued from its end)."""
  if len(ids) <= length:
    return ids
  head = int(ids[0] == BOS_ID) if head is None else head
  return np.concatenate([ids[:head], ids[len(ids) - length + head:]])


class MarianSentencePiece:
  """One side of MarianTokenizer (Hugging Face, OPUS-MT): a SentencePiece model cuts the
  text into pieces and a vocabulary shared by source and target maps pieces to ids (a piece
  outside it is UNK). `pieces[i]` is the piece of id i, in this project's id order (see
  `transformer_jax.convert`). `append_eos` is set on the source side, where MarianTokenizer
  appends </s>; the pipeline appends EOS to targets itself. A leading language code such as
  ">>fra<<" stays one token, as in MarianTokenizer. Decoding drops special ids, as
  `decode(skip_special_tokens=True)` does."""

  kind = "marian_spm"

  def __init__(self, model_proto: bytes, pieces: Sequence[str], append_eos: bool):
    self.model_proto, self.pieces, self.append_eos = model_proto, list(pieces), append_eos
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self._ids = {piece: i for i, piece in enumerate(self.pieces)}
    if len(self._ids) != len(self.pieces):
      raise ValueError("MarianSentencePiece: the vocabulary repeats a piece")

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  def pieces_of(self, text: str) -> list[str]:
    code = []
    end = text.find("<<") if text.startswith(">>") else -1
    if end != -1:
      code, text = [text[:end + 2]], text[end + 2:]
    return code + self._sp.encode(text, out_type=str)

  def encode(self, text: str) -> list[int]:
    ids = [self._ids.get(piece, UNK_ID) for piece in self.pieces_of(text)]
    return ids + [EOS_ID] if self.append_eos else ids

  def decode(self, ids: Sequence[int]) -> str:
    pieces = [self.pieces[i] for i in ids if i >= len(SPECIALS)]
    # Pieces the model does not know (e.g. of the other language) keep their "▁"; replace
    # it as MarianTokenizer does.
    return self._sp.decode_pieces(pieces).replace("\u2581", " ").strip()

  def save(self, path: str) -> None:
    model_file = os.path.splitext(os.path.basename(path))[0] + ".spm"
    with open(os.path.join(os.path.dirname(path), model_file), "wb") as f:
      f.write(self.model_proto)
    with open(path, "w") as f:
      json.dump({"kind": self.kind, "model_file": model_file, "append_eos": self.append_eos,
                 "pieces": self.pieces}, f, ensure_ascii=False)

  @classmethod
  def load(cls, path: str) -> "MarianSentencePiece":
    with open(path) as f:
      data = json.load(f)
    with open(os.path.join(os.path.dirname(path), data["model_file"]), "rb") as f:
      return cls(f.read(), data["pieces"], data["append_eos"])


_KINDS = {c.kind: c for c in (SymbolVocab, SentencePieceTokenizer, WordVocab, CharVocab,
                              MarianSentencePiece, ByteLevelBPE, HFTokenizer)}


def load_tokenizer(path: str):
  """Loads the tokenizer saved at `path` (a workdir's vocab.json), of any kind."""
  if not os.path.exists(path):
    raise MissingFileError(f"no tokenizer at {path}")
  with open(path) as f:
    kind = json.load(f).get("kind")
  if kind not in _KINDS:
    raise UserError(f"{path}: unknown tokenizer kind {kind!r}; known: {sorted(_KINDS)}")
  return _KINDS[kind].load(path)


# ------------------------------------------------------------------- in a checkpoint
@dataclasses.dataclass
class TextAssets:
  """What turns text into ids and back: the tokenizer(s) and the class or tag names."""
  tokenizer: Any
  target_tokenizer: Any
  labels: list[str] | None


def tokenizer_item(tokenizer: Any, target_tokenizer: Any = None,
                   labels: Sequence[str] | None = None) -> dict[str, Any]:
  """The tokenizers as the files they save (base64 in JSON; a SentencePiece tokenizer saves
  two) and the label names: a checkpoint is usable without its workdir."""
  files = {}
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer.save(os.path.join(tmp, VOCAB_FILE))
    if target_tokenizer is not None and target_tokenizer is not tokenizer:
      target_tokenizer.save(os.path.join(tmp, TARGET_VOCAB_FILE))
    for name in sorted(os.listdir(tmp)):
      with open(os.path.join(tmp, name), "rb") as f:
        files[name] = base64.b64encode(f.read()).decode("ascii")
  return {"files": files, "labels": list(labels) if labels is not None else None}


def load_tokenizer_item(item: dict[str, Any]) -> TextAssets:
  """The tokenizers and labels of a `tokenizer_item` (the target tokenizer is the source one
  when none was saved)."""
  with tempfile.TemporaryDirectory() as tmp:
    for name, data in item["files"].items():
      with open(os.path.join(tmp, os.path.basename(name)), "wb") as f:
        f.write(base64.b64decode(data))
    tokenizer = load_tokenizer(os.path.join(tmp, VOCAB_FILE))
    target_path = os.path.join(tmp, TARGET_VOCAB_FILE)
    target = load_tokenizer(target_path) if os.path.exists(target_path) else tokenizer
  return TextAssets(tokenizer, target, item.get("labels"))
