"""Scaled dot-product attention against a NumPy reference, the einsum/xla paths, masks,
and the attention weights sown by the einsum path."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  VOCAB,
  assert_close,
  init,
  pad_to,
  random_tokens,
  tiny_config,
  transformer_apply,
  transformer_variables,
)

from transformer_jax import Transformer
from transformer_jax.modules.attention import (
  MultiHeadAttention,
  attend,
  attention_weights,
  dot_product_attention,
)
from transformer_jax.modules.masks import causal_mask, combine_masks, padding_mask, segment_mask

B, T, S, N, H = 2, 5, 7, 2, 4


def _qkv(seed: int = 0, t: int = T, s: int = S):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, t, N, H)).astype(np.float32)
  k = rng.normal(size=(B, s, N, H)).astype(np.float32)
  v = rng.normal(size=(B, s, N, H)).astype(np.float32)
  return q, k, v


def _random_mask(seed: int, t: int = T, s: int = S) -> np.ndarray:
  """(B, 1, T, S) boolean mask with at least one visible key in every row."""
  rng = np.random.default_rng(seed)
  mask = rng.random((B, 1, t, s)) < 0.5
  mask[..., rng.integers(0, s)] = True
  return mask


def reference_attention(q, k, v, mask):
  """softmax(Q K^T / sqrt(d_k)) V per head, in float64 NumPy, d_k = per-head dimension."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  d_k = q.shape[-1]
  weights = np.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      logits = q[b, :, n] @ k[b, :, n].T / np.sqrt(d_k)                  # (T, S)
      if mask is not None:
        logits = np.where(np.broadcast_to(mask, (q.shape[0], 1) + logits.shape)[b, 0],
                          logits, -np.inf)
      logits = logits - logits.max(-1, keepdims=True)
      e = np.exp(logits)
      weights[b, n] = e / e.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", weights, v)
  return weights, out


# --------------------------------------------------------------------- reference agreement
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_attention_weights_match_numpy_reference(with_mask):
  q, k, v = _qkv(1)
  mask = _random_mask(2) if with_mask else None
  ref_w, _ = reference_attention(q, k, v, mask)
  got = attention_weights(jnp.asarray(q), jnp.asarray(k), None if mask is None else mask)
  assert got.shape == (B, N, T, S)
  assert_close(got, ref_w)
  if with_mask:  # Masked keys get (numerically) zero weight.
    assert np.all(np.asarray(got)[np.broadcast_to(~mask, got.shape)] < 1e-12)


@pytest.mark.parametrize("impl", ["einsum", "xla"])
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_dot_product_attention_matches_numpy_reference(impl, with_mask):
  q, k, v = _qkv(3)
  mask = _random_mask(4) if with_mask else None
  _, ref_out = reference_attention(q, k, v, mask)
  got = dot_product_attention(q, k, v, None if mask is None else jnp.asarray(mask), impl)
  assert got.shape == (B, T, N, H)
  assert_close(got, ref_out)


def test_reference_scales_by_per_head_dim_not_model_dim():
  """Guards the scale: using sqrt(N * H) instead of sqrt(H) must be detectably different."""
  q, k, v = _qkv(5)
  wrong = reference_attention(q * np.sqrt(1.0 / N), k, v, None)[1]   # = scale sqrt(N*H)
  got = dot_product_attention(q, k, v, None, "einsum")
  assert not np.allclose(np.asarray(got), wrong, atol=1e-3)


# -------------------------------------------------------------------------------- masks
def test_mask_builders():
  causal = np.asarray(causal_mask(4))
  assert causal.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(causal[0, 0], np.tril(np.ones((4, 4), bool)))

  valid = jnp.array([[True, True, False], [True, False, False]])
  pad = np.asarray(padding_mask(valid, valid))
  assert pad.shape == (2, 1, 1, 3)
  np.testing.assert_array_equal(pad[:, 0, 0], np.asarray(valid))

  seg_q = jnp.array([[1, 1, 2, 0]])
  seg_k = jnp.array([[1, 2, 2]])
  seg = np.asarray(segment_mask(seg_q, seg_k))
  assert seg.shape == (1, 1, 4, 3)
  expected = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 0, 0]], bool)
  np.testing.assert_array_equal(seg[0, 0], expected)

  assert combine_masks(None, None) is None
  both = np.asarray(combine_masks(causal_mask(3), None, padding_mask(valid, valid)))
  np.testing.assert_array_equal(both, np.tril(np.ones((3, 3), bool))[None, None]
                                & np.asarray(valid)[:, None, None, :])


def _structured_masks():
  """Padding, causal, segment and all combined, for T == S == 6."""
  valid = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
  segments = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 0, 0]])
  pad = padding_mask(valid, valid)
  causal = causal_mask(6)
  seg = segment_mask(segments, segments)
  return {"padding": pad, "causal": causal, "segment": seg,
          "all": combine_masks(pad, causal, seg), "none": None}


@pytest.mark.parametrize("mask_name", ["padding", "causal", "segment", "all", "none"])
def test_einsum_and_xla_agree(mask_name):
  mask = _structured_masks()[mask_name]
  q, k, v = _qkv(6, t=6, s=6)
  einsum = dot_product_attention(q, k, v, mask, "einsum")
  xla = dot_product_attention(q, k, v, mask, "xla")
  # ("all" has fully masked rows: padding queries of segment 0 see no key. Both paths must
  # still give finite, equal outputs there.)
  assert np.all(np.isfinite(np.asarray(einsum)))
  assert_close(einsum, xla)
  # The mask must matter (otherwise agreement would be vacuous).
  if mask is not None:
    unmasked = dot_product_attention(q, k, v, None, "einsum")
    assert not np.allclose(np.asarray(einsum), np.asarray(unmasked), atol=1e-3)


def _normalized_first(q, k, v, mask):
  """The textbook order: normalised weights, then their product with the values."""
  return jnp.einsum("bnts,bsnh->btnh", attention_weights(q, k, mask), v)


@pytest.mark.parametrize("mask_name", ["all", "causal", "none"])
def test_normalizing_after_the_product_has_the_same_gradients(mask_name):
  """`attend` divides the output by the row sums instead of the weights; its gradients
  (autodiff through the other order) must be the textbook softmax's, fully masked rows
  ("all": padding queries of segment 0) included."""
  mask = _structured_masks()[mask_name]
  q, k, v = (jnp.asarray(a) for a in _qkv(12, t=6, s=6))
  cotangent = jnp.asarray(np.random.default_rng(13).normal(size=(B, 6, N, H)), jnp.float32)
  def grads(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask) * cotangent), (0, 1, 2))(q, k, v)
  for got, want in zip(grads(attend), grads(_normalized_first)):
    assert np.all(np.isfinite(np.asarray(got)))
    assert_close(got, want)


def test_normalizing_after_the_product_loses_no_precision_in_bfloat16():
  """In bf16 compute both orders round the weights to bf16 for the product; `attend`
  divides the float32 accumulation instead of rounding its output before, so it is at least
  as close to the float64 reference."""
  q, k, v = _qkv(14, t=64, s=64)
  mask = _random_mask(15, t=64, s=64)
  _, reference = reference_attention(q, k, v, mask)
  q16, k16, v16 = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
  def error(fn):
    out = np.asarray(fn(q16, k16, v16, jnp.asarray(mask)).astype(jnp.float32))
    return np.abs(out - reference).mean()
  assert error(attend) <= 1.01 * error(_normalized_first)


def test_attention_dropout_drops_the_same_weights_in_both_orders():
  """With attention dropout the module takes `attend` unless the weights are being sown; the
  same rng must drop the same weights in both (dropout acts on the normalised weights)."""
  cfg = tiny_config(attention_impl="einsum", attention_dropout_rate=0.5)
  x = jnp.asarray(np.random.default_rng(16).normal(size=(2, 5, 32)), jnp.float32)
  mask = jnp.asarray(_random_mask(17, t=5, s=5))
  module = MultiHeadAttention(cfg, "self")
  variables = init(module, x, None, mask)
  rngs = {"dropout": jax.random.PRNGKey(3)}
  fused = module.apply(variables, x, None, mask, train=True, rngs=rngs)
  explicit, _ = module.apply(variables, x, None, mask, train=True, rngs=rngs,
                             mutable=["intermediates"])
  assert_close(fused, explicit)
  assert not np.allclose(np.asarray(fused), np.asarray(module.apply(variables, x, None, mask)),
                         atol=1e-3)   # the dropout did drop something


# ------------------------------------------------------------------ multi-head attention
@pytest.mark.parametrize("kind", ["self", "cross"])
def test_multi_head_attention_einsum_equals_xla(kind):
  cfg_einsum = tiny_config(attention_impl="einsum")
  cfg_xla = tiny_config(attention_impl="xla")
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
  kv = jnp.asarray(rng.normal(size=(2, 7, 32)), jnp.float32) if kind == "cross" else None
  s = 7 if kind == "cross" else 5
  mask = jnp.asarray(_random_mask(9, t=5, s=s))
  variables = init(MultiHeadAttention(cfg_einsum, kind), x, kv, mask)
  out_einsum = MultiHeadAttention(cfg_einsum, kind).apply(variables, x, kv, mask)
  out_xla = MultiHeadAttention(cfg_xla, kind).apply(variables, x, kv, mask)
  assert out_einsum.shape == (2, 5, 32)
  assert_close(out_einsum, out_xla)


def _padded_batch():
  src = pad_to(random_tokens(10, 2, 6), 8)
  src[1, 4:] = 0                                    # second row: 4 real source tokens
  tgt = pad_to(random_tokens(11, 2, 5), 7)
  tgt[1, 3:] = 0                                    # second row: 3 real target tokens
  return src, tgt


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_transformer_einsum_equals_xla(norm_position):
  src, tgt = _padded_batch()
  cfg_einsum = tiny_config(attention_impl="einsum", norm_position=norm_position)
  cfg_xla = tiny_config(attention_impl="xla", norm_position=norm_position)
  variables = transformer_variables(cfg_xla)
  logits_einsum = transformer_apply(cfg_einsum)(variables, src, tgt)
  logits_xla = transformer_apply(cfg_xla)(variables, src, tgt)
  assert logits_einsum.shape == (2, 7, VOCAB)
  assert_close(logits_einsum, logits_xla)


# ------------------------------------------------------------------ sown attention weights
def _sown_weights(state) -> dict[str, np.ndarray]:
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(state["intermediates"]))
  out = {}
  for path, value in flat.items():
    assert path[-1] == "attention_weights"
    (weights,) = value                                # sow appends to a tuple
    out["/".join(path[:-1])] = np.asarray(weights)
  return out


def _apply_with_intermediates(cfg, variables, src, tgt):
  model = Transformer(cfg)
  return jax.jit(lambda v, s, t: model.apply(v, s, t, mutable=["intermediates"]))(
      variables, src, tgt)


def test_einsum_path_sows_normalized_masked_attention_weights():
  cfg = tiny_config(attention_impl="einsum", num_decoder_layers=2)
  src, tgt = _padded_batch()
  variables = transformer_variables(cfg)
  logits, state = _apply_with_intermediates(cfg, variables, src, tgt)
  assert_close(logits, transformer_apply(cfg)(variables, src, tgt))
  weights = _sown_weights(state)
  # One entry per attention module: 1 encoder self, 2 x (decoder self + cross).
  expected = {"encoder/layer_0/self_attention", "decoder/layer_0/self_attention",
              "decoder/layer_0/cross_attention", "decoder/layer_1/self_attention",
              "decoder/layer_1/cross_attention"}
  assert set(weights) == expected

  src_valid = src != 0
  tgt_valid = tgt != 0
  causal = np.tril(np.ones((tgt.shape[1], tgt.shape[1]), bool))
  for name, w in weights.items():
    if name.startswith("encoder") or name.endswith("cross_attention"):
      visible = np.broadcast_to(src_valid[:, None, None, :], w.shape)
    else:
      visible = np.broadcast_to(causal[None, None] & tgt_valid[:, None, None, :], w.shape)
    assert w.shape[:2] == (2, cfg.num_heads), name
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5, err_msg=name)
    assert np.all(w >= 0), name
    assert np.all(w[~visible] < 1e-12), f"{name}: masked keys received attention"
    assert np.any(w[visible] > 1e-3), name


def test_xla_path_sows_nothing_at_inference():
  cfg = tiny_config(attention_impl="xla")
  src, tgt = _padded_batch()
  _, state = _apply_with_intermediates(cfg, transformer_variables(cfg), src, tgt)
  assert not flax.traverse_util.flatten_dict(flax.core.unfreeze(state.get("intermediates",
                                                                             {})))
