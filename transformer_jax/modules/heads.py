"""Encoder-only heads: a sequence classifier, a token tagger (with an optional CRF's
scores), and the masked language model that pretrains their encoder. Each runs the
models.Encoder under the name "encoder", so a fine-tuning run's `init_from` carries it over.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.modules.embedding import CharacterFeatures, tied_projection
from transformer_jax.modules.init import kernel_init
from transformer_jax.modules.layers import norm
from transformer_jax.modules.models import Encoder
from transformer_jax.sharding import partitioned

Array = jax.Array


POOLINGS = ("mean", "max", "first")


def _encode_words(module: nn.Module, tokens: Array, chars: Array | None,
                  positions: Array | None, segment_ids: Array | None, train: bool) -> Array:
  """The encoder-only heads' encoder, with each word's character features added to its
  embedding when the head has `char_features` (then `chars` (B, T, C) is required)."""
  features = None
  if module.char_features:
    if chars is None:
      raise ValueError(f"{type(module).__name__} with char_features needs `chars` (B, T, C)")
    features = CharacterFeatures(module.config, module.char_features,
                                 name="character_features")(chars)
  return Encoder(module.config, name="encoder")(tokens, positions, segment_ids,
                                                features=features, train=train)


class EncoderClassifier(nn.Module):
  """Sequence classification: encoder, pooling over real tokens, linear layer -> (B, C).

  Packed rows (several sequences per row, as in training) pass `positions`, `segment_ids`
  and `num_segments` K: each row then yields one prediction per segment, (B, K, C), where
  slot k holds segment k + 1 (empty slots pool to zeros).
  """

  config: TransformerConfig
  num_classes: int = 2
  pooling: str = "mean"
  char_features: int = 0    # width of the character CNN; 0: words only

  def __post_init__(self) -> None:
    if not isinstance(self.num_classes, int) or self.num_classes < 2:
      raise ValueError(f"EncoderClassifier.num_classes={self.num_classes!r}: must be an "
                       "integer >= 2")
    if self.pooling not in POOLINGS:
      raise ValueError(f"EncoderClassifier.pooling={self.pooling!r}: must be one of {POOLINGS}")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: Array, *, chars: Array | None = None,
               positions: Array | None = None, segment_ids: Array | None = None,
               num_segments: int | None = None, train: bool = False) -> Array:
    cfg = self.config
    x = _encode_words(self, tokens, chars, positions, segment_ids, train)          # (B, T, D)
    valid = tokens != PAD_ID
    if segment_ids is None:
      members = valid[:, None, :]                                                  # (B, 1, T)
    else:
      if num_segments is None:
        raise ValueError("EncoderClassifier: packed inputs (segment_ids) need num_segments")
      slots = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
      members = (segment_ids[:, None, :] == slots[None, :, None]) & valid[:, None, :]
    pooled = _pool(x, members, self.pooling)                                      # (B, K, D)
    pooled = nn.Dropout(cfg.dropout_rate, deterministic=not train)(pooled)
    logits = _classifier_layer(cfg, self.num_classes)(pooled).astype(jnp.float32)
    return logits[:, 0] if segment_ids is None else logits


def _pool(x: Array, members: Array, pooling: str) -> Array:
  """x (B, T, D), members (B, K, T) booleans -> (B, K, D). A slot without members pools to
  zeros (e.g. batch padding), so the classifier layer never sees inf/NaN."""
  if pooling == "first":
    members = members & (jnp.cumsum(members, axis=-1) == 1)
  weights = members.astype(x.dtype)
  if pooling == "max":
    pooled = jnp.where(members[..., None], x[:, None], jnp.finfo(x.dtype).min).max(2)
    return jnp.where(members.any(-1)[..., None], pooled, 0)
  summed = jnp.einsum("bkt,btd->bkd", weights, x)
  if pooling == "first":
    return summed
  return summed / jnp.maximum(weights.sum(-1), 1)[..., None]


class TokenClassifier(nn.Module):
  """Token tagging (e.g. NER): encoder, linear layer per token -> (B, T, num_labels).
  Packed rows pass `positions` and `segment_ids` as for the encoder. With `crf` the module
  also holds a linear-chain CRF's start, transition and end scores (`crf_scores`), which
  the loss and the decoder read; the per-token output is the CRF's emission scores."""

  config: TransformerConfig
  num_labels: int = 9
  char_features: int = 0    # width of the character CNN; 0: words only
  crf: bool = False

  def __post_init__(self) -> None:
    if not isinstance(self.num_labels, int) or self.num_labels < 2:
      raise ValueError(f"TokenClassifier.num_labels={self.num_labels!r}: must be an "
                       "integer >= 2")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: Array, *, chars: Array | None = None,
               positions: Array | None = None, segment_ids: Array | None = None,
               train: bool = False) -> Array:
    cfg = self.config
    x = _encode_words(self, tokens, chars, positions, segment_ids, train)
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    if self.crf:
      for name, shape, axes in _CRF_PARAMS:
        self.param(name, partitioned(nn.initializers.zeros_init(), axes),
                   shape(self.num_labels), cfg.params_dtype)
    return _classifier_layer(cfg, self.num_labels)(x).astype(jnp.float32)


class MaskedLanguageModel(nn.Module):
  """Masked-LM pretraining of the encoder (BERT): encoder, a transform (dense, GELU,
  LayerNorm), then logits tied to the encoder's token embedding plus a bias -> (B, T, V).
  The encoder and character features carry the names they have in EncoderClassifier and
  TokenClassifier, so a fine-tuning run's `init_from` takes them over; the rest is the
  pretraining head, which it leaves behind."""

  config: TransformerConfig
  char_features: int = 0    # width of the character CNN; 0: words only

  @nn.compact
  def __call__(self, tokens: Array, *, chars: Array | None = None,
               positions: Array | None = None, segment_ids: Array | None = None,
               predict_at: Array | None = None, train: bool = False) -> Array:
    """Logits (B, T, V), or (B, K, V) at the positions `predict_at` (B, K) only: the
    output layer is most of the cost, and the loss reads only the masked positions."""
    cfg = self.config
    x = _encode_words(self, tokens, chars, positions, segment_ids, train)          # (B, T, D)
    if predict_at is not None:
      x = jnp.take_along_axis(x, predict_at[..., None], axis=1)                     # (B, K, D)
    x = nn.Dense(cfg.d_model, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                 name="mlm_transform",
                 kernel_init=partitioned(kernel_init(cfg), ("embed", "mlp")),
                 bias_init=partitioned(nn.initializers.zeros_init(), ("mlp",)))(x)
    x = norm(cfg, "mlm_norm")(nn.gelu(x)).astype(cfg.compute_dtype)
    table = nn.meta.unbox(self.variables["params"]["encoder"]["embedding"]["embedding"])
    table = table.astype(cfg.compute_dtype)                                          # (V, D)
    logits = tied_projection(x, table) if train else jnp.einsum("btd,vd->btv", x, table)
    bias = self.param("mlm_bias", partitioned(nn.initializers.zeros_init(), ("vocab",)),
                      (cfg.vocab_size,), cfg.params_dtype)
    return (logits + bias.astype(logits.dtype)).astype(jnp.float32)


_CRF_PARAMS = (("crf_start", lambda n: (n,), ("classes",)),
               ("crf_transitions", lambda n: (n, n), ("classes", None)),
               ("crf_end", lambda n: (n,), ("classes",)))


def crf_scores(params: Any) -> tuple[Array, Array, Array]:
  """A `TokenClassifier(crf=True)`'s (start (L,), transitions (L, L), end (L,)) scores from
  its parameters (`transitions[i, j]`: tag j after tag i)."""
  return tuple(nn.meta.unbox(params[name]) for name, _, _ in _CRF_PARAMS)


def _classifier_layer(cfg: TransformerConfig, num_outputs: int) -> nn.Dense:
  return nn.Dense(num_outputs, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                  name="classifier",
                  kernel_init=partitioned(kernel_init(cfg), ("embed", "classes")),
                  bias_init=partitioned(nn.initializers.zeros_init(), ("classes",)))
