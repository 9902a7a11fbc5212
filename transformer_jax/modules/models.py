"""Encoder, Decoder, the encoder-decoder Transformer, and the decoder-only LanguageModel
(the encoder-only heads are in heads.py).

Token id 0 is padding everywhere. Optional `positions` (B, T) and `segment_ids` (B, T) describe
packed batches: several sequences share a row, positions restart at 0 in each, and attention
never crosses a segment boundary.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import (
  BOS_ID,
  EOS_ID,
  NO_TOKEN_LOGIT,
  PAD_ID,
  TransformerConfig,
)
from transformer_jax.modules.embedding import InputEmbedding, tied_projection, token_embedding
from transformer_jax.modules.init import kernel_init
from transformer_jax.modules.layers import DecoderLayer, EncoderLayer
from transformer_jax.modules.masks import AttentionMask
from transformer_jax.modules.norms import norm
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


def apply_layers(cfg: TransformerConfig, make_layer: Callable[[str, int], nn.Module],
                 num_layers: int, x: Array, *args: Any, remat: bool = True,
                 **static_kwargs: Any) -> Array:
  """x -> layer_{n-1}(...layer_0(x, *args)...), each layer called with **static_kwargs;
  `make_layer(name, index)` builds layer `index`.

  Unrolled, the layers are submodules "layer_0", "layer_1", ...; with `cfg.scan_layers` one
  `nn.scan` runs a single submodule "layers" (made as layer 0: the config keeps scanned
  layers alike) whose parameters (and decoding cache) carry a leading axis of size
  num_layers, named "layers" for sharding. `cfg.remat_policy` wraps
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
    return scanned(make_layer("layers", 0), x, *args)[0]
  for i in range(num_layers):
    x = body(make_layer(f"layer_{i}", i), x, *args)[0]
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
    mask = AttentionMask.build(valid, valid, segment_ids, segment_ids,
                               max_segments=cfg.max_segments)
    if positions is None:
      positions = default_positions(tokens)
    x = InputEmbedding(cfg, embedding, name="input_embedding")(tokens, positions,
                                                                features=features, train=train)
    layer = lambda name, i: EncoderLayer(cfg, cfg.layer_sliding(i), name=name)
    x = apply_layers(cfg, layer, cfg.num_encoder_layers, x, mask, positions, train=train)
    if cfg.norm_position == "pre":
      x = norm(cfg, "final_norm")(x)
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
  cross_attention: bool = True   # False: a language model's decoder (no encoder)

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
    assert tgt_tokens is not None and (src_tokens is not None or not self.cross_attention)
    tgt_valid = tgt_tokens != PAD_ID
    if decode:  # The cache builds the causal mask from its own index.
      self_mask = None
    else:
      self_mask = AttentionMask.build(tgt_valid, tgt_valid, tgt_segment_ids,
                                      tgt_segment_ids, causal=True,
                                      max_segments=cfg.max_segments)
    cross_mask = None
    if self.cross_attention:
      assert src_tokens is not None
      cross_mask = AttentionMask.build(tgt_valid, src_tokens != PAD_ID, tgt_segment_ids,
                                       src_segment_ids, max_segments=cfg.max_segments)
    if tgt_positions is None:
      tgt_positions = default_positions(tgt_tokens)

    start = BOS_ID if cfg.zero_decoder_start else None
    # bos_is_eos: BOS reads EOS's row (GPT-2's <|endoftext|> starts and ends texts).
    embedded = jnp.where(tgt_tokens == BOS_ID, EOS_ID, tgt_tokens) if cfg.bos_is_eos else tgt_tokens
    y = InputEmbedding(cfg, embedding, name="input_embedding")(embedded, tgt_positions,
                                                                zero_token=start, train=train)
    layer = lambda name, i: DecoderLayer(cfg, self.cross_attention, cfg.layer_sliding(i),
                                         name=name)
    y = apply_layers(cfg, layer, cfg.num_decoder_layers, y, encoded, self_mask, cross_mask,
                     tgt_positions, remat=not decode, train=train, decode=decode)
    if cfg.norm_position == "pre":
      y = norm(cfg, "final_norm")(y)
    return y if return_hidden else self._output_layer(embedding, y, train)

  @nn.nowrap
  def _output_layer(self, embedding: nn.Embed, y: Array, train: bool) -> Array:
    """Final hidden states (..., D) -> float32 logits (..., V)."""
    cfg = self.config
    if cfg.tie_output and train:
      logits = tied_projection(y.astype(cfg.compute_dtype),
                               embedding.embedding.astype(cfg.compute_dtype))
    elif cfg.tie_output and y.ndim > 1 and y.shape[-2] == 1:
      # One token a row (a decoding step): the table first in the product, which XLA:CPU
      # reads row by row rather than copying it transposed at every step (GPT-2 small at
      # batch 1: 29.2 -> 26.3 ms a token, benchmarks/RESULTS.md).
      logits = jnp.einsum("vd,...d->...v", embedding.embedding.astype(cfg.compute_dtype),
                          y.astype(cfg.compute_dtype))
    elif cfg.tie_output:
      logits = embedding.attend(y)
    else:
      logits = nn.Dense(
          cfg.tgt_vocab_size, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
          name="output_projection", use_bias=cfg.use_bias,
          kernel_init=partitioned(kernel_init(cfg), ("embed", "vocab")),
          bias_init=partitioned(nn.initializers.zeros_init(), ("vocab",)))(y)
    if cfg.final_logits_bias:
      bias = self.param("final_logits_bias",
                        partitioned(nn.initializers.zeros_init(), ("vocab",)),
                        (cfg.tgt_vocab_size,), cfg.params_dtype)
      logits = logits + bias.astype(logits.dtype)
    logits = logits.astype(jnp.float32)
    if cfg.logit_softcap:
      logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
    if cfg.no_token_ids:   # ids the vocabulary has no token for are never predicted
      absent = jnp.isin(jnp.arange(logits.shape[-1]), jnp.array(cfg.no_token_ids))
      logits = jnp.where(absent, NO_TOKEN_LOGIT, logits)
    return logits


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


class LanguageModel(nn.Module):
  """The decoder-only Transformer language model: token embedding, causal self-attention
  layers (the Decoder's layers without cross-attention) and the output projection, tied
  to the embedding unless `tie_output` is False. Float32 logits (B, T, V) of the next token
  at each position.

  Packed rows pass `positions` and `segment_ids` (B, T): attention stays inside a segment.
  With `decode=True` the call steps a KV cache as `Decoder` does: the first call, on a
  full-length dummy (B, L), creates it; each later call takes one token (B, 1) and its
  `positions`. `return_hidden` / `output_logits` split off the output layer, as for the
  Transformer.
  """

  config: TransformerConfig

  def setup(self) -> None:
    cfg = self.config
    self.decoder = Decoder(cfg, token_embedding(cfg, cfg.vocab_size, "embedding"),
                           cross_attention=False)

  def __call__(self, tokens: Array, *, positions: Array | None = None,
               segment_ids: Array | None = None, train: bool = False, decode: bool = False,
               return_hidden: bool = False) -> Array:
    return self.decoder(None, None, tokens, tgt_positions=positions,
                        tgt_segment_ids=segment_ids, train=train, decode=decode,
                        return_hidden=return_hidden)

  def output_logits(self, hidden: Array, train: bool = False) -> Array:
    """The output layer alone: final hidden states (..., D) -> float32 logits (..., V)."""
    return self.decoder(None, None, None, hidden=hidden, train=train)
