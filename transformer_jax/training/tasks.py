"""What a model is trained on: how a batch becomes model inputs and a loss.

A task's `loss_sums(params, batch, rng, train)` returns sums over the batch (loss, counts),
so gradient accumulation and multi-device reductions normalise once, at the end.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.modules.models import Transformer
from transformer_jax.training.losses import cross_entropy_sums

Batch = dict[str, jax.Array]


class Seq2SeqTask:
  """Encoder-decoder training with teacher forcing. Batch keys: src, tgt_in (BOS + target),
  tgt_out (target + EOS); optional src/tgt_positions and src/tgt_segment_ids for packing."""

  _OPTIONAL = ("src_positions", "tgt_positions", "src_segment_ids", "tgt_segment_ids")

  def __init__(self, model: Transformer, label_smoothing: float = 0.0):
    if not 0.0 <= label_smoothing < 1.0:
      raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1)")
    self.model, self.label_smoothing = model, label_smoothing

  def init_params(self, rng: jax.Array, batch: Batch) -> Any:
    return self.model.init(rng, jnp.asarray(batch["src"]), jnp.asarray(batch["tgt_in"]))["params"]

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    extra = {k: batch[k] for k in self._OPTIONAL if k in batch}
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["src"], batch["tgt_in"], train=train,
                            rngs=rngs, **extra)

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    logits = self.logits(params, batch, rng, train)
    return cross_entropy_sums(logits, batch["tgt_out"], self.label_smoothing if train else 0.0)

  @staticmethod
  def count_tokens(batch: dict[str, Any]) -> int:
    """Non-padding source + target tokens (host side, for tokens/s)."""
    return int((batch["src"] != 0).sum() + (batch["tgt_out"] != 0).sum())
