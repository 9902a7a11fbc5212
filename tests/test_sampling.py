"""The top-k and top-p (nucleus) cuts of sampling.filtered_logits: the tokens kept are what a
float64 reference over the sorted vocabulary keeps, whether the cut is found among the
likeliest candidates (lax.top_k) or over the whole sorted vocabulary; and a row's cut is
the same bits whichever rows are beside it (a served row's text must not depend on them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.sampling import filtered_logits

VOCAB = 300
# (top_k, top_p) per row; the candidates are 16.
WITHIN = [(5, 1.0), (0, 0.3), (3, 0.2), (16, 0.9), (40, 0.3), (0, 1.0)]   # among 16, or none
BEYOND = [(40, 1.0), (0, 0.999)]     # k past them; a nucleus their probability cannot reach


def _logits(rows: int, seed: int = 0) -> np.ndarray:
  logits = np.random.default_rng(seed).normal(0.0, 2.0, (rows, VOCAB)).astype(np.float32)
  logits[:, :3] = -np.inf                                        # absent ids
  return logits


def _reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """float64: the k likeliest (0: all), then the smallest prefix whose probability reaches p."""
  order = np.argsort(-logits, kind="stable")
  ordered = logits[order].astype(np.float64)
  probabilities = np.exp(ordered - ordered.max())
  probabilities /= probabilities.sum()
  before = np.cumsum(probabilities) - probabilities
  keep = np.isfinite(ordered) & ((before < top_p) | (top_p >= 1))
  if top_k:
    keep &= np.arange(VOCAB) < top_k
  kept = np.zeros(VOCAB, bool)
  kept[order[keep]] = True
  return kept


def _cut(logits: np.ndarray, settings: list[tuple[int, float]]) -> np.ndarray:
  top_k = jnp.array([k for k, _ in settings])
  top_p = jnp.array([p for _, p in settings], jnp.float32)
  return np.asarray(jax.jit(filtered_logits, static_argnames="candidates")(
      jnp.asarray(logits), 1.0, top_k, top_p, candidates=16))


def test_cuts_keep_what_the_sorted_reference_keeps():
  for settings in (WITHIN, WITHIN + BEYOND):       # among the candidates; the whole sort
    logits = _logits(len(settings))
    cut = _cut(logits, settings)
    for row, (top_k, top_p) in enumerate(settings):
      kept, expected = np.isfinite(cut[row]), _reference_kept(logits[row], top_k, top_p)
      assert (expected.sum() <= 16) == ((top_k, top_p) in WITHIN[:-1]), (top_k, top_p)
      assert (kept == expected).all(), (top_k, top_p)
      assert (cut[row][kept] == logits[row][kept]).all()          # kept logits unchanged
    assert np.isfinite(cut[len(WITHIN) - 1]).sum() == VOCAB - 3          # (0, 1): no cut


def test_a_rows_cut_does_not_depend_on_the_rows_beside_it():
  logits = _logits(len(WITHIN + BEYOND), seed=1)
  beside_beyond = _cut(logits, WITHIN + BEYOND)[:len(WITHIN)]       # the whole sort ran
  alone = np.stack([_cut(logits[row:row + 1], [setting])[0]
                    for row, setting in enumerate(WITHIN)])         # among the candidates
  np.testing.assert_array_equal(alone, beside_beyond)
