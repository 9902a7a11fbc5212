"""The server's batcher: one thread runs the model on the lines of concurrent requests
together. It gathers requests until `max_batch` lines or `max_wait_s` after the first,
runs them as one `Served.predict_ids` call, and hands each request its outputs."""

from __future__ import annotations

import queue
import threading
import time

from transformer_jax.serving.lines import EncodedLine, Served


class _Pending:
  """One request's encoded lines, waiting for the batcher."""

  def __init__(self, encoded: list[EncodedLine]):
    self.encoded = encoded
    self.outputs: list[str] | None = None
    self.error: str | None = None
    self.done = threading.Event()


class Batcher:
  """Runs `served` on the lines of concurrent requests together (see the module doc)."""

  def __init__(self, served: Served, max_batch: int, max_wait_s: float):
    self.served, self.max_batch, self.max_wait_s = served, max_batch, max_wait_s
    self._queue: queue.Queue[_Pending] = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
    self._thread.start()

  def predict(self, encoded: list[EncodedLine]) -> list[str]:
    """Blocks until the outputs of `encoded` (lines through Served.encode) are ready."""
    pending = _Pending(encoded)
    self._queue.put(pending)
    pending.done.wait()
    if pending.error is not None:
      raise RuntimeError(pending.error)
    return pending.outputs

  def _loop(self) -> None:
    while True:
      batch = [self._queue.get()]
      size = len(batch[0].encoded)
      deadline = time.monotonic() + self.max_wait_s
      while size < self.max_batch:
        try:
          item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
          break
        batch.append(item)
        size += len(item.encoded)
      self._run(batch)

  def _run(self, batch: list[_Pending]) -> None:
    try:
      outputs = self.served.predict_ids([ids for p in batch for ids in p.encoded])
    except Exception as e:  # noqa: BLE001  (a model failure is answered, not fatal)
      for p in batch:
        p.error = f"{type(e).__name__}: {e}"
        p.done.set()
      return
    start = 0
    for p in batch:
      p.outputs = outputs[start:start + len(p.encoded)]
      start += len(p.encoded)
      p.done.set()
