"""What inference does to the lines users give it. `predict` and the server read, clean and
fit each line to the model the way the model's training did, with the functions here, so a
served model answers as predict does whatever the line holds.

  reading   predict reads its input as bytes. A line ends at LF ("\\n"); a CR before it is
            dropped (Windows line ends). A file that starts with a UTF-16 byte-order mark is
            read as UTF-16; otherwise each line as UTF-8, and a line that is not UTF-8
            (scraped Windows-1252 or Latin-1 text) as Windows-1252: predict answers it and
            warns once, naming the first such line. Bytes Windows-1252 lacks read as U+FFFD.
  cleaning  (`clean_text`, predict and the server alike) a byte-order mark (U+FEFF) anywhere
            is dropped; tabs, other C0 control characters (NUL, a lone CR, ...), DEL and
            Unicode line and paragraph separators become spaces (C1 characters stay, as
            in the training text); a lone surrogate (JSON's "\\ud800") becomes U+FFFD;
            the ends are stripped. A classifier trained with data.br_tags="space" reads
            `<br />` tags as spaces, as its training did. Other markup stays text, as it
            was in the training data.
  escapes   (a language model's prompts and continuations) `\\n` in a line stands for a
            newline and `\\\\` for a backslash, read before cleaning; outputs are written
            the same way, one line each.
  blank     a line with no input tokens gets an empty output, without a model call (a
            language model continues an empty prompt from BOS).
  too long  `LinePolicy.too_long`, what the model's training did with longer inputs: a
            classifier keeps the tokens data.truncate names ("head", "tail", "head_tail") at
            the model's max_len; a tagger runs the line as overlapping windows, takes each
            word's scores from the window where it has the most context (`window_starts`,
            `stitch`) and decodes the whole line once; translation refuses the line, naming it,
            since a cut source changes its translation. `--too_long=refuse` (predict and
            serve) refuses such lines for every task.

A served artifact's manifest keeps the policy ("lines"); it is flax-free, as serving is.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from transformer_jax.data.readers import breaks_to_spaces
from transformer_jax.errors import UserError
from transformer_jax.inputs import InputError
from transformer_jax.options import TRUNCATIONS

TOO_LONG_CHOICES = ("refuse", "truncate")   # the --too_long flag of predict and serve
ACTIONS = ("refuse", "truncate", "window")  # what a task does with a longer line
# The tokens a truncation to `length` keeps from the start; the rest come from the end.
_HEAD = {"head": lambda length: length, "tail": lambda length: 0,
         "head_tail": lambda length: length // 4}
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
# C0 control characters (tab, NUL, CR, ...), DEL, Unicode line and paragraph separators:
# spaces. C1 ones (U+0080-U+009F) stay: 86 of IMDB's 2,500 dev reviews hold some
# (Windows-1252 dashes read as Latin-1), and its tokenizer learns them as pieces.
_SPACES = re.compile("[\x00-\x1f\x7f\u2028\u2029]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED = re.compile(r"\\(\\|n|r)")
_UNESCAPED = {"n": "\n", "r": "\r", "\\": "\\"}


def kept_tokens(x: np.ndarray, length: int, keep: str) -> np.ndarray:
  """The `length` entries of x's first axis that truncation keeps: the first ones ("head"),
  the last ("tail"), or a quarter from the start and the rest from the end ("head_tail")."""
  if len(x) <= length:
    return x
  head = _HEAD[keep](length)
  return np.concatenate([x[:head], x[len(x) - (length - head):]])


def kept_words(keep: str, length: int) -> str:
  """Which tokens `kept_tokens` keeps, in words: "the first 128 and the last 384 tokens"."""
  head = _HEAD[keep](length)
  parts = [f"the first {head}"] * bool(head) + [f"the last {length - head}"] * bool(length - head)
  return " and ".join(parts) + " tokens"


def escape_line(text: str) -> str:
  """A text as one output line: a backslash as `\\\\`, a newline as `\\n`, a carriage
  return as `\\r` (a reader that splits lines on it too keeps the line whole)."""
  return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def unescape_line(line: str) -> str:
  """`escape_line` undone: `\\n`, `\\r` and `\\\\` (other text as it is)."""
  return _ESCAPED.sub(lambda m: _UNESCAPED[m.group(1)], line)


def clean_text(text: str) -> str:
  """The line as every task reads it (see the module doc, "cleaning")."""
  text = _SPACES.sub(" ", text.replace("\ufeff", ""))
  return _SURROGATE.sub("\ufffd", text).strip()


@dataclasses.dataclass(frozen=True)
class LinePolicy:
  """What inference does to a line as the model's training did (see the module doc)."""
  too_long: str = "refuse"   # a line over max_len tokens: truncate | window | refuse
  truncate: str = "head"     # the tokens a truncated line keeps (data.truncate)
  br_tags: str = "keep"      # "space": `<br />` tags read as spaces (data.br_tags)
  refuse: bool = False       # --too_long=refuse: longer lines refused all the same
  escapes: bool = False      # `\\n` and `\\\\` in a line: a newline and a backslash (lm)

  def __post_init__(self) -> None:
    for name, value, choices in (("too_long", self.too_long, ACTIONS),
                                 ("truncate", self.truncate, TRUNCATIONS),
                                 ("br_tags", self.br_tags, ("keep", "space"))):
      if value not in choices:
        raise UserError(f"line policy {name}={value!r}: must be one of {choices}")

  def manifest(self) -> dict[str, Any]:
    """The policy as a served artifact's manifest keeps it (the model's; no flag)."""
    return {"too_long": self.too_long, "truncate": self.truncate, "br_tags": self.br_tags,
            "escapes": self.escapes}

  @classmethod
  def from_manifest(cls, value: Any) -> "LinePolicy":
    """The policy a manifest's "lines" holds; none (an older artifact): refuse long lines,
    keep markup, as such artifacts did."""
    if value is None:
      return cls()
    if not isinstance(value, dict):
      raise UserError(f'"lines" must be an object, got {value!r}')
    return cls(**{k: v for k, v in value.items()
                  if k in ("too_long", "truncate", "br_tags", "escapes")})

  def choose(self, choice: str | None, task: str) -> "LinePolicy":
    """The policy under the flag --too_long=`choice` (None: as the training did)."""
    if choice is None:
      return self
    if choice not in TOO_LONG_CHOICES:
      raise UserError(f"--too_long={choice}: must be one of {TOO_LONG_CHOICES}")
    if choice == "truncate" and self.too_long == "refuse":
      raise UserError(f"--too_long=truncate: a {task} model refuses lines longer than its "
                      "max_len (a cut source changes the whole output); shorten or split "
                      "those lines, or leave --too_long out")
    return dataclasses.replace(self, refuse=choice == "refuse")

  def clean(self, line: str) -> str:
    """The text the model reads for `line` (see the module doc, "cleaning")."""
    if self.escapes:   # a newline stays one: the text is the model's, whitespace and all
      return _SURROGATE.sub("\ufffd", unescape_line(line.replace("\ufeff", "")))
    text = clean_text(line)
    return breaks_to_spaces(text) if self.br_tags == "space" else text

  def action(self, length: int, max_len: int, where: str) -> str:
    """What happens to a line of `length` tokens: "whole" when it fits, else "truncate" or
    "window"; InputError naming the line (`where`) when it is refused."""
    if length <= max_len:
      return "whole"
    if self.too_long != "refuse" and not self.refuse:
      return self.too_long
    fix = "shorten or split it"
    if self.too_long != "refuse":   # refused by --too_long=refuse
      done = (f"keeps {kept_words(self.truncate, max_len)}" if self.too_long == "truncate"
              else "tags it in overlapping windows")
      fix += f", or leave out --too_long=refuse (the model {done}, as its training did)"
    raise InputError(f"{where}: {length} tokens exceed the model's max_len={max_len}; {fix}")


# ------------------------------------------------------------------------------ windows
def window_starts(total: int, length: int) -> list[int]:
  """Where the windows of `length` tokens over a line of `total` start: every length // 2
  tokens, the last one ending at the line's end; one window for a line that fits."""
  if total <= length:
    return [0]
  return list(range(0, total - length, max(1, length // 2))) + [total - length]


def best_windows(total: int, starts: Sequence[int], length: int) -> np.ndarray:
  """For each of the `total` tokens, the window (an index into `starts`) where it has the
  most context: the largest distance to an edge of the window that cuts the line (an edge
  at the line's own start or end cuts nothing); the first such window on a tie."""
  best = np.zeros(total, np.int64)
  context = np.full(total, -1)
  for index, start in enumerate(starts):
    end = min(start + length, total)
    at = np.arange(start, end)
    left = at - start if start > 0 else np.full(len(at), total)
    right = end - 1 - at if end < total else np.full(len(at), total)
    mine = np.minimum(left, right)
    better = mine > context[start:end]
    best[at[better]] = index
    context[at[better]] = mine[better]
  return best


def stitch(rows: Sequence[np.ndarray], starts: Sequence[int], total: int,
           length: int) -> np.ndarray:
  """One (total, ...) array from the windows' per-token rows (rows[w]: the outputs of the
  tokens of window w, which starts at starts[w]): each token's from its best window."""
  chosen = best_windows(total, starts, length)
  offsets = np.cumsum([0] + [len(r) for r in rows[:-1]])
  index = offsets[chosen] + np.arange(total) - np.asarray(starts)[chosen]
  return np.concatenate(rows)[index]


# ------------------------------------------------------------------------------ reading
class LineReader:
  """The lines of a byte stream as text (see the module doc, "reading"), without their
  line ends. `not_utf8` holds the numbers of the lines read as Windows-1252."""

  def __init__(self, stream: BinaryIO):
    self._stream = stream
    self.not_utf8: list[int] = []

  def __iter__(self) -> Iterator[str]:
    first = self._stream.readline()
    if first.startswith(_UTF16_BOMS):   # the whole file in UTF-16 (Windows "Unicode")
      text = (first + self._stream.read()).decode("utf-16", errors="replace")
      if not text:
        return
      yield from (line.removesuffix("\r") for line in text.removesuffix("\n").split("\n"))
      return
    if not first:
      return
    yield self._decode(1, first)
    for number, raw in enumerate(self._stream, 2):
      yield self._decode(number, raw)

  def _decode(self, number: int, raw: bytes) -> str:
    raw = raw.removesuffix(b"\n").removesuffix(b"\r")
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      self.not_utf8.append(number)
      return raw.decode("cp1252", errors="replace")

  def warning(self) -> str | None:
    """One line about the lines that were not UTF-8, if any."""
    if not self.not_utf8:
      return None
    return (f"warning: {len(self.not_utf8)} input line(s) are not UTF-8 (the first: line "
            f"{self.not_utf8[0]}) and were read as Windows-1252; convert the file to UTF-8 "
            "if they were in another encoding")
