"""Text lines through a served model, whatever format holds the model: `Served` encodes
lines, groups them in predict's length buckets, pads each group to its bucket length and
its rows to a power of two, calls the loaded model's function, and turns the rows of its
output into text (a translation, a label, or space-separated tags).

A loader (serving/stablehlo.py) gives `Served` the artifact's checked manifest and the
model's function `(tokens (B, S) int32[, chars (B, S, word_bytes) int32]) -> output`, the
array the task's `serving_function` returns; everything here is the same for any format.

Each line is cleaned and fitted to the model as predict does it (serving/line_policy.py,
the manifest's "lines"): a line without tokens gets an empty output without a model call; a
longer line than max_len is refused, truncated, or (a tagger) run as overlapping windows of
max_len tokens whose per-token scores are stitched before the tags are decoded.

Rows are padded by repeating the last line, which ends a search no later than it, so a
server compiles few shapes and the padding changes no real row's output.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from transformer_jax import bio
from transformer_jax.config import EOS_ID, PAD_ID
from transformer_jax.data.tokenizer import (
  TARGET_VOCAB_FILE,
  VOCAB_FILE,
  load_tokenizer,
  prompt_ids,
  prompt_tail,
)
from transformer_jax.data.vocab import strip_special
from transformer_jax.errors import UserError
from transformer_jax.inputs import (
  InputError,
  bucket_for,
  bucket_lengths,
  character_ids,
  power_of_two,
)
from transformer_jax.serving.artifact import ArtifactError
from transformer_jax.serving.line_policy import (
  LinePolicy,
  escape_line,
  kept_tokens,
  stitch,
  window_starts,
)
from transformer_jax.serving.slots import StreamingPrograms

DEFAULT_MAX_ROWS = 64

# The loaded model: token ids (B, S) and, for a model with character features, the words'
# bytes (B, S, word_bytes) -> the task's serving output for those rows.
ModelFunction = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


class EncodedLine(NamedTuple):
  """A line as the model takes it: its token ids and, for a model with character
  features, its words' bytes (len(ids), word_bytes). Longer than max_len only when the
  line policy runs it in windows."""
  ids: list[int]
  chars: np.ndarray | None = None


# ------------------------------------------------------------------- outputs to text
# Each takes the model's output row of each line (a tagger's long line: its windows'
# rows stitched) and the line's length in tokens.
def _token_ids(served: "Served", out: Sequence[np.ndarray], lengths: Sequence[int]) -> list[str]:
  return [served.target_tokenizer.decode(strip_special(row)) for row in out]


def _continuation(served: "Served", out: Sequence[np.ndarray],
                  lengths: Sequence[int]) -> list[str]:
  return [escape_line(served.tokenizer.decode(strip_special(row, served.end_ids)))
          for row in out]


def _class_scores(served: "Served", out: Sequence[np.ndarray],
                  lengths: Sequence[int]) -> list[str]:
  assert served.labels   # checked at load
  return [served.labels[int(np.argmax(row))] for row in out]


def _tag_scores(served: "Served", out: Sequence[np.ndarray],
                lengths: Sequence[int]) -> list[str]:
  assert served.labels and served.transitions is not None   # checked at load
  crf = served.constants.get("crf")   # emission scores + the CRF's transitions
  learned = ((np.asarray(crf["start"]), np.asarray(crf["transitions"]), np.asarray(crf["end"]))
             if crf else None)
  best = bio.best_tags(out, lengths, served.transitions, crf=learned,
                       constrained=served.decode.get("bio_constrained", True))
  return [" ".join(served.labels[i] for i in row) for row in best]


# Output kind (Task.serving_output) -> rows of the model's output to text lines.
OUTPUTS: dict[str, Callable[["Served", Sequence[np.ndarray], Sequence[int]], list[str]]] = {
    "token_ids": _token_ids, "class_scores": _class_scores, "tag_scores": _tag_scores,
    "continuation": _continuation}


class Served:
  """A loaded artifact: `predict(lines)` gives one output line per input line.
  `Served.load(directory)` picks the loader of the artifact's format."""

  def __init__(self, directory: str, manifest: dict[str, Any], function: ModelFunction,
               max_rows: int = DEFAULT_MAX_ROWS, streaming: StreamingPrograms | None = None):
    if manifest.get("output") not in OUTPUTS:
      raise ArtifactError(f"{directory}: unknown output kind {manifest.get('output')!r}; "
                          f"known: {sorted(OUTPUTS)}")
    self.directory, self.manifest, self.max_rows = directory, manifest, max_rows
    self._function = function
    self.streaming = streaming   # a language model's programs for /v1/completions, if any
    self.max_len = int(manifest["max_len"])
    self.decode = manifest["decode"]
    special = manifest.get("special_ids", {})
    # The ids that end a text (older artifacts name EOS alone).
    self.end_ids: tuple[int, ...] = tuple(special.get("end", [special.get("eos", EOS_ID)]))
    self.buckets = bucket_lengths(self.max_len)
    self.labels: list[str] | None = manifest.get("labels")
    if manifest["output"] not in ("token_ids", "continuation") and not self.labels:
      raise ArtifactError(f"{directory}: a {manifest['output']} artifact lists no labels")
    self.word_bytes = manifest.get("word_bytes")
    self.constants = manifest.get("constants", {})
    self.tokenizer = load_tokenizer(os.path.join(directory, VOCAB_FILE))
    target = os.path.join(directory, TARGET_VOCAB_FILE)
    self.target_tokenizer = load_tokenizer(target) if os.path.exists(target) else self.tokenizer
    self.transitions = bio.allowed_transitions(self.labels) if self.labels else None
    try:   # what the training did to lines; `serve --too_long` may replace it
      self.policy = LinePolicy.from_manifest(manifest.get("lines"))
    except UserError as e:
      raise ArtifactError(f"{directory}: manifest \"lines\": {e}; export the model again") from None
    self._outputs = OUTPUTS[manifest["output"]]
    # A language model's lines are prompts, encoded as predict encodes them (`prompt_ids`).
    self.prompts = manifest["output"] == "continuation"

  @classmethod
  def load(cls, directory: str, max_rows: int = DEFAULT_MAX_ROWS) -> "Served":
    """Reads and checks an artifact of any known format (serving.LOADERS)."""
    from transformer_jax.serving import load  # the loaders import this module
    return load(directory, max_rows)

  @property
  def fingerprint(self) -> str:
    return self.manifest["fingerprint"]

  def encode(self, lines: Sequence[Any]) -> list[EncodedLine]:
    """Token ids (and word bytes) per line, cleaned and fitted to max_len by the line
    policy; InputError naming the line for one that is not a string, that the tokenizer
    rejects, or that is longer than max_len tokens and refused."""
    encoded = []
    for index, line in enumerate(lines):
      if not isinstance(line, str):
        raise InputError(f"input {index}: expected a string, got {type(line).__name__}")
      text = self.policy.clean(line)
      try:
        ids = np.asarray(prompt_ids(self.tokenizer, text) if self.prompts
                         else self.tokenizer.encode(text), np.int32)
      except (ValueError, UserError) as e:    # e.g. a symbol outside a symbol vocabulary
        raise InputError(f"input {index}: {e}") from None
      # Word-level tokenizers split on whitespace, as the tasks' featurizers do.
      chars = character_ids(text.split(), self.word_bytes) if self.word_bytes else None
      if self.policy.action(len(ids), self.max_len, f"input {index}") == "truncate":
        ids = (prompt_tail(ids, self.max_len) if self.prompts   # its end, after its BOS
               else kept_tokens(ids, self.max_len, self.policy.truncate))
        chars = None if chars is None else kept_tokens(chars, self.max_len,
                                                       self.policy.truncate)
      encoded.append(EncodedLine(ids.tolist(), chars))
    return encoded

  def run(self, tokens: np.ndarray, chars: np.ndarray | None = None) -> np.ndarray:
    """The model's function on a (batch, length) int32 array of checked ids (and, for a
    model with character features, the words' bytes (batch, length, word_bytes))."""
    return self._function(tokens, chars)

  def predict(self, lines: Sequence[Any]) -> list[str]:
    """One output per line (a translation, a label, or space-separated tags)."""
    return self.predict_ids(self.encode(lines))

  def bucket(self, line: EncodedLine) -> int:
    """The padded length of `line`'s model call: predict's bucket (data.pipeline)."""
    return bucket_for(max(len(line.ids), 1), self.buckets)

  def predict_ids(self, encoded: Sequence[EncodedLine]) -> list[str]:
    """`predict` for lines already through `encode`."""
    groups: dict[int, list[int]] = {}
    for index, line in enumerate(encoded):
      groups.setdefault(self.bucket(line), []).append(index)
    outputs = [""] * len(encoded)
    for length, members in sorted(groups.items()):
      for start in range(0, len(members), self.max_rows):
        chunk = members[start:start + self.max_rows]
        texts, _ = self.predict_bucket([encoded[i] for i in chunk], length)
        for index, text in zip(chunk, texts):
          outputs[index] = text
    return outputs

  def predict_bucket(self, lines: Sequence[EncodedLine],
                     length: int) -> tuple[list[str], list[int]]:
    """The outputs of lines of one bucket (padded to `length`), in model calls of at most
    max_rows rows (a long line's windows are rows of their own); and each line's output
    length in tokens (a translation's up to EOS; for other tasks the line's own)."""
    rows: list[EncodedLine] = []                 # the model's rows
    spans: list[tuple[int, list[int]]] = []      # per line: its first row, its windows
    for line in lines:
      starts = window_starts(len(line.ids), self.max_len) if line.ids else []
      spans.append((len(rows), starts))
      rows += [EncodedLine(line.ids[s:s + self.max_len],
                           None if line.chars is None else line.chars[s:s + self.max_len])
               for s in starts]
    out = [row for first in range(0, len(rows), self.max_rows)
           for row in self._call(rows[first:first + self.max_rows], length)]
    answered = [i for i, (_, starts) in enumerate(spans) if starts]   # others: no tokens
    outputs = []
    for i in answered:
      first, starts = spans[i]
      outputs.append(self._joined(out[first:first + len(starts)], starts, len(lines[i].ids)))
    texts, lengths = [""] * len(lines), [0] * len(lines)
    answers = self._outputs(self, outputs, [len(lines[i].ids) for i in answered])
    for i, text, row in zip(answered, answers, outputs):
      texts[i] = text
      lengths[i] = (len(strip_special(row)) if self.manifest["output"] == "token_ids"
                    else len(lines[i].ids))
    return texts, lengths

  def _joined(self, rows: Sequence[np.ndarray], starts: list[int], total: int) -> np.ndarray:
    """A line's output from its rows': its one row, or its windows' stitched."""
    if len(rows) == 1:
      return rows[0]
    return stitch([row[:self.max_len] for row in rows], starts, total, self.max_len)

  def _call(self, rows: Sequence[EncodedLine], length: int) -> list[np.ndarray]:
    """The model's output row for each of at most max_rows rows, padded to `length`."""
    if not rows:
      return []
    return list(self.run(*self._pad(rows, length))[:len(rows)])

  def _pad(self, lines: Sequence[EncodedLine],
           length: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The model's inputs for `lines`: padded to `length` tokens, and to a power of two
    rows (at most max_rows) by repeating the last line."""
    rows = min(power_of_two(len(lines)), self.max_rows)
    tokens = np.full((rows, length), PAD_ID, np.int32)
    chars = np.zeros((rows, length, self.word_bytes), np.int32) if self.word_bytes else None
    for row, line in enumerate(lines):
      tokens[row, :len(line.ids)] = line.ids
      if chars is not None:
        chars[row, :len(line.ids)] = line.chars
    tokens[len(lines):] = tokens[len(lines) - 1]     # filler rows repeat the last line
    if chars is not None:
      chars[len(lines):] = chars[len(lines) - 1]
    return tokens, chars
