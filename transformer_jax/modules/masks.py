"""Which keys each query may see: the dense masks of the einsum and XLA paths, and
`AttentionMask`, the form a model describes its masks in (segment ids, a causal flag, a
sliding window), which each attention path turns into what it takes (attention.py,
kernels.py). Both of those import this module; it imports neither.

Shapes: B batch, T query length, S key length. A dense mask is a boolean (B, 1, T, S), True
where a query may attend to a key.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


def padding_mask(query_valid: Array, key_valid: Array) -> Array:
  """(B, T) and (B, S) booleans -> (B, 1, T, S): keys that are padding are hidden.

  Only keys are masked: a padding query still attends somewhere (its output is ignored),
  which keeps every softmax row finite.
  """
  del query_valid  # Kept in the signature so call sites read symmetrically.
  return key_valid[:, None, None, :]


def causal_mask(length: int) -> Array:
  """(1, 1, T, T): position t sees positions <= t."""
  return jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]


def window_mask(query_positions: Array, key_positions: Array, window: int,
                causal: bool) -> Array:
  """(..., T, S): a query sees the keys fewer than `window` positions before it (itself
  included: `window` keys in all, as transformers' sliding windows count them), and, unless
  `causal`, as few after it. Positions broadcast: (T,) and (S,), or (B, T) and (B, S)."""
  distance = query_positions[..., :, None] - key_positions[..., None, :]
  return (distance < window) & (causal | (-distance < window))


def segment_mask(query_segments: Array, key_segments: Array) -> Array:
  """(B, 1, T, S): packed sequences attend only within their own segment."""
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the masks that are not None (None when all are)."""
  given = [m for m in masks if m is not None]
  if not given:
    return None
  out = given[0]
  for m in given[1:]:
    out = jnp.logical_and(out, m)
  return out


@flax.struct.dataclass
class AttentionMask:
  """Which keys each query may see, in the form the kernels take. `query_segments` (B, T)
  and `key_segments` (B, S) are int32, 0 at padding. Unpacked rows (`packed` False): every
  query sees every real key (segments are 1 and 0). Packed rows: a query sees the keys of
  its own segment. `causal`: and no later key (T == S). `window` (0: none): and only keys
  fewer than `window` positions away (self-attention; a layer's own, `with_window`).
  `max_segments`: the packer's bound on segments per row (0: none given), which sizes
  cuDNN's packed layout."""
  query_segments: Array
  key_segments: Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  packed: bool = flax.struct.field(pytree_node=False, default=False)
  max_segments: int = flax.struct.field(pytree_node=False, default=0)
  window: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def build(cls, query_valid: Array, key_valid: Array, query_segments: Array | None = None,
            key_segments: Array | None = None, causal: bool = False,
            max_segments: int = 0) -> "AttentionMask":
    """From (B, T) and (B, S) validity and, for packed rows, their segment ids."""
    if query_segments is not None and key_segments is not None:
      queries = jnp.where(query_valid, query_segments, 0).astype(jnp.int32)
      keys = jnp.where(key_valid, key_segments, 0).astype(jnp.int32)
      return cls(queries, keys, causal=causal, packed=True, max_segments=max_segments)
    return cls(query_valid.astype(jnp.int32), key_valid.astype(jnp.int32), causal=causal)

  def with_window(self, window: int) -> "AttentionMask":
    """The same mask, seeing only the keys within `window` positions (0: all)."""
    return dataclasses.replace(self, window=window)

  def dense(self) -> Array:
    """The (B, 1, T, S) boolean mask. A padding query sees what a real one would (packed:
    nothing, a fully masked row), and its output is never read. Packed segments are
    contiguous, so a window counts positions in the row."""
    mask = padding_mask(self.query_segments != 0, self.key_segments != 0)
    if self.packed:
      mask = jnp.logical_and(mask, segment_mask(self.query_segments, self.key_segments))
    if self.causal:
      mask = jnp.logical_and(mask, causal_mask(self.query_segments.shape[1]))
    if self.window:
      t, s = self.query_segments.shape[1], self.key_segments.shape[1]
      mask = jnp.logical_and(mask, window_mask(jnp.arange(t), jnp.arange(s), self.window,
                                               self.causal)[None, None])
    return mask
