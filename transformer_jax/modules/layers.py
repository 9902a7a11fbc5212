"""Position-wise feed-forward network and the encoder/decoder layers (paper §3.1, §3.3)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax

from transformer_jax.config import TransformerConfig
from transformer_jax.modules.attention import AttentionMask, MultiHeadAttention
from transformer_jax.sharding import partitioned

Array = jax.Array
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": nn.relu, "gelu": nn.gelu, "swish": nn.silu, "silu": nn.silu}


def layer_norm(config: TransformerConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
      param_dtype=config.params_dtype, name=name,
      scale_init=partitioned(nn.initializers.ones_init(), ("embed",)),
      bias_init=partitioned(nn.initializers.zeros_init(), ("embed",)))


def residual(x: Array, sublayer: Callable[[Array], Array], norm: nn.Module,
             dropout: nn.Dropout, norm_position: str) -> Array:
  """post-LN (paper): LayerNorm(x + Dropout(Sublayer(x)));
  pre-LN: x + Dropout(Sublayer(LayerNorm(x)))."""
  if norm_position == "pre":
    return x + dropout(sublayer(norm(x)))
  return norm(x + dropout(sublayer(x)))


class FeedForward(nn.Module):
  """FFN(x) = act(x W1 + b1) W2 + b2, d_model -> d_ff -> d_model (paper eq. 2)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, *, train: bool = False) -> Array:
    cfg = self.config
    dense = lambda features, axes, name: nn.Dense(
        features, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, name=name,
        kernel_init=partitioned(nn.initializers.xavier_uniform(), axes),
        bias_init=partitioned(nn.initializers.zeros_init(), axes[1:]))
    h = _ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ("embed", "mlp"), "wi")(x))
    h = nn.Dropout(cfg.activation_dropout_rate, deterministic=not train)(h)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h)


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each wrapped in a residual connection."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: AttentionMask | None, *, train: bool = False) -> Array:
    cfg = self.config
    dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    attention = MultiHeadAttention(cfg, "self", name="self_attention")
    ffn = FeedForward(cfg, name="feed_forward")
    x = residual(x, lambda h: attention(h, None, mask, train=train),
                 layer_norm(cfg, "self_attention_norm"), dropout, cfg.norm_position)
    return residual(x, lambda h: ffn(h, train=train),
                    layer_norm(cfg, "feed_forward_norm"), dropout, cfg.norm_position)


class DecoderLayer(nn.Module):
  """Masked self-attention, cross-attention over the encoder output, feed-forward."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: AttentionMask | None,
               cross_mask: AttentionMask, *, train: bool = False,
               decode: bool = False) -> Array:
    cfg = self.config
    dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    self_attention = MultiHeadAttention(cfg, "self", name="self_attention")
    cross_attention = MultiHeadAttention(cfg, "cross", name="cross_attention")
    ffn = FeedForward(cfg, name="feed_forward")
    y = residual(y, lambda h: self_attention(h, None, self_mask, train=train, decode=decode),
                 layer_norm(cfg, "self_attention_norm"), dropout, cfg.norm_position)
    y = residual(y, lambda h: cross_attention(h, encoded, cross_mask, train=train,
                                              decode=decode),
                 layer_norm(cfg, "cross_attention_norm"), dropout, cfg.norm_position)
    return residual(y, lambda h: ffn(h, train=train),
                    layer_norm(cfg, "feed_forward_norm"), dropout, cfg.norm_position)
