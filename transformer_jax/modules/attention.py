"""Scaled dot-product attention (the einsum and XLA paths here, the fused kernels in
kernels.py) and multi-head attention with a KV cache.

Shapes: B batch, T query length, S key length, N heads, H head dimension (d_k).
A model describes its masks as an `AttentionMask` (masks.py: segment ids, a causal flag, a
sliding window), which each path turns into what it takes: the einsum and XLA paths a
dense boolean (B, 1, T, S) mask, True where a query may attend to a key; the kernels
lengths, offsets or segment ids. Scores are Q K^T times `scale`, 1/sqrt(H) unless the
config says otherwise (`TransformerConfig.attention_scale`).
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import TransformerConfig
from transformer_jax.modules import kernels
from transformer_jax.modules.embedding import rotary, rotary_frequencies
from transformer_jax.modules.init import kernel_init
from transformer_jax.modules.masks import AttentionMask, window_mask
from transformer_jax.modules.norms import norm
from transformer_jax.sharding import partitioned

Array = jax.Array


# ------------------------------------------------------------------- dot-product attention
def _scores(query: Array, key: Array) -> Array:
  """Q K^T: (B, T, N, H), (B, S, K, H) -> (B, N, T, S). With K < N (grouped-query attention)
  each key head serves N / K consecutive query heads, read once rather than repeated."""
  batch, t, heads, depth = query.shape
  groups = heads // key.shape[2]
  grouped = query.reshape(batch, t, key.shape[2], groups, depth)
  scores = jnp.einsum("btkgh,bskh->bkgts", grouped, key)
  return scores.reshape(batch, heads, t, key.shape[1])


def _weighted_sum(weights: Array, value: Array, **einsum_options) -> Array:
  """weights V: (B, N, T, S), (B, S, K, H) -> (B, T, N, H), value heads shared as `_scores`
  shares key heads."""
  batch, heads, t, s = weights.shape
  groups = heads // value.shape[2]
  grouped = weights.reshape(batch, value.shape[2], groups, t, s)
  out = jnp.einsum("bkgts,bskh->btkgh", grouped, value, **einsum_options)
  return out.reshape(batch, t, heads, value.shape[3])


def default_scale(query: Array) -> float:
  """1 / sqrt(d_k), the paper's scale of the scores."""
  return float(query.shape[-1]) ** -0.5


def _masked_logits(query: Array, key: Array, mask: Array | None,
                   scale: float | None = None) -> Array:
  """Q K^T * scale (default 1 / sqrt(d_k)) in the compute dtype, masked keys at its lowest
  value, as float32: the softmax's exponentials and sums are where bf16 would lose
  precision."""
  if scale is None:
    logits = _scores(query, key) / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  else:
    logits = _scores(query, key) * jnp.asarray(scale, query.dtype)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  return logits.astype(jnp.float32)


def attention_weights(query: Array, key: Array, mask: Array | None,
                      scale: float | None = None) -> Array:
  """softmax(Q K^T / sqrt(d_k)) with masked logits: (B,T,N,H),(B,S,K,H) -> (B,N,T,S)."""
  return jax.nn.softmax(_masked_logits(query, key, mask, scale), axis=-1).astype(query.dtype)


def attend(query: Array, key: Array, value: Array, mask: Array | None,
           dropout: Callable[[Array], Array] | None = None,
           scale: float | None = None) -> Array:
  """softmax(Q K^T / sqrt(d_k)) V with the normalisation moved after the weighted sum, as
  flash attention does: exp(logits - max) goes into the product unnormalised, and the
  (B, T, N, H) output, not the (B, N, T, S) weights, is divided by the row sums. That saves a
  pass over the weights forward, and backward the softmax's row reduction over the
  (B, N, T, S) gradient becomes one over the output's H (XLA's TPU cost model: see
  benchmarks/RESULTS.md). Same precision as `attention_weights`: exponentials and sums in
  float32, the weights rounded to the compute dtype for the product, which accumulates in
  float32 before the division. `dropout` acts on the weights, as dropout(softmax) does."""
  logits = _masked_logits(query, key, mask, scale)
  # The row max only keeps exp() in range; the softmax does not depend on it.
  unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
  row_sums = unnormalized.sum(-1)                                          # (B, N, T)
  if dropout is not None:
    unnormalized = dropout(unnormalized)
  products = _weighted_sum(unnormalized.astype(query.dtype), value,
                           preferred_element_type=jnp.float32)
  return _divide_by_row_sums(products, row_sums, query.dtype)


def _per_query(row_sums: Array) -> Array:
  return jnp.swapaxes(row_sums, 1, 2)[..., None]                       # (B, T, N, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _divide_by_row_sums(products: Array, row_sums: Array, dtype: jnp.dtype) -> Array:
  """(B, T, N, H) float32 products / (B, N, T) row sums, rounded to `dtype`. Its own VJP
  keeps the rounded output for the backward pass, not the float32 products (autodiff would
  keep those: 2x the bytes under bf16)."""
  return (products / _per_query(row_sums)).astype(dtype)


def _divide_forward(products: Array, row_sums: Array,
                    dtype: jnp.dtype) -> tuple[Array, tuple[Array, Array]]:
  out = _divide_by_row_sums(products, row_sums, dtype)
  return out, (out, row_sums)


def _divide_backward(dtype: jnp.dtype, residuals: tuple[Array, Array],
                     grad: Array) -> tuple[Array, Array]:
  del dtype
  out, row_sums = residuals
  d_products = grad.astype(jnp.float32) / _per_query(row_sums)
  # d(p / l)/dl = -(p / l) / l: the output's row dot product with its gradient (flash
  # attention's D), over H, instead of a reduction over the (B, N, T, S) weights.
  d_row_sums = -jnp.swapaxes((d_products * out.astype(jnp.float32)).sum(-1), 1, 2)
  return d_products, d_row_sums


_divide_by_row_sums.defvjp(_divide_forward, _divide_backward)


def dot_product_attention(query: Array, key: Array, value: Array,
                          mask: AttentionMask | Array | None,
                          implementation: str = "xla", scale: float | None = None) -> Array:
  """Attention output (B, T, N, H).

  "einsum" is the explicit path, `attend`; "xla" goes through
  `jax.nn.dot_product_attention` with a dense mask; the fused kernels of kernels.py
  ("pallas", "cudnn", "cudnn_dense", "splash") take the `AttentionMask` as they take it
  natively; "auto" is what the platform being compiled for proved exact and fastest
  (kernels.AUTO). A kernel that cannot run here falls back to "xla" with a warning naming
  the reason; a dense mask (the decoding cache's) takes the einsum or XLA path. `scale`
  multiplies the scores (default 1 / sqrt(H)).
  """
  implementation = kernels.resolve(implementation)
  if implementation in kernels.KERNELS and isinstance(mask, AttentionMask):
    heads = query.shape[2]      # the kernels take as many key and value heads as query heads
    fused = kernels.fused_attention(query, _shared_by_groups(key, heads),
                                    _shared_by_groups(value, heads), mask, implementation,
                                    default_scale(query) if scale is None else scale)
    if fused is not None:
      return fused
  if isinstance(mask, AttentionMask):
    mask = mask.dense()
  if implementation == "einsum":
    return attend(query, key, value, mask, scale=scale)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
  return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                      implementation="xla")


# ----------------------------------------------------------------------- multi-head module
def _stacked(init: Callable, count: int) -> Callable:
  """Initialiser of a flat (fan_in, count * F) kernel as `count` independent (fan_in, F)
  kernels side by side (DenseGeneral initialises the flattened kernel)."""
  def stacked_init(key: Array, shape: tuple[int, int], dtype=jnp.float32) -> Array:
    parts = [init(k, (shape[0], shape[1] // count), dtype)
             for k in jax.random.split(key, count)]
    return jnp.concatenate(parts, axis=1)
  return stacked_init



def _shared_by_groups(x: Array, num_heads: int) -> Array:
  """Keys or values of K heads (B, S, K, H) -> (B, S, N, H): grouped-query attention, each
  of the K heads serving N / K consecutive query heads (the identity when K == N), for the
  fused kernels, which take multi-head attention's shapes. The einsum and XLA paths read
  the K heads as they are (`_scores`, `jax.nn.dot_product_attention`): repeating them cost a
  decoding step a third of a layer's time (TinyLlama's 4 heads for 32, batch 16, CPU)."""
  groups = num_heads // x.shape[2]
  return x if groups == 1 else jnp.repeat(x, groups, axis=2)


class MultiHeadAttention(nn.Module):
  """Multi-head attention with Q/K/V/output projections (paper §3.2.2); with
  `config.fused_qkv`, self-attention computes Q, K and V with one matmul.

  `role` is "self" or "cross"; `sliding`: self-attention sees only config.sliding_window
  keys back (a sliding layer), its rotary positions by the sliding layers' base
  (`rotary_frequencies`). With `qk_norm`, each head's query and key are normalised (the
  config's norm over H) before their rotation. With `decode=True` the module keeps a 'cache' collection:
  self-attention writes each call's keys/values at their positions; cross-attention projects the
  encoder output once, on the call that creates the cache, and reuses it afterwards.
  With the einsum path, attention weights are sown into 'intermediates' (pass
  `mutable=['intermediates']` to `apply` to read them).
  """

  config: TransformerConfig
  role: str = "self"
  sliding: bool = False

  def _projection(self, name: str, heads: int | None = None) -> nn.DenseGeneral:
    """(B, T, D) -> (B, T, heads, H): `heads` query heads by default; keys and values have
    config.kv_heads. Biases with use_bias, or qkv_bias (Qwen2's)."""
    cfg = self.config
    return nn.DenseGeneral(
        features=(heads or cfg.num_heads, cfg.head_dim), dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype, name=name, use_bias=cfg.use_bias or cfg.qkv_bias,
        kernel_init=partitioned(kernel_init(cfg), ("embed", "heads", "kv")),
        bias_init=partitioned(nn.initializers.zeros_init(), ("heads", "kv")))

  def _fused_projection(self, inputs: Array) -> tuple[Array, Array, Array]:
    """Query, key and value from one matmul with a (D, 3, N, H) kernel. Each slice is
    initialised like a separate projection, so both layouts define the same model
    (`params.fuse_qkv` maps one onto the other)."""
    cfg = self.config
    qkv = nn.DenseGeneral(
        features=(3, cfg.num_heads, cfg.head_dim), dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype, name="qkv", use_bias=cfg.use_bias or cfg.qkv_bias,
        kernel_init=partitioned(_stacked(kernel_init(cfg), 3),
                                ("embed", "qkv", "heads", "kv")),
        bias_init=partitioned(nn.initializers.zeros_init(), ("qkv", "heads", "kv")))(inputs)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                  # (B, T, N, H) each

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | None,
               mask: AttentionMask | Array | None = None, *, positions: Array | None = None,
               train: bool = False, decode: bool = False) -> Array:
    """`positions` (B, T): where the queries (and in self-attention the keys) are, which
    rotary positions (config.positional="rotary") rotate them by."""
    cfg = self.config
    window = cfg.sliding_window if self.sliding else 0
    if self.role == "cross":
      query = self._normed("query", self._projection("query")(inputs_q))   # (B, T, N, H)
      key, value = self._cross_keys_values(inputs_kv, decode)        # (B, S, K, H)
    else:
      if cfg.fused_qkv:
        query, key, value = self._fused_projection(inputs_q)
      else:
        query = self._projection("query")(inputs_q)
        key = self._projection("key", cfg.kv_heads)(inputs_q)
        value = self._projection("value", cfg.kv_heads)(inputs_q)
      query, key = self._normed("query", query), self._normed("key", key)
      if cfg.positional == "rotary":
        if positions is None:
          raise ValueError("rotary positions need the tokens' `positions` (B, T)")
        frequencies = rotary_frequencies(cfg, self.sliding)
        query = rotary(query, positions, frequencies)
        key = rotary(key, positions, frequencies)
      if decode:   # the cache keeps K heads, not N: the memory grouped queries save
        key, value, mask = self._append_to_cache(key, value, mask, positions, window)
      elif window and isinstance(mask, AttentionMask):
        mask = mask.with_window(window)
    implementation = kernels.resolve(cfg.attention_impl)
    if decode and implementation in kernels.KERNELS:
      implementation = "xla"   # one query a step against the cache: nothing to fuse
    if self.role == "cross" and implementation == "pallas":
      implementation = "einsum"   # its one row of segment ids serves self-attention only
    if train:
      kernels.check_dropout(implementation, cfg.attention_dropout_rate)
    explicit = implementation == "einsum" or (train and cfg.attention_dropout_rate > 0)
    dropout = nn.Dropout(cfg.attention_dropout_rate, deterministic=not train)
    dense = mask.dense() if isinstance(mask, AttentionMask) else mask   # explicit paths only
    scale = cfg.attention_scale or None
    if explicit and self.is_mutable_collection("intermediates"):   # attention maps
      weights = attention_weights(query, key, dense, scale)
      self.sow("intermediates", "attention_weights", weights)
      out = _weighted_sum(dropout(weights), value)
    elif explicit:
      out = attend(query, key, value, dense, dropout, scale)
    else:
      out = dot_product_attention(query, key, value, mask, implementation, scale)

    return nn.DenseGeneral(
        features=cfg.d_model, axis=(-2, -1), dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype, name="out", use_bias=cfg.use_bias,
        kernel_init=partitioned(kernel_init(cfg, into_residual=True), ("heads", "kv", "embed")),
        bias_init=partitioned(nn.initializers.zeros_init(), ("embed",)))(out)

  def _normed(self, name: str, x: Array) -> Array:
    """With config.qk_norm, each head of x (B, T, heads, H) normalised over H by the
    config's norm ("query_norm", "key_norm"); else x."""
    if not self.config.qk_norm:
      return x
    return norm(self.config, f"{name}_norm", axis_name="kv")(x)

  def _cross_keys_values(self, inputs_kv: Array | None, decode: bool) -> tuple[Array, Array]:
    if decode and self.has_variable("cache", "cross_key"):
      return self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value")
    if inputs_kv is None:
      raise ValueError("cross-attention needs the encoder output on its first decode call "
                       "(the call that initializes the cache)")
    key = self._normed("key", self._projection("key", self.config.kv_heads)(inputs_kv))
    value = self._projection("value", self.config.kv_heads)(inputs_kv)
    if decode:  # First call: cache the projected source once for all decoding steps.
      self.put_variable("cache", "cross_key", key)
      self.put_variable("cache", "cross_value", value)
    return key, value

  def _append_to_cache(self, key: Array, value: Array, mask: AttentionMask | Array | None,
                       positions: Array | None, window: int = 0
                       ) -> tuple[Array, Array, AttentionMask | Array | None]:
    """Self-attention decoding: the initializing call (a dummy input of the cache's length)
    creates the cache; each later call writes its T tokens' keys and values at their own
    `positions` (B, T), and each query sees the cache up to its position. Rows may thus
    stand at different positions: a served model's rows join and leave the batch at any
    step (serving/streaming.py). Slots past a row's position are never read, so a row
    needs no clearing before it is reused."""
    initialized = self.has_variable("cache", "cached_key")
    # (B, K, L, H): each head's keys side by side, as the attention's products read them
    # (stored (B, L, K, H), every step copied them to that layout first).
    shape = (key.shape[0], key.shape[2], key.shape[1], key.shape[3])
    cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, value.dtype)
    if not initialized:
      return key, value, mask
    if positions is None:
      raise ValueError("cached decoding needs the tokens' `positions` (B, T)")
    rows = jnp.arange(key.shape[0])[:, None]                               # (B, 1)
    cached_key.value = cached_key.value.at[rows, :, positions].set(key, mode="drop")
    cached_value.value = cached_value.value.at[rows, :, positions].set(value, mode="drop")
    slots = jnp.arange(cached_key.value.shape[2])
    step_mask = slots[None, None, None, :] <= positions[:, None, :, None]   # (B, 1, T, L)
    if window:   # a sliding layer: the cache keeps every position, the mask reads the window
      step_mask &= window_mask(positions, slots[None], window, causal=True)[:, None]
    return (jnp.swapaxes(cached_key.value, 1, 2), jnp.swapaxes(cached_value.value, 1, 2),
            step_mask)

