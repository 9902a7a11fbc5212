"""A served language model's decoding batch on its device: the KV cache of its rows, kept
there between calls, and the model's two streaming programs run against it (the continuous
batcher that drives them: streaming.py).

A loader gives the programs as `StreamingPrograms` (serving/stablehlo.py: the artifact's
prefill.jax_exported and step.jax_exported):

  prefill(params, prompts (R, S) as `prompt_ids` encodes them, right-padded,
          max_new_tokens (R,), seeds (R,) uint32, choices (R,), temperature (R,), top_k (R,),
          top_p (R,), logprobs (R,))
      -> (the R rows' cache over S positions, first tokens (R,), lengths (R,), keys (R, 2),
          *reported)
  step(params, cache of B rows x W positions, tokens (B,), positions (B,), keys (B, 2),
       temperature (B,), top_k (B,), top_p (B,), logprobs (B,))
      -> (the cache, next tokens (B,), *reported)
  score(params, texts (R, S) right-padded, logprobs (R,)) -> (each token's log-probability
       (R, S), the likeliest next ids (R, S, K) and their log-probabilities (R, S, K))

`reported` (sampling.reported): each drawn token's log-probability (R,) and the likeliest
ids (R, K) and their log-probabilities (R, K), computed where a row's logprobs > 0.

The cache is a list of arrays whose shapes the manifest gives with the names "rows" and
"length" for those two axes (a model with scanned layers has a layer axis first).

The cache holds as many rows and positions as the busy slots need, not all `slots` rows of
max_len positions: a step runs the step program over the whole cache, whose argument is
donated, so that it is updated where it lies. (A step over a slice of a larger cache copies
the slice in and the written entries out: benchmarks/RESULTS.md has both.) The cache grows
at once when a prefill or a step needs more rows (a power of two holding the highest busy
slot) or positions (a length bucket holding every busy row's position); it shrinks to what
the last `shrink_after` steps needed once they all needed less, so that rows coming and
going do not resize it at every step. A resize goes one size of rows or of length at a
time, copying the kept rows and positions into a new cache: `warm_up` compiles every such
step between the shapes it compiles, and each new row's write into every cache shape, so
that no request waits for a compilation. Rows and positions past what the busy slots use
are never read, and need no clearing.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.inputs import bucket_for, bucket_lengths, power_of_two

ROWS, LENGTH = "rows", "length"     # the cache's symbolic axes, as the manifest names them
SHRINK_AFTER = 32                   # steps that must all need a smaller cache before it shrinks
SCORE_TOKENS = 1024   # tokens a score call takes at most: its log-probabilities are 4 x the
                      # vocabulary bytes each (GPT-2: 200 MB)
Reported = tuple[np.ndarray, np.ndarray, np.ndarray]   # sampling.reported, on the host


class StreamingPrograms(NamedTuple):
  """What a loader gives for a model that streams: the programs (each called with `params`
  first) and the cache's arrays, {"shape": [..., "rows", "length", ...], "dtype"} each."""
  params: Any
  prefill: Callable[..., Any]
  step: Callable[..., Any]
  score: Callable[..., Any]
  cache: list[dict[str, Any]]
  max_len: int


def _index(shape: list[Any], rows: Any, length: Any) -> tuple[Any, ...]:
  """An index into one cache array: `rows` on its rows axis, `length` on its length axis."""
  index: list[Any] = [slice(None)] * len(shape)
  index[shape.index(ROWS)], index[shape.index(LENGTH)] = rows, length
  return tuple(index)


class DecodingBatch:
  """The cache of up to `slots` rows on the device, with `prefill` and `step` (see the module
  doc). Not thread-safe: one thread (the continuous batcher's) calls it."""

  def __init__(self, programs: StreamingPrograms, slots: int,
               shrink_after: int = SHRINK_AFTER):
    self.programs, self.slots, self.shrink_after = programs, slots, shrink_after
    self.row_sizes = sorted({min(slots, power_of_two(n)) for n in range(1, slots + 1)})
    self.lengths = bucket_lengths(programs.max_len)
    shapes = [spec["shape"] for spec in programs.cache]

    def prefill(params: Any, *inputs: jax.Array) -> tuple[Any, ...]:
      rows_cache, first, *more = programs.prefill(params, *inputs)
      each_row = [[jax.lax.index_in_dim(c, row, shape.index(ROWS)) for c, shape
                   in zip(rows_cache, shapes)] for row in range(first.shape[0])]
      return each_row, first, *more

    def write(cache: list[jax.Array], slot: jax.Array, row_cache: list[jax.Array]
              ) -> list[jax.Array]:
      starts = [[slot if d == ROWS else 0 for d in shape] for shape in shapes]
      return [jax.lax.dynamic_update_slice(c, r, start)
              for c, r, start in zip(cache, row_cache, starts)]

    def resize(cache: list[jax.Array], rows: int, length: int) -> list[jax.Array]:
      resized = []
      for c, shape in zip(cache, shapes):
        kept = c[_index(shape, slice(0, rows), slice(0, length))]
        pads = [(0, 0)] * c.ndim
        pads[shape.index(ROWS)] = (0, rows - kept.shape[shape.index(ROWS)])
        pads[shape.index(LENGTH)] = (0, length - kept.shape[shape.index(LENGTH)])
        resized.append(jnp.pad(kept, pads))
      return resized

    self._prefill = jax.jit(prefill)
    self._write = jax.jit(write, donate_argnums=0)
    self._resize = jax.jit(resize, static_argnums=(1, 2))   # a new shape: nothing to donate
    self._step = jax.jit(programs.step, donate_argnums=1)
    self._score = jax.jit(programs.score)
    self._needs: collections.deque[tuple[int, int]] = collections.deque(maxlen=shrink_after)
    self.reset()

  @property
  def shape(self) -> tuple[int, int]:
    """The cache's rows and positions now."""
    return self._rows, self._length

  def reset(self, rows: int = 1, length: int | None = None) -> None:
    """A new, empty cache (also after a failed call, whose donated cache may be gone)."""
    self._rows, self._length = rows, length or self.lengths[0]
    self._needs.clear()
    # Committed to the device, as every program's output is: the same compiled programs.
    self.cache = jax.device_put(
        [jnp.zeros([self._rows if d == ROWS else self._length if d == LENGTH else d
                    for d in spec["shape"]], spec["dtype"]) for spec in self.programs.cache],
        jax.devices()[0])

  def _fit(self, rows: int, length: int, step: bool) -> None:
    """Grows the cache to hold `rows` rows and `length` positions; after a step's need,
    shrinks it once the last `shrink_after` steps all needed less."""
    rows = min(power_of_two(rows), self.slots)
    length = bucket_for(length, self.lengths)
    target = (max(self._rows, rows), max(self._length, length))
    if step:
      self._needs.append((rows, length))
      if len(self._needs) == self.shrink_after:
        target = (max(r for r, _ in self._needs), max(w for _, w in self._needs))
    while self.shape != target:     # one size at a time: rows first, then length
      index = (self.row_sizes.index(self._rows), self.lengths.index(self._length))
      if self._rows != target[0]:
        rows_now = self.row_sizes[index[0] + (1 if target[0] > self._rows else -1)]
        self._resize_to(rows_now, self._length)
      else:
        self._resize_to(self._rows,
                        self.lengths[index[1] + (1 if target[1] > self._length else -1)])

  def _resize_to(self, rows: int, length: int) -> None:
    self.cache = self._resize(self.cache, rows, length)
    self._rows, self._length = rows, length
    self._needs.clear()

  def prefill(self, slots: np.ndarray, prompts: np.ndarray, max_new_tokens: np.ndarray,
              seeds: np.ndarray, choices: np.ndarray, temperature: np.ndarray,
              top_k: np.ndarray, top_p: np.ndarray,
              logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, Reported]:
    """Starts the rows of `prompts` in `slots` (a slot given twice holds its first row):
    their first tokens, lengths (the position of the first token), keys, and the first
    tokens' reported log-probabilities (where `logprobs` > 0)."""
    each_row, first, lengths, keys, *reported = self._prefill(
        self.programs.params, prompts.astype(np.int32), max_new_tokens.astype(np.int32),
        seeds.astype(np.uint32), choices.astype(np.int32), temperature.astype(np.float32),
        top_k.astype(np.int32), top_p.astype(np.float32), logprobs.astype(np.int32))
    self._fit(int(slots.max()) + 1, prompts.shape[1], step=False)
    first_row = {int(slot): row for row, slot in reversed(list(enumerate(slots)))}
    for slot, row in first_row.items():
      self.cache = self._write(self.cache, np.int32(slot), each_row[row])
    return np.asarray(first), np.asarray(lengths), np.asarray(keys), _host(reported)

  def step(self, window: int, tokens: np.ndarray, positions: np.ndarray, keys: np.ndarray,
           temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           logprobs: np.ndarray) -> tuple[np.ndarray, Reported]:
    """One step of the first len(tokens) rows (every busy slot among them), each fed its
    token at its position (all below `window`): the tokens they draw next, and their
    reported log-probabilities (where `logprobs` > 0). Rows of the cache past them step
    idle (greedy, at position 0, nothing reported) and their tokens are dropped."""
    self._fit(len(tokens), window, step=True)
    inputs = [tokens.astype(np.int32), positions.astype(np.int32), keys.astype(np.uint32),
              temperature.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32),
              logprobs.astype(np.int32)]
    idle = self._rows - len(tokens)
    if idle:   # greedy rows at position 0 (top_p 1: the whole distribution)
      inputs = [np.concatenate([x, np.full((idle, *x.shape[1:]), i == 5, x.dtype)])
                for i, x in enumerate(inputs)]
    self.cache, next_tokens, *reported = self._step(self.programs.params, self.cache, *inputs)
    return (np.asarray(next_tokens)[:len(tokens)],
            _host(reported, len(tokens)))

  def score_rows(self, width: int) -> int:
    """The rows a score call of texts `width` tokens wide takes at most (SCORE_TOKENS)."""
    return min(self.slots, power_of_two(max(1, SCORE_TOKENS // width) + 1) // 2)

  def score(self, texts: np.ndarray, logprobs: np.ndarray) -> Reported:
    """sampling.score of texts (R, S), right-padded with PAD, R at most score_rows(S), each
    reporting its `logprobs` (R,) likeliest tokens at each place."""
    return _host(self._score(self.programs.params, texts.astype(np.int32),
                             logprobs.astype(np.int32)))

  def warm_up(self, widths: list[int]) -> int:
    """Compiles the model's programs for the shapes texts of up to widths[-1] tokens use:
    the prefill for each count of rows that may join at once and each prompt width in
    `widths`, the step for each cache shape of those widths; and the cache's own small
    programs: a new row's write into each cache shape, each resize between them; and the
    score program at each width. Returns how many shapes of the model's programs. Leaves an
    empty cache."""
    joining = sorted({power_of_two(n) for n in range(1, self.slots + 1)})
    new_rows = {}
    for rows in joining:
      zeros = np.zeros(rows, np.int32)
      for width in widths:
        each_row, *_ = self._prefill(
            self.programs.params, np.zeros((rows, width), np.int32), zeros + 1,
            zeros.astype(np.uint32), zeros, zeros.astype(np.float32), zeros,
            zeros + np.float32(1), zeros)
        new_rows[width] = each_row[0]
    shapes = [(rows, length) for rows in self.row_sizes for length in widths]
    for rows, length in shapes:
      zeros = np.zeros(rows, np.int32)
      for width in widths[:widths.index(length) + 1]:
        self.reset(rows, length)
        self.cache = self._write(self.cache, np.int32(0), new_rows[width])
      self.step(length, zeros, zeros, np.zeros((rows, 2), np.uint32), zeros.astype(np.float32),
                zeros, zeros + np.float32(1), zeros)
      for other in shapes:
        if abs(self.row_sizes.index(other[0]) - self.row_sizes.index(rows)) + \
           abs(widths.index(other[1]) - widths.index(length)) == 1:
          self.reset(rows, length)
          self._resize_to(*other)
    for width in widths:
      rows = self.score_rows(width)
      self.score(np.zeros((rows, width), np.int32), np.zeros(rows, np.int32))
    self.reset()
    return (len(joining) + len(self.row_sizes) + 1) * len(widths)


def _host(reported: Any, rows: int | None = None) -> Reported:
  """Reported log-probabilities on the host, of the first `rows` rows (None: all)."""
  chosen, ids, values = (np.asarray(x)[:rows] for x in reported)
  return chosen, ids, values
