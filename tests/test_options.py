"""Every config option compiles under jax.jit and trains: finite, nonzero gradients; dropout
options are random under train=True and deterministic under train=False."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (VOCAB, assert_close, random_tokens, tiny_config, transformer_apply,
                      transformer_variables)
from transformer_jax import Transformer

# (id, config overrides, train). Every non-default value of every choice field appears.
OPTIONS = [
    ("paper-defaults", dict(), False),
    ("norm=pre", dict(norm_position="pre"), False),
    ("positional=learned", dict(positional="learned"), False),
    ("activation=gelu", dict(activation="gelu"), False),
    ("attention=einsum", dict(attention_impl="einsum"), False),
    ("untied-unshared", dict(share_embeddings=False, tie_output=False,
                             target_vocab_size=VOCAB + 7), False),
    ("unshared-tied", dict(share_embeddings=False, target_vocab_size=VOCAB + 7), False),
    ("dtype=bfloat16", dict(dtype="bfloat16"), False),
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
