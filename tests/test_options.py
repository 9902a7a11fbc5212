"""Every config option compiles under jax.jit and trains: finite, nonzero gradients; dropout
options are random under train=True and deterministic under train=False."""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  VOCAB,
  assert_close,
  random_tokens,
  tiny_config,
  transformer_apply,
  transformer_variables,
)

from transformer_jax import Transformer

# (id, config overrides, train). Every non-default value of every choice field appears.
OPTIONS = [
    ("paper-defaults", dict(), False),
    ("norm=pre", dict(norm_position="pre"), False),
    ("positional=learned", dict(positional="learned"), False),
    ("activation=gelu", dict(activation="gelu"), False),
    ("activation=swish", dict(activation="swish"), False),
    ("activation=silu", dict(activation="silu"), False),
    ("marian: halves+final_logits_bias", dict(sinusoidal_layout="halves",
                                               final_logits_bias=True), False),
    ("attention=einsum", dict(attention_impl="einsum"), False),
    ("zero_decoder_start", dict(zero_decoder_start=True), False),
    ("untied-unshared", dict(share_embeddings=False, tie_output=False,
                             target_vocab_size=VOCAB + 7), False),
    ("unshared-tied", dict(share_embeddings=False, target_vocab_size=VOCAB + 7), False),
    ("dtype=bfloat16", dict(dtype="bfloat16"), False),
    ("weight_init=gpt2", dict(weight_init="gpt2", scale_embeddings=False), False),
    ("dropout", dict(dropout_rate=0.2), True),
    ("attention-dropout", dict(attention_dropout_rate=0.2), True),
    ("activation-dropout", dict(activation_dropout_rate=0.2), True),
    # On a GPU this runs cuDNN; elsewhere it checks the fallback to XLA.
    ("attention=cudnn", dict(attention_impl="cudnn", dtype="bfloat16"), False),
    # Speed features (each remat policy is checked in test_speed_features.py).
    ("scan+remat+fused_qkv", dict(scan_layers=True, remat_policy="full", fused_qkv=True,
                                  dropout_rate=0.2), True),
]
DROPOUT_OPTIONS = [o for o in OPTIONS if "dropout" in o[0]]


def _params(options):
  return [pytest.param(*o, id=o[0]) for o in options]


def _data(cfg):
  src = random_tokens(40, 2, 8)
  tgt = random_tokens(41, 2, 8, vocab=cfg.tgt_vocab_size)
  src[1, 6:] = 0
  tgt[1, 5:] = 0
  tgt_in, labels = tgt[:, :-1], tgt[:, 1:]            # teacher forcing
  return src, tgt_in, labels


def _loss_fn(cfg, train):
  model = Transformer(cfg)

  def loss(params, src, tgt_in, labels, dropout_key):
    logits = model.apply({"params": params}, src, tgt_in, train=train,
                         rngs={"dropout": dropout_key})
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    weights = (labels != 0).astype(jnp.float32)
    return (nll * weights).sum() / weights.sum(), logits

  return loss


def _named_leaves(tree):
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree), sep="/")


@pytest.mark.parametrize("name, overrides, train", _params(OPTIONS))
def test_option_compiles_and_has_finite_nonzero_gradients(name, overrides, train):
  cfg = tiny_config(**overrides)
  params = transformer_variables(cfg)["params"]
  src, tgt_in, labels = _data(cfg)
  step = jax.jit(jax.value_and_grad(_loss_fn(cfg, train), has_aux=True))
  (loss, logits), grads = step(params, src, tgt_in, labels, jax.random.PRNGKey(1))

  assert np.isfinite(float(loss)) and float(loss) > 0
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
  if train:  # Dropout draws from the 'dropout' rng: same key, same output; new key, new one.
    (_, again), _ = step(params, src, tgt_in, labels, jax.random.PRNGKey(1))
    (_, other), _ = step(params, src, tgt_in, labels, jax.random.PRNGKey(2))
    assert_close(again, logits)
    assert np.abs(np.asarray(other) - np.asarray(logits)).max() > 1e-3
  flat_params, flat_grads = _named_leaves(params), _named_leaves(grads)
  assert flat_params.keys() == flat_grads.keys()
  for path, p in flat_params.items():
    assert p.dtype == jnp.float32, f"{path}: parameters must stay float32, got {p.dtype}"
    g = np.asarray(flat_grads[path])
    assert g.dtype == np.float32 and g.shape == p.shape, path
    assert np.all(np.isfinite(g)), f"{path}: non-finite gradient"
  # Every weight matrix, embedding table and norm scale learns. (Biases are not checked: the
  # key-projection bias has an exactly zero gradient, since softmax ignores a constant shift.)
  for path, g in flat_grads.items():
    if path.rsplit("/", 1)[-1] in ("kernel", "embedding", "position_embedding", "scale"):
      assert np.any(np.asarray(g) != 0), f"{path}: gradient is all zero"
  assert float(_global_norm(grads)) > 0


def _global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree_util.tree_leaves(tree)))


def test_bfloat16_compute_tracks_float32():
  cfg32 = tiny_config()
  cfg16 = tiny_config(dtype="bfloat16")
  variables = transformer_variables(cfg32)
  src, tgt_in, _ = _data(cfg32)
  logits32 = np.asarray(transformer_apply(cfg32)(variables, src, tgt_in))
  logits16 = transformer_apply(cfg16)(variables, src, tgt_in)
  assert logits16.dtype == jnp.float32          # logits are returned in float32
  logits16 = np.asarray(logits16)
  assert np.all(np.isfinite(logits16))
  # bf16 has an 8-bit mantissa: close to float32 at the scale of the logits, but not equal.
  scale = np.abs(logits32).max()
  assert np.abs(logits16 - logits32).max() < 0.1 * scale
  assert not np.array_equal(logits16, logits32)


@pytest.mark.parametrize("name, overrides, train", _params(DROPOUT_OPTIONS))
def test_dropout_is_off_at_inference(name, overrides, train):
  """(Randomness under train=True is checked with the gradients above.)"""
  cfg = tiny_config(**overrides)
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt_in, _ = _data(cfg)
  inference = np.asarray(apply(variables, src, tgt_in, rngs={"dropout": jax.random.PRNGKey(1)}))
  assert_close(apply(variables, src, tgt_in, rngs={"dropout": jax.random.PRNGKey(2)}),
               inference)                                     # train=False: no randomness
  assert_close(apply(variables, src, tgt_in), inference)      # and needs no rng
  # The rates are irrelevant at inference: same logits as the model without dropout.
  assert_close(transformer_apply(tiny_config())(variables, src, tgt_in), inference)


def test_zero_rates_make_training_deterministic():
  """With every rate at 0 (tiny_config's default), train=True equals train=False."""
  cfg = tiny_config()
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt_in, _ = _data(cfg)
  trained = apply(variables, src, tgt_in, train=True, rngs={"dropout": jax.random.PRNGKey(3)})
  assert_close(trained, apply(variables, src, tgt_in))


# ------------------------------------------------------------------- MarianMT's options
def test_swish_and_silu_are_x_sigmoid_x_in_the_feed_forward():
  from transformer_jax.modules.layers import FeedForward
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 32))
  cfg = tiny_config(activation="swish")
  variables = FeedForward(cfg).init(jax.random.PRNGKey(1), x)
  p = nn.meta.unbox(variables["params"])
  h = x @ p["wi"]["kernel"] + p["wi"]["bias"]
  expected = (h * jax.nn.sigmoid(h)) @ p["wo"]["kernel"] + p["wo"]["bias"]
  assert_close(FeedForward(cfg).apply(variables, x), expected)
  assert_close(FeedForward(cfg.replace(activation="silu")).apply(variables, x), expected)
  relu = FeedForward(cfg.replace(activation="relu")).apply(variables, x)
  assert np.abs(np.asarray(relu) - np.asarray(expected)).max() > 1e-3


@pytest.mark.parametrize("d_model", [8, 9])
def test_halves_layout_puts_the_sines_first(d_model):
  from transformer_jax.modules.embedding import interleaved_to_halves, sinusoidal_table
  interleaved = sinusoidal_table(10, d_model)
  halves = sinusoidal_table(10, d_model, "halves")
  sines = (d_model + 1) // 2
  angles = np.arange(10)[:, None] / np.power(10000.0, np.arange(0, d_model, 2) / d_model)
  np.testing.assert_allclose(halves[:, :sines], np.sin(angles), atol=1e-6)
  np.testing.assert_allclose(halves[:, sines:], np.cos(angles[:, :d_model // 2]), atol=1e-6)
  np.testing.assert_array_equal(halves, interleaved[:, interleaved_to_halves(d_model)])


def test_permuting_model_dimensions_turns_interleaved_into_halves():
  """Re-laying every "embed" axis is the same function with the other sinusoid layout:
  what lets a model trained here export to MarianMT exactly (transformer_jax.convert)."""
  from transformer_jax import convert
  from transformer_jax.modules.embedding import interleaved_to_halves
  cfg = tiny_config(num_decoder_layers=2)
  params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(transformer_variables(cfg)["params"]))
  permuted = convert.permute_embed_axes(params, cfg, interleaved_to_halves(cfg.d_model))
  src, tgt_in, _ = _data(cfg)
  expected = transformer_apply(cfg)({"params": params}, src, tgt_in)
  halves = cfg.replace(sinusoidal_layout="halves")
  assert_close(transformer_apply(halves)({"params": permuted}, src, tgt_in), expected,
               atol=1e-5)
  assert np.abs(np.asarray(transformer_apply(halves)({"params": params}, src, tgt_in))
                - np.asarray(expected)).max() > 1e-3


def test_final_logits_bias_is_added_to_every_position():
  cfg = tiny_config(final_logits_bias=True)
  params = flax.core.unfreeze(transformer_variables(cfg)["params"])
  assert "final_logits_bias" not in transformer_variables(tiny_config())["params"]["decoder"]
  src, tgt_in, _ = _data(cfg)
  zero = np.asarray(transformer_apply(cfg)({"params": params}, src, tgt_in))
  bias = np.linspace(-2, 2, cfg.vocab_size).astype(np.float32)
  params["decoder"]["final_logits_bias"] = bias
  shifted = np.asarray(transformer_apply(cfg)({"params": params}, src, tgt_in))
  np.testing.assert_allclose(shifted - zero, np.broadcast_to(bias, zero.shape), atol=1e-5)


def test_gpt2_init_draws_at_0_02_and_scales_the_residual_projections_by_depth():
  """GPT-2's scheme: N(0, 0.02) for matrices and the embedding, N(0, 0.02 / sqrt(2 * layers))
  for attention's output and the feed-forward's second projection (here 4 layers)."""
  cfg = tiny_config(weight_init="gpt2", d_model=128, d_ff=256, vocab_size=400,
                    num_encoder_layers=2,
                    num_decoder_layers=2)
  params = flax.core.unfreeze(nn.meta.unbox(transformer_variables(cfg)["params"]))
  layer = params["encoder"]["layer_0"]
  drawn = {"embedding": params["shared_embedding"]["embedding"],
           "query": layer["self_attention"]["query"]["kernel"],
           "wi": layer["feed_forward"]["wi"]["kernel"],
           "out": layer["self_attention"]["out"]["kernel"],
           "wo": layer["feed_forward"]["wo"]["kernel"]}
  residual = 0.02 / np.sqrt(2 * 4)
  expected = {"embedding": 0.02, "query": 0.02, "wi": 0.02, "out": residual, "wo": residual}
  for name, weights in drawn.items():
    assert abs(float(np.std(weights)) / expected[name] - 1) < 0.05, name
    assert abs(float(np.mean(weights))) < 0.1 * expected[name], name
  # The default, the paper's model as Flax's WMT example starts it: Xavier-uniform.
  xavier = nn.meta.unbox(transformer_variables(cfg.replace(weight_init="xavier"))["params"])
  query = xavier["encoder"]["layer_0"]["self_attention"]["query"]["kernel"]   # (D, N, H)
  bound = np.sqrt(6 / (2 * cfg.d_model))
  assert np.abs(query).max() <= bound and np.std(query) > 0.9 * bound / np.sqrt(3)
