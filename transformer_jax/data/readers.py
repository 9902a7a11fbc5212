"""Readers for local text files: parallel text, TSV `sentence<TAB>label`, CoNLL.

Files may be gzipped (`name.gz`) and may start with a UTF-8 byte-order mark (dropped).
Malformed input raises DataFormatError naming the file and the line (1-based), so a broken
row is found without a debugger; a file without a single example is malformed too.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from typing import Callable, Iterator, Sequence

from transformer_jax.errors import MissingFileError, UserError

_BOM = "\ufeff"

_TAG = re.compile(r"^(O|[BI]-\S+)$")
_BREAK = re.compile(r"(\s*<br\s*/?>\s*)+", re.IGNORECASE)   # HTML line breaks, as in IMDB reviews
_DOCSTART = "-DOCSTART-"


class DataFormatError(UserError):
  """A data file that cannot be read as its format requires; names the file and line."""


def find_file(directory: str, stem: str) -> str:
  """`directory/stem`, or `directory/stem.gz` (`stem` may be a path relative to
  `directory`, or absolute); a clear error if neither exists."""
  for name in (stem, stem + ".gz"):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      return path
  if not os.path.isdir(directory):
    raise MissingFileError(f"data directory {directory!r} does not exist "
                           "(set --config.data.dir=PATH)")
  present = ", ".join(sorted(os.listdir(directory))) or "nothing"
  raise MissingFileError(f"no file {stem!r} (or {stem}.gz) in {directory}; it holds: {present}")


def read_lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number, text without the newline) for each line of a UTF-8 file, gzipped or not.
  A byte-order mark at the start is dropped (editors on Windows add one)."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        try:
          text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise DataFormatError(f"{path}:{number}: not valid UTF-8 (byte {raw[e.start]:#04x} "
                                f"at column {e.start + 1})") from None
        if number == 1:
          text = text.removeprefix(_BOM)
        yield number, text.rstrip("\r\n")
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise DataFormatError(f"{path}: not a readable gzip file ({e})") from None
  except OSError as e:    # a truncated or corrupt body, an unreadable file
    raise DataFormatError(f"{path}: cannot be read ({e.strerror or e})") from None


def no_examples(path: str) -> DataFormatError:
  return DataFormatError(f"no examples in {path} (the file is empty or holds only blank "
                         "lines)")


def read_parallel(source_path: str, target_path: str) -> list[dict[str, str]]:
  """Line i of the source file translates line i of the target file."""
  sources = [text.strip() for _, text in read_lines(source_path)]
  targets = [text.strip() for _, text in read_lines(target_path)]
  for path, texts in ((source_path, sources), (target_path, targets)):
    if not any(texts):
      raise no_examples(path)
  if len(sources) != len(targets):
    longer = source_path if len(sources) > len(targets) else target_path
    raise DataFormatError(
        f"{source_path} has {len(sources)} lines but {target_path} has {len(targets)}: line i "
        f"of one must translate line i of the other (first unpaired line: "
        f"{longer}:{min(len(sources), len(targets)) + 1})")
  return [{"source": s, "target": t} for s, t in zip(sources, targets)]


def breaks_to_spaces(text: str) -> str:
  """A run of `<br />` tags (and the spaces around them) becomes one space."""
  return _BREAK.sub(" ", text).strip()


def text_cleaner(br_tags: str) -> Callable[[str], str]:
  """The text transform that config data.br_tags names ("keep" or "space")."""
  return breaks_to_spaces if br_tags == "space" else _unchanged


def _unchanged(text: str) -> str:
  return text


def read_text(path: str, clean: Callable[[str], str] = _unchanged) -> list[str]:
  """One text per line (blank lines skipped), e.g. unlabelled reviews."""
  texts = [clean(text.strip()) for _, text in read_lines(path)]
  texts = [t for t in texts if t]
  if not texts:
    raise no_examples(path)
  return texts


def read_tsv(path: str, label_names: Sequence[str],
             clean: Callable[[str], str] = _unchanged) -> list[dict]:
  """Rows `sentence<TAB>label`, an optional header `sentence<TAB>label` first. A label is
  an index into `label_names` or one of the names. `clean` transforms each sentence."""
  lookup = {name: i for i, name in enumerate(label_names)}
  lookup.update({str(i): i for i in range(len(label_names))})
  records = []
  for number, text in read_lines(path):
    fields = text.split("\t")
    if number == 1 and [f.strip() for f in fields] == ["sentence", "label"]:
      continue
    if not text.strip():
      continue
    if len(fields) != 2:
      raise DataFormatError(f"{path}:{number}: expected 2 tab-separated fields (sentence, "
                            f"label), found {len(fields)}: {text[:80]!r}")
    label = fields[1].strip()
    if label not in lookup:
      raise DataFormatError(f"{path}:{number}: unknown label {label!r}; the labels are "
                            f"{', '.join(sorted(lookup))} (config data.labels)")
    records.append({"text": clean(fields[0].strip()), "label": lookup[label]})
  if not records:
    raise no_examples(path)
  return records


def read_conll(path: str) -> list[dict]:
  """Token-per-line files (`word ... tag`, the tag last, BIO tags), a blank line between
  sentences, `-DOCSTART-` lines skipped. Returns {"words", "tags" (strings), "line"} with
  the line number of each sentence's first token."""
  sentences, words, tags, first = [], [], [], 0

  def flush():
    if words:
      sentences.append({"words": list(words), "tags": list(tags), "line": first})
      words.clear()
      tags.clear()

  for number, text in read_lines(path):
    fields = text.split()
    if not fields or fields[0] == _DOCSTART:
      flush()
      continue
    if len(fields) < 2:
      raise DataFormatError(f"{path}:{number}: expected 'word ... tag' (at least 2 "
                            f"space-separated fields), found {text!r}")
    if not _TAG.match(fields[-1]):
      raise DataFormatError(f"{path}:{number}: {fields[-1]!r} is not a BIO tag (O, B-TYPE, "
                            "I-TYPE); the tag must be the last field")
    if not words:
      first = number
    words.append(fields[0])
    tags.append(fields[-1])
  flush()
  if not sentences:
    raise no_examples(path)
  return sentences


def tag_ids(sentences: list[dict], tag_names: Sequence[str], path: str) -> list[dict]:
  """Replaces tag strings by their index in `tag_names`; an unknown tag names its line."""
  lookup = {name: i for i, name in enumerate(tag_names)}
  records = []
  for sentence in sentences:
    ids = []
    for offset, tag in enumerate(sentence["tags"]):
      if tag not in lookup:
        raise DataFormatError(f"{path}:{sentence['line'] + offset}: unknown tag {tag!r}; the "
                              f"tags are {', '.join(tag_names)}")
      ids.append(lookup[tag])
    records.append({"words": sentence["words"], "tags": ids})
  return records


def tag_names_of(sentences: list[dict]) -> list[str]:
  """The tag set of training data: "O" first, then the others sorted."""
  tags = {tag for sentence in sentences for tag in sentence["tags"]}
  return ["O"] * ("O" in tags) + sorted(tags - {"O"})


def parse_labels(text: str) -> list[str]:
  """`"negative,positive"` -> ["negative", "positive"]; "" -> []."""
  return [name.strip() for name in text.split(",") if name.strip()]
