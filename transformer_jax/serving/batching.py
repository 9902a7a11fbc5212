"""The server's batcher: one thread runs the model on the lines of concurrent requests
together.

Lines wait in one queue per length bucket (the padded length of their model call). Each
model call takes the bucket of the line that has waited longest, and up to `max_batch` of
that bucket's lines, oldest first; when the queues were empty it first gives others
`max_wait_s` after the first line to arrive. A request is answered as soon as its own lines
are done, so a short line is never held back by a long one queued beside it (before, one
call per bucket ran for a whole gathered batch, and every request waited for all of them).

Each call is measured (lines, bucket, seconds, compilation, output lengths), and each
request (queue wait, its calls) when a `RequestRecord` is asked for: see metrics.py.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Deque

from transformer_jax.serving.lines import EncodedLine, Served
from transformer_jax.serving.metrics import CompileClock, ServerMetrics


@dataclasses.dataclass
class RequestRecord:
  """What happened to one request's lines in the batcher (seconds, tokens)."""
  lines: int
  queue_wait_s: float = 0.0        # queued -> its first model call starts
  batcher_s: float = 0.0           # queued -> its last line done
  calls: list[dict] = dataclasses.field(default_factory=list)   # the model calls it was in
  decode_tokens: list[int] = dataclasses.field(default_factory=list)


class _Pending:
  """One request's encoded lines, waiting for the batcher."""

  def __init__(self, encoded: list[EncodedLine]):
    self.encoded = encoded
    self.outputs: list[str | None] = [None] * len(encoded)
    self.remaining = len(encoded)
    self.error: str | None = None
    self.done = threading.Event()
    self.record = RequestRecord(lines=len(encoded))
    self.queued = time.monotonic()
    self.started: float | None = None


class Batcher:
  """Runs `served` on the lines of concurrent requests together (see the module doc)."""

  def __init__(self, served: Served, max_batch: int, max_wait_s: float,
               metrics: ServerMetrics | None = None):
    self.served, self.max_batch, self.max_wait_s = served, max_batch, max_wait_s
    self.metrics = metrics or ServerMetrics()
    # bucket -> (request, line index, queued time), oldest first
    self._queues: dict[int, Deque[tuple[_Pending, int, float]]] = {}
    self._queued = 0
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
    self._thread.start()

  def predict(self, encoded: list[EncodedLine]) -> tuple[list[str], RequestRecord]:
    """Blocks until the outputs of `encoded` (lines through Served.encode) are ready;
    returns them and what the batcher did with them. RuntimeError if the model failed."""
    pending = _Pending(encoded)
    if encoded:
      with self._cond:
        for index, line in enumerate(encoded):
          self._queues.setdefault(self.served.bucket(line), collections.deque()).append(
              (pending, index, pending.queued))
        self._queued += len(encoded)
        self.metrics.queue_depth.set(self._queued)
        self._cond.notify()
      pending.done.wait()
    if pending.error is not None:
      raise RuntimeError(pending.error)
    return pending.outputs, pending.record   # type: ignore[return-value]

  def _next_call(self) -> tuple[int, list[tuple[_Pending, int, float]]]:
    """Waits for lines (and, after an idle spell, max_wait_s for company); takes the
    oldest line's bucket and up to max_batch of its lines."""
    with self._cond:
      while not self._queued:
        self._cond.wait()
      deadline = min(q[0][2] for q in self._queues.values() if q) + self.max_wait_s
      while self._queued < self.max_batch and time.monotonic() < deadline:
        self._cond.wait(deadline - time.monotonic())
      bucket = min((q[0][2], b) for b, q in self._queues.items() if q)[1]
      queue = self._queues[bucket]
      taken = [queue.popleft() for _ in range(min(len(queue), self.max_batch))]
      self._queued -= len(taken)
      self.metrics.queue_depth.set(self._queued)
      return bucket, taken

  def _loop(self) -> None:
    while True:
      bucket, taken = self._next_call()
      self._run(bucket, taken)

  def _run(self, bucket: int, taken: list[tuple[_Pending, int, float]]) -> None:
    start, compiled = time.monotonic(), CompileClock.seconds()
    for pending, _, queued in taken:
      if pending.started is None:
        pending.started = start
        pending.record.queue_wait_s = start - queued
        self.metrics.queue_wait.observe(start - queued)
    error: str | None = None
    try:
      texts, lengths = self.served.predict_bucket([p.encoded[i] for p, i, _ in taken], bucket)
    except Exception as e:  # noqa: BLE001  (a model failure is answered, not fatal)
      texts, lengths, error = [""] * len(taken), [0] * len(taken), f"{type(e).__name__}: {e}"
    end = time.monotonic()
    call = {"lines": len(taken), "bucket": bucket, "seconds": end - start,
            "compile_s": CompileClock.seconds() - compiled}
    self.metrics.batch_lines.observe(len(taken))
    self.metrics.batch_length.observe(bucket)
    self.metrics.model_call.observe(call["seconds"])
    self.metrics.compile.inc(call["compile_s"])
    for (pending, index, _), text, length in zip(taken, texts, lengths):
      if error is None:
        self.metrics.decode_length.observe(length)
      if not pending.record.calls or pending.record.calls[-1] is not call:
        pending.record.calls.append(call)
      pending.record.decode_tokens.append(length)
      pending.outputs[index] = text
      pending.error = pending.error or error
      pending.remaining -= 1
      if pending.remaining == 0:
        pending.record.batcher_s = end - pending.queued
        pending.done.set()
