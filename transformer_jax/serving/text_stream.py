"""A streamed choice's text as its tokens come (the continuous batcher: streaming.py)."""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[list[int]], str]    # token ids -> text (the served model's tokenizer)


class TextStream:
  """A choice's text as its tokens come: each token's text is let out once it can no longer
  change (a byte-level tokenizer decodes an incomplete character as U+FFFD) nor begin a stop
  string; the text ends before the first stop string. The text sent is the choice's text,
  streamed or not."""

  def __init__(self, decode: Decode, stops: Sequence[str]):
    self._decode, self._stops = decode, stops
    self.ids: list[int] = []
    self.sent = ""

  def add(self, token: int) -> tuple[str, bool]:
    """The text `token` lets out, and whether a stop string ended the text."""
    self.ids.append(token)
    text = self._decode(self.ids)
    ends = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
    if ends:
      return self._release(text[:min(ends)]), True
    return self._release(text[:len(text) - self._held(text)]), False

  def finish(self) -> str:
    """The text held back, now that no token follows."""
    return self._release(self._decode(self.ids))

  def _held(self, text: str) -> int:
    """Characters at the end of `text` that may still change or begin a stop string."""
    incomplete = len(text) - len(text.rstrip("\ufffd"))
    begun = [k for stop in self._stops for k in range(1, len(stop)) if text.endswith(stop[:k])]
    return max([incomplete, *begun])

  def _release(self, text: str) -> str:
    """What `text` adds to the text sent. (A decoding that rewrote text already sent would
    be let out no further: the text sent stays the choice's text.)"""
    if not text.startswith(self.sent):
      return ""
    added, self.sent = text[len(self.sent):], text
    return added
