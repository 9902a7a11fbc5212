"""Encoder, Decoder, the encoder-decoder Transformer, and encoder-only heads.

Token id 0 is padding everywhere. Optional `positions` (B, T) and `segment_ids` (B, T) describe
packed batches: several sequences share a row, positions restart at 0 in each, and attention
never crosses a segment boundary.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import BOS_ID, PAD_ID, TransformerConfig
from transformer_jax.modules.attention import AttentionMask
from transformer_jax.modules.embedding import (
  CharacterFeatures,
  InputEmbedding,
  tied_projection,
  token_embedding,
)
from transformer_jax.modules.layers import DecoderLayer, EncoderLayer, layer_norm
from transformer_jax.sharding import constrain_to_batch, partitioned

Array = jax.Array


def default_positions(tokens: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


# Remat policies by config name (jax.checkpoint_policies); "none" means no remat.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def apply_layers(cfg: TransformerConfig, make_layer: Callable[[str], nn.Module],
                 num_layers: int, x: Array, *args: Any, remat: bool = True,
                 **static_kwargs: Any) -> Array:
  """x -> layer_{n-1}(...layer_0(x, *args)...), each layer called with **static_kwargs.

  Unrolled, the layers are submodules "layer_0", "layer_1", ...; with `cfg.scan_layers` one
  `nn.scan` runs a single submodule "layers" whose parameters (and decoding cache) carry a
  leading axis of size num_layers, named "layers" for sharding. `cfg.remat_policy` wraps
  each layer in `nn.remat` (pass remat=False where no gradient is taken, e.g. decoding).
  """
  def body(layer: nn.Module, carry: Array, *xs: Any) -> tuple[Array, None]:
    return constrain_to_batch(layer(carry, *xs, **static_kwargs)), None

  x = constrain_to_batch(x)

  if remat and cfg.remat_policy != "none":
    # Inside scan the loop already stops XLA from merging recomputation with the forward
    # pass, so the CSE barrier is only needed unrolled.
    body = nn.remat(body, policy=REMAT_POLICIES[cfg.remat_policy],
                    prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    scanned = nn.scan(body, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                      length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(make_layer("layers"), x, *args)[0]
  for i in range(num_layers):
    x = body(make_layer(f"layer_{i}"), x, *args)[0]
  return x


class Encoder(nn.Module):
  """Embedding + N encoder layers (+ final LayerNorm when pre-LN). Output (B, S, d_model).
  `features` (B, S, d_model), if given, are added to the token embeddings."""

  config: TransformerConfig
  embedding: nn.Embed | None = None  # Shared with the decoder when given.

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None = None,
               segment_ids: Array | None = None, *, features: Array | None = None,
               train: bool = False) -> Array:
    cfg = self.config
    embedding = self.embedding or token_embedding(cfg, cfg.vocab_size, "embedding")
    valid = tokens != PAD_ID
    mask = AttentionMask.build(valid, valid, segment_ids, segment_ids)
    if positions is None:
      positions = default_positions(tokens)
    x = InputEmbedding(cfg, embedding, name="input_embedding")(tokens, positions,
                                                                features=features, train=train)
    x = apply_layers(cfg, lambda name: EncoderLayer(cfg, name=name), cfg.num_encoder_layers,
                     x, mask, train=train)
    if cfg.norm_position == "pre":
      x = layer_norm(cfg, "final_norm")(x)
    return x


class Decoder(nn.Module):
  """Embedding + N decoder layers + output projection (+ `final_logits_bias`). Returns
  float32 logits (B, T, V).

  `tgt_tokens` are the decoder inputs (the target shifted right, starting with BOS).
  With `decode=True` the call steps a KV cache: the first call creates the cache from a
  full-length dummy target and the encoder output; each later call takes one token (B, 1)
  with its `positions` and may pass `encoded=None` (cross keys/values are cached).
  `return_hidden=True` returns the final hidden states (B, T, D) instead of logits; a call
  with `hidden=` those states runs only the output layer on them (a loss that projects the
  tokens a slice at a time: tasks/losses.py `tiled_cross_entropy_sums`).
  """

  config: TransformerConfig
  embedding: nn.Embed | None = None

  @nn.compact
  def __call__(self, encoded: Array | None, src_tokens: Array | None,
               tgt_tokens: Array | None, *, tgt_positions: Array | None = None,
               src_segment_ids: Array | None = None, tgt_segment_ids: Array | None = None,
               train: bool = False, decode: bool = False, return_hidden: bool = False,
               hidden: Array | None = None) -> Array:
    cfg = self.config
    embedding = self.embedding or token_embedding(cfg, cfg.tgt_vocab_size, "embedding")
    if hidden is not None:
      return self._output_layer(embedding, hidden, train)
    assert src_tokens is not None and tgt_tokens is not None
    tgt_valid = tgt_tokens != PAD_ID
    if decode:  # The cache builds the causal mask from its own index.
      self_mask = None
    else:
      self_mask = AttentionMask.build(tgt_valid, tgt_valid, tgt_segment_ids,
                                      tgt_segment_ids, causal=True)
    cross_mask = AttentionMask.build(tgt_valid, src_tokens != PAD_ID, tgt_segment_ids,
                                     src_segment_ids)
    if tgt_positions is None:
      tgt_positions = default_positions(tgt_tokens)

    start = BOS_ID if cfg.zero_decoder_start else None
    y = InputEmbedding(cfg, embedding, name="input_embedding")(tgt_tokens, tgt_positions,
                                                                zero_token=start, train=train)
    y = apply_layers(cfg, lambda name: DecoderLayer(cfg, name=name), cfg.num_decoder_layers,
                     y, encoded, self_mask, cross_mask, remat=not decode, train=train,
                     decode=decode)
    if cfg.norm_position == "pre":
      y = layer_norm(cfg, "final_norm")(y)
    return y if return_hidden else self._output_layer(embedding, y, train)

  @nn.nowrap
  def _output_layer(self, embedding: nn.Embed, y: Array, train: bool) -> Array:
    """Final hidden states (..., D) -> float32 logits (..., V)."""
    cfg = self.config
    if cfg.tie_output and train:
      logits = tied_projection(y.astype(cfg.compute_dtype),
                               embedding.embedding.astype(cfg.compute_dtype))
    elif cfg.tie_output:
      logits = embedding.attend(y)
    else:
      logits = nn.Dense(
          cfg.tgt_vocab_size, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
          name="output_projection",
          kernel_init=partitioned(nn.initializers.xavier_uniform(), ("embed", "vocab")),
          bias_init=partitioned(nn.initializers.zeros_init(), ("vocab",)))(y)
    if cfg.final_logits_bias:
      bias = self.param("final_logits_bias",
                        partitioned(nn.initializers.zeros_init(), ("vocab",)),
                        (cfg.tgt_vocab_size,), cfg.params_dtype)
      logits = logits + bias.astype(logits.dtype)
    return logits.astype(jnp.float32)


class Transformer(nn.Module):
  """The encoder-decoder Transformer. `__call__(src, tgt)` returns logits (B, T, V);
  `encode` and `decode` can be used on their own (`model.apply(..., method=...)`)."""

  config: TransformerConfig

  def setup(self) -> None:
    cfg = self.config
    if cfg.share_embeddings:
      source = target = token_embedding(cfg, cfg.vocab_size, "shared_embedding")
    else:
      source = token_embedding(cfg, cfg.vocab_size, "source_embedding")
      target = token_embedding(cfg, cfg.tgt_vocab_size, "target_embedding")
    self.encoder = Encoder(cfg, source)
    self.decoder = Decoder(cfg, target)

  def encode(self, src: Array, *, src_positions: Array | None = None,
             src_segment_ids: Array | None = None, train: bool = False) -> Array:
    return self.encoder(src, src_positions, src_segment_ids, train=train)

  def decode(self, encoded: Array | None, src: Array, tgt: Array, *,
             tgt_positions: Array | None = None, src_segment_ids: Array | None = None,
             tgt_segment_ids: Array | None = None, train: bool = False,
             decode: bool = False) -> Array:
    return self.decoder(encoded, src, tgt, tgt_positions=tgt_positions,
                        src_segment_ids=src_segment_ids, tgt_segment_ids=tgt_segment_ids,
                        train=train, decode=decode)

  def __call__(self, src: Array, tgt: Array, *, src_positions: Array | None = None,
               tgt_positions: Array | None = None, src_segment_ids: Array | None = None,
               tgt_segment_ids: Array | None = None, train: bool = False,
               return_hidden: bool = False) -> Array:
    """Logits (B, T, V), or with `return_hidden` the decoder's final hidden states
    (B, T, D), which `output_logits` turns into logits."""
    encoded = self.encode(src, src_positions=src_positions, src_segment_ids=src_segment_ids,
                          train=train)
    return self.decoder(encoded, src, tgt, tgt_positions=tgt_positions,
                        src_segment_ids=src_segment_ids, tgt_segment_ids=tgt_segment_ids,
                        train=train, return_hidden=return_hidden)

  def output_logits(self, hidden: Array, train: bool = False) -> Array:
    """The output layer alone: final hidden states (..., D) -> float32 logits (..., V)."""
    return self.decoder(None, None, None, hidden=hidden, train=train)


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
                 kernel_init=partitioned(nn.initializers.xavier_uniform(), ("embed", "mlp")),
                 bias_init=partitioned(nn.initializers.zeros_init(), ("mlp",)))(x)
    x = layer_norm(cfg, "mlm_norm")(nn.gelu(x)).astype(cfg.compute_dtype)
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
                  kernel_init=partitioned(nn.initializers.xavier_uniform(), ("embed", "classes")),
                  bias_init=partitioned(nn.initializers.zeros_init(), ("classes",)))
