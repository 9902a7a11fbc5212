"""Attention inputs for the kernel tests (tests/test_kernels*.py): rows of segments (padding,
packing, pad tails, T != S), random queries, keys and values, and each path's output at
real queries with the gradients of a random projection of it; the einsum path is the
reference. Shapes: B batch, T query length, S key length, N heads, H head dimension."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.modules.attention import attend
from transformer_jax.modules.masks import AttentionMask

Path = Callable[[jax.Array, jax.Array, jax.Array, AttentionMask], jax.Array]


def row_segments(lengths: list[int], width: int) -> list[int]:
  """Segments 1, 2, ... of the given lengths, then padding (0) to `width`."""
  row = [i + 1 for i, n in enumerate(lengths) for _ in range(n)]
  assert len(row) <= width, (lengths, width)
  return row + [0] * (width - len(row))


def segment_rows(rows: list[list[int]], width: int) -> jax.Array:
  return jnp.array([row_segments(r, width) for r in rows], jnp.int32)


def positions(segments: jax.Array) -> jax.Array:
  """Each token's position in its own segment (0 at padding), as the packer writes them."""
  starts = jnp.diff(segments, prepend=0, axis=1) != 0
  index = jnp.arange(segments.shape[1])
  return jnp.where(segments != 0, index - jax.lax.cummax(jnp.where(starts, index, 0), 1), 0)


def tokens(segments: jax.Array, vocab: int, seed: int = 0) -> jax.Array:
  """Random real token ids where `segments` is not 0, padding (0) elsewhere."""
  rng = np.random.default_rng(seed)
  return jnp.where(segments != 0, jnp.asarray(rng.integers(4, vocab, segments.shape)), 0)


class Case(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  mask: AttentionMask
  cotangent: jax.Array


def make_case(q_rows: list[list[int]], k_rows: list[list[int]] | None, t: int,
              s: int | None = None, *, packed: bool, causal: bool, heads: int = 2,
              depth: int = 64, dtype=jnp.float32, seed: int = 0,
              max_segments: int = 0) -> Case:
  """Segment rows of queries (and keys: the same rows, self-attention, if None), random
  Q, K, V of `dtype` and a float32 cotangent of the output."""
  s = t if s is None else s
  q_seg = segment_rows(q_rows, t)
  k_seg = q_seg if k_rows is None else segment_rows(k_rows, s)
  mask = AttentionMask.build(q_seg != 0, k_seg != 0, q_seg if packed else None,
                             k_seg if packed else None, causal=causal,
                             max_segments=max_segments)
  rng = np.random.default_rng(seed)
  batch = len(q_rows)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, n, heads, depth)), dtype) for n in (t, s, s))
  cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  return Case(q, k, v, mask, cotangent)


def real_queries(mask: AttentionMask) -> jax.Array:
  return (mask.query_segments != 0)[:, :, None, None]


def value_and_grads(path: Path, case: Case) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """The output at real queries (float32) and the gradients of <output, cotangent> there
  with respect to Q, K and V."""
  real = real_queries(case.mask)

  def loss(q, k, v):
    out = path(q, k, v, case.mask).astype(jnp.float32)
    return jnp.sum(jnp.where(real, out, 0.0) * case.cotangent)
  out = jnp.where(real, path(case.q, case.k, case.v, case.mask).astype(jnp.float32), 0.0)
  return out, jax.grad(loss, (0, 1, 2))(case.q, case.k, case.v)


def einsum(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
  """The reference: the einsum path with the mask's dense form."""
  return attend(q, k, v, mask.dense())


def float32_case(case: Case) -> Case:
  return case._replace(q=case.q.astype(jnp.float32), k=case.k.astype(jnp.float32),
                       v=case.v.astype(jnp.float32))


def largest_relative_error(got: jax.Array, want: jax.Array) -> float:
  """max |got - want| over max |want|: one figure for a whole array."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@functools.partial(jax.jit, static_argnums=0)
def _outputs_and_grads(path: Path, q, k, v, mask, cotangent):
  real = real_queries(mask)

  def loss(q, k, v):
    out = path(q, k, v, mask).astype(jnp.float32)
    return jnp.sum(jnp.where(real, out, 0.0) * cotangent), out
  grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


class Evaluation(NamedTuple):
  errors: list[float]       # largest relative error: output at real queries, dQ, dK, dV
  finite: bool              # the output at every position and every gradient


def evaluate(path: Path, case: Case, reference: Case | None = None) -> Evaluation:
  """`path` on `case` (one compile: forward and backward) against the float32 einsum path
  on the same inputs (or on `reference`)."""
  out, grads = _outputs_and_grads(path, *case)
  want_out, want_grads = _outputs_and_grads(einsum, *(reference or float32_case(case)))
  real = real_queries(case.mask)
  got = (jnp.where(real, out, 0.0), *grads)
  want = (jnp.where(real, want_out, 0.0), *want_grads)
  finite = all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
  return Evaluation([largest_relative_error(g, w) for g, w in zip(got, want)], finite)
