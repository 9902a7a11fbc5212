"""What the encoder-only tasks (classification, tagging) share: one token sequence per
example, packed rows with positions and segment ids, logits from the encoder's head."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import PAD_ID
from transformer_jax.run_config import DecodeOptions
from transformer_jax.tasks.base import Batch, Task, padded_getter


class EncoderTask(Task):
  """Batch keys: tokens, positions, segment_ids, plus the task's targets."""

  token_keys = {"tokens": "source"}
  counted_keys = ("tokens",)

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._argmax = jax.jit(lambda params, batch: jnp.argmax(
        self.logits(params, batch, None, False), -1))

  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    get = padded_getter(packed, rows)
    return {"tokens": get("tokens"), "positions": get("tokens_positions"),
            "segment_ids": get("tokens_segment_ids"), **self._targets(get)}

  def _targets(self, get: Any) -> dict[str, np.ndarray]:
    """The task's target arrays from the packed features."""
    raise NotImplementedError

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((rows, length), jnp.int32)
            for k in ("tokens", "positions", "segment_ids")}

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"], train=train, rngs=rngs,
                            **self._extra_inputs(batch))

  def _extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    return {}

  def serving_function(self, decode: DecodeOptions) -> Callable[[Any, jax.Array], jax.Array]:
    def scores(params: Any, tokens: jax.Array) -> jax.Array:
      return self._serving_scores(self.logits(params, self._serving_batch(tokens), None, False))
    return scores

  def _serving_batch(self, tokens: jax.Array) -> dict[str, jax.Array]:
    """One sequence per row, with the positions and segment ids the packer writes for it
    (padding: position 0, segment 0)."""
    real = tokens != PAD_ID
    positions = jnp.where(real, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], 0)
    return {"tokens": tokens, "positions": positions, "segment_ids": real.astype(jnp.int32)}

  def _serving_scores(self, logits: jax.Array) -> jax.Array:
    """The exported output from the model's logits."""
    raise NotImplementedError
