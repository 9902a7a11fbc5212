"""A linear-chain CRF over per-token tag scores (Lafferty et al., 2001), as the output
layer of a tagger (Lample et al., 2016): a sentence's tag sequence y has score
  start[y_0] + sum_t emissions[t, y_t] + sum_{t>0} transitions[y_{t-1}, y_t] + end[y_last]
and probability exp(score) / Z, Z summed over all tag sequences by the forward algorithm.

Rows may be packed: a sequence starts where `starts` is True (position 0 of a segment) and
runs over the valid tokens after it, so one row holds several independent chains.
Decoding (the best sequence) is `bio.viterbi` on the host, with the same scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sequence_ends(valid: Array, starts: Array) -> Array:
  """(B, T) True at the last token of each sequence: the next token is padding, starts a
  new sequence, or does not exist."""
  next_valid = jnp.pad(valid[:, 1:], ((0, 0), (0, 1)))
  next_starts = jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))
  return valid & (~next_valid | next_starts)


def sequence_scores(emissions: Array, tags: Array, valid: Array, starts: Array,
                    start: Array, transitions: Array, end: Array) -> Array:
  """(B,) the summed scores of the given tag sequences in each row."""
  emitted = jnp.take_along_axis(emissions, tags[..., None], -1)[..., 0]
  previous = jnp.pad(tags[:, :-1], ((0, 0), (1, 0)))
  entered = jnp.where(starts, start[tags], transitions[previous, tags])
  left = jnp.where(sequence_ends(valid, starts), end[tags], 0.0)
  return jnp.where(valid, emitted + entered + left, 0.0).sum(-1)


def log_partition(emissions: Array, valid: Array, starts: Array, start: Array,
                  transitions: Array, end: Array) -> Array:
  """(B,) the summed log Z of the sequences in each row (forward algorithm)."""
  def step(carry: tuple[Array, Array, Array], xs: tuple[Array, Array, Array]):
    alpha, log_z, open_ = carry                     # (B, L), (B,), (B,): a chain is open
    emit, is_valid, is_start = xs
    closed = jax.nn.logsumexp(alpha + end, -1)
    log_z = log_z + jnp.where(is_start & open_, closed, 0.0)
    extended = jax.nn.logsumexp(alpha[:, :, None] + transitions, 1) + emit
    alpha = jnp.where(is_start[:, None], start + emit,
                      jnp.where((is_valid & ~is_start)[:, None], extended, alpha))
    return (alpha, log_z, open_ | is_start), None

  batch, _, labels = emissions.shape
  init = (jnp.zeros((batch, labels), emissions.dtype), jnp.zeros((batch,), emissions.dtype),
          jnp.zeros((batch,), bool))
  time_major = (jnp.swapaxes(emissions, 0, 1), valid.T, (starts & valid).T)
  (alpha, log_z, open_), _ = jax.lax.scan(step, init, time_major)
  return log_z + jnp.where(open_, jax.nn.logsumexp(alpha + end, -1), 0.0)


def negative_log_likelihood(emissions: Array, tags: Array, valid: Array, starts: Array,
                            start: Array, transitions: Array, end: Array) -> Array:
  """(B,) -log p(tags) summed over the sequences of each row (float32)."""
  emissions = emissions.astype(jnp.float32)
  scores = (start.astype(jnp.float32), transitions.astype(jnp.float32),
            end.astype(jnp.float32))
  return (log_partition(emissions, valid, starts, *scores)
          - sequence_scores(emissions, tags, valid, starts, *scores))
