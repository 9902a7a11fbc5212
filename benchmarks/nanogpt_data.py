"""Our Shakespeare files in nanoGPT's character-level data format, to train karpathy/nanoGPT
on the same text as configs/shakespeare_char.py (a side-by-side comparison).

  python -m benchmarks.nanogpt_data --data=../shared/data/shakespeare \
      --out=PATH/TO/nanoGPT/data/shakespeare_ours
  cd PATH/TO/nanoGPT && python train.py config/train_shakespeare_char.py \
      --dataset=shakespeare_ours ...

Reads DATA/train.txt.gz and DATA/val.txt.gz (gzip, UTF-8) and writes into OUT what nanoGPT's
train.py and sample.py read for data/shakespeare_char: train.bin and val.bin (the token ids
as raw np.uint16) and meta.pkl (a pickled dict: vocab_size, itos {id: char}, stoi {char: id}).
The vocabulary is the sorted set of characters of the training file alone, as in nanoGPT.
The format has no unknown id (our "chars" tokenizer has one), so a character of the
validation file that the training file lacks is an error rather than silently mapped.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib

import numpy as np
from absl import flags

from transformer_jax import errors

SPLITS = ("train", "val")
MAX_VOCAB = int(np.iinfo(np.uint16).max) + 1
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program."""
  flags.DEFINE_string("data", None, "Directory with train.txt.gz and val.txt.gz.",
                      required=True)
  flags.DEFINE_string("out", None, "Directory to write train.bin, val.bin and meta.pkl to "
                      "(nanoGPT's data/<dataset>); created if missing.", required=True)


def read_text(path: str) -> str:
  """The whole text of a gzip-compressed UTF-8 file."""
  if not os.path.isfile(path):
    raise errors.MissingFileError(f"{path}: no such file (--data names the directory that "
                                  "holds train.txt.gz and val.txt.gz)")
  try:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise errors.UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                           "decompressed text)") from None
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise errors.UserError(f"{path}: not a complete gzip file ({e})") from None


def vocabulary(text: str, path: str) -> list[str]:
  """The sorted distinct characters of the training text (id = position)."""
  chars = sorted(set(text))
  if not chars:
    raise errors.UserError(f"{path}: empty; the vocabulary comes from the training text")
  if len(chars) > MAX_VOCAB:
    raise errors.UserError(f"{path}: {len(chars)} distinct characters, more than the "
                           f"{MAX_VOCAB} ids of nanoGPT's np.uint16 files")
  return chars


def encode(text: str, chars: list[str], path: str) -> np.ndarray:
  """The ids (np.uint16) of text's characters in the sorted vocabulary `chars`; a character
  outside it is an error naming the first one and where it is."""
  points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  vocab = np.array([ord(c) for c in chars], dtype=np.uint32)
  ids = np.searchsorted(vocab, points)
  known = vocab[np.minimum(ids, len(vocab) - 1)] == points
  if not known.all():
    unknown = sorted(set(text[i] for i in np.flatnonzero(~known)))
    first = int(np.argmin(known))
    raise errors.UserError(
        f"{path}: {int((~known).sum())} characters not in the training text's vocabulary "
        f"({''.join(unknown)!r}; first {text[first]!r} U+{ord(text[first]):04X} at character "
        f"{first}); nanoGPT's character format has no unknown id")
  return ids.astype(np.uint16)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments {argv[1:]}; give --data and --out")
  paths = {split: os.path.join(FLAGS.data, f"{split}.txt.gz") for split in SPLITS}
  texts = {split: read_text(path) for split, path in paths.items()}
  chars = vocabulary(texts["train"], paths["train"])
  ids = {split: encode(texts[split], chars, paths[split]) for split in SPLITS}

  try:
    os.makedirs(FLAGS.out, exist_ok=True)
  except FileExistsError:
    raise errors.UserError(f"--out={FLAGS.out}: exists and is not a directory") from None
  except PermissionError as e:
    raise errors.UserError(f"--out={FLAGS.out}: {e.strerror.lower()} (choose a directory you "
                           "can write)") from None
  for split in SPLITS:
    ids[split].tofile(os.path.join(FLAGS.out, f"{split}.bin"))
  meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
          "stoi": {c: i for i, c in enumerate(chars)}}
  with open(os.path.join(FLAGS.out, "meta.pkl"), "wb") as f:
    pickle.dump(meta, f)

  for split in SPLITS:
    print(f"{split}: {len(texts[split]):,} characters ({paths[split]})")
  print(f"vocab size: {len(chars)} (the training text's characters: {''.join(chars)!r})")
  print(f"wrote train.bin, val.bin (np.uint16) and meta.pkl to {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
