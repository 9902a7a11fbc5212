"""What the encoder-only tasks (classification, tagging) share: one token sequence per
example, packed rows with positions and segment ids, logits from the encoder's head, and
the word-level options of the head:

  model.char_features   width of a character CNN over each word's bytes, added to its
                        embedding (0: off). Needs data.tokenizer="words"; the batch then
                        carries chars (B, T, model.char_max_length).
  model.char_max_length bytes kept per word (longer words keep their first ones).
  model.word_dropout    in training, each word id becomes <unk> with this probability, so
                        the model also learns to read a word from its characters.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import PAD_ID, UNK_ID
from transformer_jax.errors import UserError
from transformer_jax.inputs import character_ids
from transformer_jax.options import DecodeOptions
from transformer_jax.tasks.base import Batch, Example, Task, padded_getter


class EncoderTask(Task):
  """Batch keys: tokens, positions, segment_ids, [chars,] plus the task's targets."""

  token_keys = {"tokens": "source"}
  counted_keys = ("tokens",)
  head_options = {"char_features": 0, "char_max_length": 16, "word_dropout": 0.0}
  carried_head_options = ("char_features", "char_max_length")   # the character CNN's

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    if self.head["char_features"]:
      self.sequence_keys = (*type(self).sequence_keys, "chars")
    self._argmax = jax.jit(lambda params, batch: jnp.argmax(
        self.logits(params, batch, None, False), -1))

  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    for field, low in (("char_features", 0), ("char_max_length", 1)):
      value = head[field]
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"model.{field}={value!r}: must be an integer >= {low}")
    if not isinstance(head["word_dropout"], (int, float)) or not 0 <= head["word_dropout"] < 1:
      raise UserError(f"model.word_dropout={head['word_dropout']!r}: must be in [0, 1)")
    if head["char_features"] and tokenizer_kind not in (None, "words"):
      raise UserError(f"model.char_features={head['char_features']} reads the characters of "
                      f"words, but data.tokenizer={tokenizer_kind!r} splits text into "
                      "subwords; set data.tokenizer='words' or model.char_features=0")

  def _word_features(self, words: list[str]) -> Example:
    """The per-word arrays besides token ids: each word's bytes with char_features."""
    if not self.head["char_features"]:
      return {}
    return {"chars": character_ids(words, self.head["char_max_length"])}

  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    get = padded_getter(packed, rows)
    chars = {"chars": get("chars")} if self.head["char_features"] else {}
    return {"tokens": get("tokens"), "positions": get("tokens_positions"),
            "segment_ids": get("tokens_segment_ids"), **chars, **self._targets(get)}

  def _targets(self, get: Any) -> dict[str, np.ndarray]:
    """The task's target arrays from the packed features."""
    raise NotImplementedError

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    spec = {k: jax.ShapeDtypeStruct((rows, length), jnp.int32)
            for k in ("tokens", "positions", "segment_ids")}
    if self.head["char_features"]:
      spec["chars"] = jax.ShapeDtypeStruct((rows, length, self.head["char_max_length"]),
                                           jnp.int32)
    return spec

  def init_params(self, rng: jax.Array) -> Any:
    dummy = self._serving_batch(jnp.ones((1, 4), jnp.int32))
    if self.head["char_features"]:
      dummy["chars"] = jnp.ones((1, 4, self.head["char_max_length"]), jnp.int32)
    return self.model.init(rng, dummy["tokens"], **self._model_inputs(dummy))["params"]

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    tokens, rngs = batch["tokens"], {}
    if train:
      rng, word_rng = jax.random.split(rng) if self.head["word_dropout"] else (rng, None)
      rngs = {"dropout": rng}
      if word_rng is not None:
        dropped = jax.random.bernoulli(word_rng, self.head["word_dropout"], tokens.shape)
        tokens = jnp.where(dropped & (tokens != PAD_ID), UNK_ID, tokens)
    return self.model.apply({"params": params}, tokens, train=train, rngs=rngs,
                            **self._model_inputs(batch))

  def _model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The model's keyword inputs besides the token ids."""
    chars = {"chars": batch["chars"]} if self.head["char_features"] else {}
    return {"positions": batch["positions"], "segment_ids": batch["segment_ids"], **chars,
            **self._extra_inputs(batch)}

  def _extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    return {}

  def attention(self, params: Any, text: str, output: str) -> tuple[Any, dict[str, list[str]]]:
    example = self.featurize(self.record_from_line(text))
    batch = {k: v[None] for k, v in example.items()}
    batch = {**self._serving_batch(jnp.asarray(batch["tokens"])), **batch}
    _, state = self._einsum_model().apply({"params": params}, batch["tokens"],
                                          mutable=["intermediates"],
                                          **self._model_inputs(batch))
    return state["intermediates"], {
        "source": self._token_labels(self.tokenizer, example["tokens"])}

  def serving_function(self, decode: DecodeOptions) -> Callable[..., jax.Array]:
    def scores(params: Any, tokens: jax.Array, chars: jax.Array | None = None) -> jax.Array:
      batch = self._serving_batch(tokens)
      if chars is not None:
        batch["chars"] = chars
      return self._serving_scores(self.logits(params, batch, None, False))
    return scores

  def serving_word_bytes(self) -> int | None:
    return self.head["char_max_length"] if self.head["char_features"] else None

  def _serving_batch(self, tokens: jax.Array) -> dict[str, jax.Array]:
    """One sequence per row, with the positions and segment ids the packer writes for it
    (padding: position 0, segment 0)."""
    real = tokens != PAD_ID
    positions = jnp.where(real, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], 0)
    return {"tokens": tokens, "positions": positions, "segment_ids": real.astype(jnp.int32)}

  def _serving_scores(self, logits: jax.Array) -> jax.Array:
    """The exported output from the model's logits."""
    raise NotImplementedError
