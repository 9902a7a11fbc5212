"""Token embeddings (scaled by sqrt(d_model), paper §3.4) and positional encodings (§3.5,
learned, or rotary: applied to queries and keys by the attention, `rotary`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.modules.init import embedding_init
from transformer_jax.sharding import partitioned

Array = jax.Array


def sinusoidal_table(max_len: int, d_model: int, layout: str = "interleaved") -> np.ndarray:
  """PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(same angle).

  layout "halves" puts the same sines in the first ceil(d_model / 2) dimensions and the
  cosines after them (Marian), instead of interleaving them.
  """
  positions = np.arange(max_len, dtype=np.float64)[:, None]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
  angles = positions / np.power(10000.0, two_i / d_model)
  table = np.zeros((max_len, d_model), np.float64)
  table[:, 0::2] = np.sin(angles)
  table[:, 1::2] = np.cos(angles[:, : d_model // 2])
  if layout == "halves":
    table = table[:, interleaved_to_halves(d_model)]
  return table.astype(np.float32)


def interleaved_to_halves(d_model: int) -> np.ndarray:
  """The permutation of model dimensions that turns the interleaved sinusoid layout into
  "halves": even dimensions first, then odd ones (x[..., perm] re-lays a vector)."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


@jax.custom_vjp
def tied_projection(x: Array, table: Array) -> Array:
  """Output projection tied to the embedding: x (..., D) @ table (V, D)^T -> (..., V).

  Same values as `nn.Embed.attend`; only its gradient is arranged differently: the table's
  gradient is computed as (x^T g)^T, so the compiler transposes the small (D, V) result
  rather than the (tokens, V) cotangent, which XLA:CPU otherwise copies in full (about a
  third of the output layer's backward time). Reverse-mode only (a custom VJP), so the
  model uses it where gradients are taken, in training mode.
  """
  return jnp.einsum("...d,vd->...v", x, table)


def _tied_projection_fwd(x: Array, table: Array) -> tuple[Array, tuple[Array, Array]]:
  return tied_projection(x, table), (x, table)


def _tied_projection_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  x, table = residuals
  return jnp.einsum("...v,vd->...d", g, table), jnp.einsum("...d,...v->dv", x, g).T


tied_projection.defvjp(_tied_projection_fwd, _tied_projection_bwd)


def token_embedding(config: TransformerConfig, vocab_size: int, name: str) -> nn.Embed:
  """Embedding table (`init.embedding_init`: with "xavier" its rows have norm ~1 after the
  sqrt(d_model) input scaling, so the tied output projection (x @ E^T) starts with
  unit-scale logits)."""
  return nn.Embed(
      num_embeddings=vocab_size, features=config.d_model, dtype=config.compute_dtype,
      param_dtype=config.params_dtype, name=name,
      embedding_init=partitioned(embedding_init(config), ("vocab", "embed")))


def rotary_frequencies(config: TransformerConfig, sliding: bool = False) -> np.ndarray:
  """The (H/2,) float32 angles per position of a layer's rotary pairs: theta^(-2i/H), with
  the config's rope scaling. "linear" divides every frequency by the factor (positions
  interpolated); "llama3" (Llama 3.1) divides only the low frequencies, whose wavelength
  exceeds original_max_len / low_freq_factor, keeps those shorter than original_max_len /
  high_freq_factor and blends the ones between. A sliding layer with `local_rope_theta`
  (Gemma 3) takes that base, unscaled. Computed in float64 once, at trace time."""
  half = config.head_dim // 2
  local = sliding and config.local_rope_theta > 0
  theta = config.local_rope_theta if local else config.rope_theta
  frequencies = theta ** (-np.arange(half, dtype=np.float64) / half)
  kind, factor = ("none", 1.0) if local else (config.rope_scaling, config.rope_scaling_factor)
  if kind == "linear":
    frequencies = frequencies / factor
  elif kind == "llama3":
    context = config.rope_original_max_len
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelengths = 2 * np.pi / frequencies
    smooth = (context / wavelengths - low) / (high - low)
    blended = (1 - smooth) * frequencies / factor + smooth * frequencies
    frequencies = np.where(wavelengths > context / low, frequencies / factor,
                           np.where(wavelengths < context / high, frequencies, blended))
  return frequencies.astype(np.float32)


def rotary(x: Array, positions: Array, frequencies: Array | np.ndarray | float) -> Array:
  """Rotary position embedding (RoPE, Su et al. 2021) of queries or keys x (B, T, N, H) at
  positions (B, T): dimension i of the first half and i + H/2 of the second form a pair
  rotated by the angle position * frequencies[i] (`rotary_frequencies`; a number is the
  unscaled base theta, frequencies theta^(-2i/H)), in the "rotate half" layout of GPT-NeoX
  and LLaMA, so a rotated query and key have a dot product that depends only on their
  positions' difference. Angles in float32: bf16 positions lose precision past 256."""
  half = x.shape[-1] // 2
  if isinstance(frequencies, (int, float)):
    frequencies = frequencies ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(frequencies)   # (B, T, H/2)
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
  return rotated.astype(x.dtype)


class PositionalEncoding(nn.Module):
  """Adds positional information at explicit positions (B, T), so packed sequences can
  restart at 0."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    cfg = self.config
    if cfg.positional == "rotary":   # the attention rotates queries and keys instead
      return x
    if cfg.positional == "sinusoidal":
      table = jnp.asarray(sinusoidal_table(cfg.max_len, cfg.d_model, cfg.sinusoidal_layout))
    else:
      table = self.param("position_embedding",
                         partitioned(nn.initializers.normal(stddev=0.02), ("length", "embed")),
                         (cfg.max_len, cfg.d_model), cfg.params_dtype)
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)


class InputEmbedding(nn.Module):
  """tokens -> dropout(embed(tokens) * sqrt(d_model) [+ features] + PE(positions)), where
  `features` (B, T, d_model) are optional extra per-token vectors (e.g. a word's spelling,
  `CharacterFeatures`); the token `zero_token`, if given, embeds to zeros. Without
  `config.scale_embeddings` the embeddings are not scaled (GPT-2)."""

  config: TransformerConfig
  embedding: nn.Embed

  @nn.compact
  def __call__(self, tokens: Array, positions: Array, *, features: Array | None = None,
               zero_token: int | None = None, train: bool = False) -> Array:
    cfg = self.config
    x = self.embedding(tokens)
    if cfg.scale_embeddings:
      x = x * jnp.sqrt(cfg.d_model).astype(cfg.compute_dtype)
    if zero_token is not None:
      x = jnp.where((tokens == zero_token)[..., None], jnp.zeros((), x.dtype), x)
    if features is not None:
      x = x + features.astype(x.dtype)
    x = PositionalEncoding(cfg, name="positional")(x, positions)
    return nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)


# Character ids: a word's UTF-8 bytes + 1, 0 for padding (inputs.character_ids).
BYTE_VOCAB_SIZE = 257


class CharacterFeatures(nn.Module):
  """A word's bytes (B, T, C) -> one vector per word (B, T, d_model): byte embeddings, a
  convolution over neighbouring bytes, max-pooling over the word (the character CNN of Ma
  & Hovy, 2016), and a projection to d_model. Padding bytes embed to zeros, so a word's
  vector does not depend on how much padding follows it; a padding word (no bytes) gets
  zeros."""

  config: TransformerConfig
  features: int
  embed_dim: int = 32
  width: int = 3

  @nn.compact
  def __call__(self, chars: Array) -> Array:
    cfg = self.config
    real = chars != 0                                                     # (B, T, C)
    x = nn.Embed(BYTE_VOCAB_SIZE, self.embed_dim, dtype=cfg.compute_dtype,
                 param_dtype=cfg.params_dtype, name="byte_embedding",
                 embedding_init=partitioned(nn.initializers.normal(stddev=1.0),
                                            (None, None)))(chars)
    x = x * real[..., None].astype(x.dtype)
    x = nn.Conv(self.features, (self.width,), padding="SAME", dtype=cfg.compute_dtype,
                param_dtype=cfg.params_dtype, name="convolution",
                kernel_init=partitioned(nn.initializers.lecun_normal(), (None, None, None)),
                bias_init=partitioned(nn.initializers.zeros_init(), (None,)))(x)
    x = jnp.where(real[..., None], x, jnp.finfo(x.dtype).min).max(-2)     # (B, T, F)
    x = jnp.where(real.any(-1)[..., None], x, 0)
    return nn.Dense(cfg.d_model, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                    name="projection",
                    kernel_init=partitioned(nn.initializers.xavier_uniform(), (None, "embed")),
                    bias_init=partitioned(nn.initializers.zeros_init(), ("embed",)))(x)
