"""A served language model's decoding batch on its device: the KV cache of `slots` rows of
max_len positions each, kept there between calls, and the model's two streaming programs
run against it (the continuous batcher that drives them: streaming.py).

A loader gives the programs as `StreamingPrograms` (serving/stablehlo.py: the artifact's
prefill.jax_exported and step.jax_exported):

  prefill(params, prompts (R, S) as `prompt_ids` encodes them, right-padded,
          max_new_tokens (R,), seeds (R,) uint32, choices (R,), temperature (R,), top_k (R,),
          top_p (R,))
      -> (the R rows' cache over S positions, first tokens (R,), lengths (R,), keys (R, 2))
  step(params, cache of B rows x W positions, tokens (B,), positions (B,), keys (B, 2),
       temperature (B,), top_k (B,), top_p (B,))
      -> (the cache, next tokens (B,))

The cache is a list of arrays whose shapes the manifest gives with the names "rows" and
"length" for those two axes (a model with scanned layers has a layer axis first). Here
`prefill` writes the new rows' caches into their slots, and `step` runs the program on the
first B rows and W positions of the cache and writes back what it wrote (each row's entry
at its position), inside one jitted call whose cache argument is donated, so the cache is
updated where it lies.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ROWS, LENGTH = "rows", "length"     # the cache's symbolic axes, as the manifest names them


class StreamingPrograms(NamedTuple):
  """What a loader gives for a model that streams: the programs (each called with `params`
  first) and the cache's arrays, {"shape": [..., "rows", "length", ...], "dtype"} each."""
  params: Any
  prefill: Callable[..., Any]
  step: Callable[..., Any]
  cache: list[dict[str, Any]]
  max_len: int


def _index(shape: list[Any], rows: Any, length: Any) -> tuple[Any, ...]:
  """An index into one cache array: `rows` on its rows axis, `length` on its length axis."""
  index: list[Any] = [slice(None)] * len(shape)
  index[shape.index(ROWS)], index[shape.index(LENGTH)] = rows, length
  return tuple(index)


class DecodingBatch:
  """The cache of `slots` rows on the device, with `prefill` and `step` (see the module
  doc). Not thread-safe: one thread (the continuous batcher's) calls it."""

  def __init__(self, programs: StreamingPrograms, slots: int):
    self.programs, self.slots = programs, slots
    shapes = [spec["shape"] for spec in programs.cache]

    def prefill(params: Any, cache: list[jax.Array], slots: jax.Array, prompts: jax.Array,
                *settings: jax.Array) -> tuple[Any, ...]:
      rows_cache, first, lengths, keys = programs.prefill(params, prompts, *settings)
      width = slice(0, prompts.shape[1])
      cache = [c.at[_index(shape, slots, width)].set(r)
               for c, r, shape in zip(cache, rows_cache, shapes)]
      return cache, first, lengths, keys

    def step(params: Any, cache: list[jax.Array], tokens: jax.Array, positions: jax.Array,
             *settings: jax.Array, window: int) -> tuple[list[jax.Array], jax.Array]:
      rows = tokens.shape[0]
      views = [c[_index(shape, slice(0, rows), slice(0, window))]
               for c, shape in zip(cache, shapes)]
      views, next_tokens = programs.step(params, views, tokens, positions, *settings)
      # Back into the cache: only what the step wrote, each row's entry at its position.
      written = [_index(shape, jnp.arange(rows), positions) for shape in shapes]
      return [c.at[i].set(v[i]) for c, v, i in zip(cache, views, written)], next_tokens

    self._prefill = jax.jit(prefill, donate_argnums=1)
    self._step = jax.jit(step, donate_argnums=1, static_argnames="window")
    self.reset()

  def reset(self) -> None:
    """A new, empty cache (after a failed call, whose donated cache may be gone)."""
    self.cache = [jnp.zeros([self.slots if d == ROWS else self.programs.max_len if d == LENGTH
                             else d for d in spec["shape"]], spec["dtype"])
                  for spec in self.programs.cache]

  def prefill(self, slots: np.ndarray, prompts: np.ndarray, max_new_tokens: np.ndarray,
              seeds: np.ndarray, choices: np.ndarray, temperature: np.ndarray,
              top_k: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, ...]:
    """Starts the rows of `prompts` in `slots`: their first tokens, lengths (the position
    of the first token) and keys."""
    self.cache, first, lengths, keys = self._prefill(
        self.programs.params, self.cache, slots.astype(np.int32), prompts.astype(np.int32),
        max_new_tokens.astype(np.int32), seeds.astype(np.uint32), choices.astype(np.int32),
        temperature.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32))
    return np.asarray(first), np.asarray(lengths), np.asarray(keys)

  def step(self, window: int, tokens: np.ndarray, positions: np.ndarray, keys: np.ndarray,
           temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """One step of the first len(tokens) rows, each fed its token at its position (all
    below `window`): the tokens they draw next."""
    self.cache, next_tokens = self._step(
        self.programs.params, self.cache, tokens.astype(np.int32), positions.astype(np.int32),
        keys.astype(np.uint32), temperature.astype(np.float32), top_k.astype(np.int32),
        top_p.astype(np.float32), window=window)
    return np.asarray(next_tokens)
