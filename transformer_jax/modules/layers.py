"""Position-wise feed-forward network and the encoder/decoder layers (paper §3.1, §3.3).

A decoder layer without cross-attention (`cross_attention=False`) is the layer of a
decoder-only language model (models.LanguageModel)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import TransformerConfig
from transformer_jax.modules.attention import MultiHeadAttention
from transformer_jax.modules.init import kernel_init
from transformer_jax.modules.masks import AttentionMask
from transformer_jax.modules.norms import norm
from transformer_jax.sharding import partitioned

Array = jax.Array
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": nn.relu, "gelu": nn.gelu, "swish": nn.silu, "silu": nn.silu,
    "relu2": lambda x: jnp.square(nn.relu(x))}


def residual(x: Array, sublayer: Callable[[Array], Array], config: TransformerConfig,
             name: str, dropout: nn.Dropout) -> Array:
  """post-LN (paper): Norm(x + Dropout(Sublayer(x)));
  pre-LN: x + Dropout(Sublayer(Norm(x)));
  pre-LN with `sandwich_norm` (Gemma 2 and 3): x + Dropout(Norm'(Sublayer(Norm(x)))).
  The norms are "<name>_norm" and "<name>_output_norm"."""
  if config.norm_position == "post":
    return norm(config, f"{name}_norm")(x + dropout(sublayer(x)))
  out = sublayer(norm(config, f"{name}_norm")(x))
  if config.sandwich_norm:
    out = norm(config, f"{name}_output_norm")(out)
  return x + dropout(out)


class FeedForward(nn.Module):
  """FFN(x) = act(x W1 + b1) W2 + b2, d_model -> d_ff -> d_model (paper eq. 2); with
  `gated_ffn`, act(x W_gate) * (x W_up) W2 (GLU variants: SwiGLU with "silu")."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, *, train: bool = False) -> Array:
    cfg = self.config
    dense = lambda features, axes, name: nn.Dense(
        features, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, name=name,
        use_bias=cfg.use_bias,
        kernel_init=partitioned(kernel_init(cfg, into_residual=name == "wo"), axes),
        bias_init=partitioned(nn.initializers.zeros_init(), axes[1:]))
    # Tokens as rows of one matrix: with (B, T, D) XLA's CPU backend wrote the activation's
    # backward transposed for the weight gradient, 1.6 ms a layer at nanoGPT's CPU recipe;
    # flat, that step takes 30.5 ms instead of 37.9 (benchmarks/RESULTS.md).
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    h = _ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ("embed", "mlp"), "wi")(x))
    if cfg.gated_ffn:
      h = h * dense(cfg.d_ff, ("embed", "mlp"), "wi_up")(x)
    h = nn.Dropout(cfg.activation_dropout_rate, deterministic=not train)(h)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h).reshape(shape[:-1] + (cfg.d_model,))


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each wrapped in a residual connection. `positions`
  (B, T) place the queries and keys (used by rotary positions). `sliding`: the layer's
  self-attention sees a window of config.sliding_window keys (config.layer_sliding)."""

  config: TransformerConfig
  sliding: bool = False

  @nn.compact
  def __call__(self, x: Array, mask: AttentionMask | None, positions: Array | None = None,
               *, train: bool = False) -> Array:
    cfg = self.config
    dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    attention = MultiHeadAttention(cfg, "self", self.sliding, name="self_attention")
    ffn = FeedForward(cfg, name="feed_forward")
    x = residual(x, lambda h: attention(h, None, mask, positions=positions, train=train),
                 cfg, "self_attention", dropout)
    return residual(x, lambda h: ffn(h, train=train), cfg, "feed_forward", dropout)


class DecoderLayer(nn.Module):
  """Masked self-attention, cross-attention over the encoder output (unless
  `cross_attention` is False: a language model's layer), feed-forward. `sliding`: the
  self-attention sees a window of config.sliding_window keys (config.layer_sliding)."""

  config: TransformerConfig
  cross_attention: bool = True
  sliding: bool = False

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: AttentionMask | None,
               cross_mask: AttentionMask | None, positions: Array | None = None, *,
               train: bool = False, decode: bool = False) -> Array:
    cfg = self.config
    dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    self_attention = MultiHeadAttention(cfg, "self", self.sliding, name="self_attention")
    ffn = FeedForward(cfg, name="feed_forward")
    y = residual(y, lambda h: self_attention(h, None, self_mask, positions=positions,
                                             train=train, decode=decode),
                 cfg, "self_attention", dropout)
    if self.cross_attention:
      cross_attention = MultiHeadAttention(cfg, "cross", name="cross_attention")
      y = residual(y, lambda h: cross_attention(h, encoded, cross_mask, train=train,
                                                decode=decode),
                   cfg, "cross_attention", dropout)
    return residual(y, lambda h: ffn(h, train=train), cfg, "feed_forward", dropout)
