"""Label-smoothed cross-entropy (paper §5.4, epsilon 0.1), and the loss of the tasks whose
model ends in the vocabulary's projection (`TokenPredictingTask`: translation, language
modelling)."""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp

from transformer_jax.config import PAD_ID
from transformer_jax.errors import UserError
from transformer_jax.tasks.base import Batch, Task


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


@jax.named_scope("loss")   # a profile's (and aot.roofline's) family
def cross_entropy_sums(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0,
                       weights: jax.Array | None = None) -> dict[str, jax.Array]:
  """Sums over non-padding tokens (normalise by "weight" after summing across devices or
  micro-batches):
    loss: label-smoothed cross-entropy minus the smoothing entropy (0 for a perfect model),
    nll: plain negative log-likelihood (for perplexity), correct: tokens whose target has
    the largest logit (a tie counts as a hit), weight: count.
  """
  if weights is None:
    weights = (targets != PAD_ID).astype(jnp.float32)
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  # Every statistic is a reduction over the same (tokens, vocabulary) logits, so XLA fuses
  # them into few passes and keeps no (tokens, vocabulary) float32 intermediate: the
  # smoothed loss in closed form, sum_k q_k (log Z - z_k) = log Z - low * sum_k z_k
  # - (1 - eps - low) * z_target, instead of materialising the smoothed targets q
  # (`smoothed_targets`). For the big model's bf16 step on v5p-8 XLA's TPU cost model
  # estimates 43.9 -> 42.1 ms and 8.5 -> 7.6 GiB per chip (benchmarks/RESULTS.md).
  # One max serves the stable log-sum-exp and the hit count: an argmax over the vocabulary
  # is a pass of its own (value and index): about 4.5% of the Multi30k step on the CPU.
  top = jax.lax.stop_gradient(logits.max(-1))
  log_z = top + jnp.log(jnp.exp(logits - top[..., None]).sum(-1))
  is_target = jnp.arange(vocab) == targets[..., None]
  target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), -1)
  nll = log_z - target_logit
  low = smoothing / (vocab - 1)
  loss = (log_z - low * logits.sum(-1) - (1.0 - smoothing - low) * target_logit
          - smoothing_entropy(vocab, smoothing))
  correct = (target_logit >= top).astype(jnp.float32)
  return {"loss": (loss * weights).sum(), "nll": (nll * weights).sum(),
          "correct": (correct * weights).sum(), "weight": weights.sum()}


class TokenPredictingTask(Task):
  """A task whose model predicts the next token of `target_key` over the vocabulary: its
  head option `model.loss_tiles`, and its label-smoothed loss. The model has an
  `output_logits` method (hidden states -> logits), and `logits(..., return_hidden=True)`
  gives its final hidden states."""

  # model.loss_tiles: the output layer and its loss run over this many slices of the target
  # positions, so the (tokens, vocabulary) logits are never held whole (1: one pass).
  head_options = {"loss_tiles": 1}
  target_key: ClassVar[str]

  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    tiles = head["loss_tiles"]
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
      raise UserError(f"model.loss_tiles={tiles!r}: must be an integer >= 1 (1: the whole "
                      "output layer at once)")

  @abc.abstractmethod
  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool,
             return_hidden: bool = False) -> jax.Array:
    ...

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    smoothing, tiles = self.label_smoothing if train else 0.0, self.head["loss_tiles"]
    targets = batch[self.target_key]
    if tiles == 1:
      return cross_entropy_sums(self.logits(params, batch, rng, train), targets, smoothing)
    project = lambda h: self.model.apply({"params": params}, h, train=train,
                                         method=type(self.model).output_logits)
    hidden = self.logits(params, batch, rng, train, return_hidden=True)
    return tiled_cross_entropy_sums(project, hidden, targets, smoothing, tiles)


def tiled_cross_entropy_sums(project: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                             targets: jax.Array, smoothing: float,
                             tiles: int) -> dict[str, jax.Array]:
  """`cross_entropy_sums(project(hidden), targets, smoothing)` without ever holding the
  (tokens, vocabulary) logits whole: the target positions are cut into `tiles` slices (every
  row keeps its batch sharding), and each slice is projected, reduced to its sums and its
  logits dropped before the next; the backward pass recomputes each slice's logits. The
  same sums, label smoothing included; `project` maps hidden states (B, t, D) to logits.
  """
  batch, length, depth = hidden.shape
  if length % tiles:
    raise UserError(f"model.loss_tiles={tiles} does not divide the {length} target positions "
                    "of a batch row; choose a divisor of data.max_length")
  # (B, T, ...) -> (tiles, B, T / tiles, ...): the scan runs over the first axis.
  tiled = lambda x: jnp.moveaxis(x.reshape(batch, tiles, length // tiles, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def tile_sums(h: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
    return cross_entropy_sums(project(h), y, smoothing)

  def add(total: dict[str, jax.Array], tile: tuple[jax.Array, jax.Array]):
    sums = tile_sums(*tile)
    return {k: total[k] + sums[k] for k in total}, None

  zero = jnp.zeros((), jnp.float32)
  total, _ = jax.lax.scan(add, {k: zero for k in ("loss", "nll", "correct", "weight")},
                          (tiled(hidden), tiled(targets)))
  return total
