"""The normalisations a config chooses (`TransformerConfig.norm_type`): LayerNorm (the
paper's), RMSNorm (LLaMA's), and RMSNorm scaled by 1 + w (Gemma's, whose weights start at
0). One place for the layers' norms, the final norm and the query/key norms of attention."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import TransformerConfig
from transformer_jax.sharding import partitioned

Array = jax.Array


class PlusOneRMSNorm(nn.Module):
  """x / rms(x) * (1 + w), in float32 and rounded to `dtype` last, as Gemma computes it
  (its weights w start at 0, so the norm starts as RMSNorm's)."""
  epsilon: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    weight = self.param("scale", partitioned(nn.initializers.zeros_init(), (self.axis_name,)),
                        (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)


def norm(config: TransformerConfig, name: str, axis_name: str = "embed") -> nn.Module:
  """The config's normalisation over the last axis (logical name `axis_name`: "embed" for
  the residual stream, "kv" for a head's query or key): LayerNorm (its bias only with
  `use_bias`), RMSNorm, or RMSNorm scaled by 1 + w ("rms_plus_one")."""
  scale_init = partitioned(nn.initializers.ones_init(), (axis_name,))
  if config.norm_type == "rms_plus_one":
    return PlusOneRMSNorm(config.layer_norm_epsilon, config.compute_dtype,
                          config.params_dtype, axis_name, name=name)
  if config.norm_type == "rms":
    return nn.RMSNorm(epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
                      param_dtype=config.params_dtype, name=name, scale_init=scale_init)
  return nn.LayerNorm(
      epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
      param_dtype=config.params_dtype, name=name, use_bias=config.use_bias,
      scale_init=scale_init, bias_init=partitioned(nn.initializers.zeros_init(), (axis_name,)))
