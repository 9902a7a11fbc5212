"""Label-smoothed cross-entropy (paper §5.4, epsilon 0.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from transformer_jax.config import PAD_ID


def smoothed_targets(targets: jax.Array, vocab_size: int, smoothing: float) -> jax.Array:
  """1 - eps on the true class, eps / (V - 1) on every other class."""
  low = smoothing / (vocab_size - 1)
  return jax.nn.one_hot(targets, vocab_size) * (1.0 - smoothing - low) + low


def smoothing_entropy(vocab_size: int, smoothing: float) -> float:
  """Entropy of the smoothed target distribution: the loss of a perfect model."""
  import math
  confidence, low = 1.0 - smoothing, smoothing / (vocab_size - 1)
  entropy = -confidence * math.log(confidence) if confidence > 0 else 0.0
  if low > 0:
    entropy -= (vocab_size - 1) * low * math.log(low)
  return entropy


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0,
                       weights: jax.Array | None = None) -> dict[str, jax.Array]:
  """Sums over non-padding tokens (normalise by "weight" after summing across devices or
  micro-batches):
    loss: label-smoothed cross-entropy minus the smoothing entropy (0 for a perfect model),
    nll: plain negative log-likelihood (for perplexity), correct: argmax hits, weight: count.
  """
  if weights is None:
    weights = (targets != PAD_ID).astype(jnp.float32)
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  soft = smoothed_targets(targets, vocab, smoothing)
  loss = optax.softmax_cross_entropy(logits, soft) - smoothing_entropy(vocab, smoothing)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return {"loss": (loss * weights).sum(), "nll": (nll * weights).sum(),
          "correct": (correct * weights).sum(), "weight": weights.sum()}
