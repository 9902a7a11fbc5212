"""Tag sequences that are valid BIO: Viterbi decoding of a tagger's per-word log-probabilities.

A per-word argmax can emit `I-X` with no `B-X`/`I-X` before it, or switch type inside a
span (`B-PER I-ORG`); conlleval then scores spans the model never meant. Decoding the most
likely sequence among the valid ones removes those errors without retraining (the "BIO
constraint" of CRF taggers, here applied to independent per-word probabilities). A tagger
with a CRF output layer (model.crf) adds its learned transition scores to the same search.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def allowed_transitions(labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(start (L,), transition (L, L)) booleans: `start[j]`: tag j may open a sentence;
  `transition[i, j]`: tag j may follow tag i. Only `I-X` is restricted: it continues a
  `B-X` or `I-X`. Tags outside the BIO scheme are unrestricted."""
  labels = list(labels)
  start = np.ones(len(labels), bool)
  transition = np.ones((len(labels), len(labels)), bool)
  for j, tag in enumerate(labels):
    if tag.startswith("I-"):
      entity = tag[2:]
      start[j] = False
      transition[:, j] = [prev in (f"B-{entity}", f"I-{entity}") for prev in labels]
  return start, transition


def viterbi(log_probs: np.ndarray, start: np.ndarray, transition: np.ndarray, *,
            scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
  """The tag ids (T,) maximising the summed per-word scores (T, L) among the sequences
  that `start` and `transition` allow. `scores`: a CRF's learned (start (L,), transition
  (L, L), end (L,)) scores, added to the path's score (see modules/crf.py)."""
  length, labels = log_probs.shape
  if length == 0:
    return np.zeros(0, np.int64)
  if scores is None:
    scores = (np.zeros(labels), np.zeros((labels, labels)), np.zeros(labels))
  start_score, transition_score, end_score = (np.asarray(s, np.float64) for s in scores)
  penalty = np.where(transition, transition_score, -np.inf)
  score = np.where(start, start_score + log_probs[0], -np.inf)
  back = np.zeros(log_probs.shape, np.int64)
  for t in range(1, length):
    candidates = score[:, None] + penalty                # (previous, current)
    back[t] = candidates.argmax(0)
    score = candidates.max(0) + log_probs[t]
  tags = np.zeros(length, np.int64)
  tags[-1] = (score + end_score).argmax()
  for t in range(length - 1, 0, -1):
    tags[t - 1] = back[t, tags[t]]
  return tags


def best_tags(per_word: np.ndarray | Sequence[np.ndarray], lengths: Sequence[int],
              allowed: tuple[np.ndarray, np.ndarray], *,
              crf: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
              constrained: bool = True) -> list[np.ndarray]:
  """Each row's tag ids over its first `lengths[i]` words, from per-word scores (B, S, L)
  or rows of them (S_i, L): the BIO-valid Viterbi path (`allowed`: from
  allowed_transitions), or each word's argmax when not `constrained`. A CRF's learned
  scores (`crf`) always decode with BIO, as the CRF was trained among BIO-valid sequences.
  Predict and serving both use it."""
  if crf is None and not constrained:
    return [np.asarray(row[:n]).argmax(-1) for row, n in zip(per_word, lengths)]
  return [viterbi(np.asarray(row[:n]), *allowed, scores=crf)
          for row, n in zip(per_word, lengths)]
