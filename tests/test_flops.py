"""The model-FLOPs formula behind the benchmarks' MFU equals the dot products the model
actually traces to (counted from its jaxpr), for training and inference, across options."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_config

from transformer_jax import TransformerConfig
from transformer_jax.flops import (
  lm_flops,
  lm_weights_per_token,
  matmul_flops,
  model_flops,
  weights_per_token,
)
from transformer_jax.tasks import LanguageModelTask, Seq2SeqTask


def _batch(batch: int, src_length: int, tgt_length: int) -> dict:
  return {"src": jnp.ones((batch, src_length), jnp.int32),
          "tgt_in": jnp.ones((batch, tgt_length), jnp.int32),
          "tgt_out": jnp.ones((batch, tgt_length), jnp.int32)}


@pytest.mark.parametrize("overrides, shape", [
    (dict(), (3, 7, 5)),
    (dict(num_encoder_layers=2, num_decoder_layers=3, norm_position="pre"), (2, 4, 9)),
    (dict(share_embeddings=False, tie_output=False, target_vocab_size=57), (2, 6, 6)),
    (dict(scan_layers=True, fused_qkv=True, num_encoder_layers=3), (2, 5, 3)),
], ids=["tiny", "deeper-pre-ln", "untied", "scan-fused"])
def test_formula_counts_every_matmul_of_training_and_inference(overrides, shape):
  cfg = tiny_config(**overrides)
  batch = _batch(*shape)
  task = Seq2SeqTask(cfg, label_smoothing=0.1)
  params = jax.eval_shape(lambda: nn.meta.unbox(task.init_params(jax.random.PRNGKey(0))))
  train = lambda p: jax.grad(lambda p: task.loss_sums(p, batch, jax.random.PRNGKey(0),
                                                      True)["loss"])(p)
  forward = lambda p: task.loss_sums(p, batch, None, False)["loss"]
  assert matmul_flops(train, params) == model_flops(cfg, *shape)["total"]
  assert matmul_flops(forward, params) == model_flops(cfg, *shape, training=False)["total"]


def test_formula_by_hand_for_the_base_model():
  cfg = TransformerConfig.base(37000)
  d, f = 512, 2048
  source = 6 * (4 * d * d + 2 * d * f) + 6 * 2 * d * d
  target = 6 * (4 * d * d + 2 * d * d + 2 * d * f) + d * 37000
  assert weights_per_token(cfg) == (source, target) == (22_020_096, 40_964_096)
  flops = model_flops(cfg, batch_size=2, src_length=10, tgt_length=8)
  assert flops["weights"] == 6 * 2 * (10 * source + 8 * target)
  assert flops["attention"] == 2 * 12 * d * 6 * (10 * 10 + 8 * 8 + 8 * 10)   # no halving
  assert flops["total"] == flops["weights"] + flops["attention"]
  assert model_flops(cfg, 2, 10, 8, training=False)["total"] * 3 == flops["total"]


def _lm_batch(batch: int, length: int) -> dict:
  tokens = jnp.ones((batch, length), jnp.int32)
  return {"inputs": tokens, "targets": tokens, "segment_ids": tokens,
          "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))}


@pytest.mark.parametrize("overrides, shape", [
    (dict(norm_position="pre", positional="learned", activation="gelu"), (3, 7)),
    (dict(num_decoder_layers=3, positional="rotary", norm_type="rms", gated_ffn=True,
          num_heads=4, num_kv_heads=2, use_bias=False, activation="silu"), (2, 9)),
    (dict(tie_output=False, scan_layers=True, fused_qkv=True, num_decoder_layers=2), (2, 5)),
], ids=["gpt", "llama-gqa", "untied-scan-fused"])
def test_lm_formula_counts_every_matmul_of_the_language_model(overrides, shape):
  cfg = tiny_config(num_encoder_layers=0, **overrides)
  batch = _lm_batch(*shape)
  task = LanguageModelTask(cfg)
  params = jax.eval_shape(lambda: nn.meta.unbox(task.init_params(jax.random.PRNGKey(0))))
  train = lambda p: jax.grad(lambda p: task.loss_sums(p, batch, jax.random.PRNGKey(0),
                                                      True)["loss"])(p)
  forward = lambda p: task.loss_sums(p, batch, None, False)["loss"]
  assert matmul_flops(train, params) == lm_flops(cfg, *shape)["total"]
  assert matmul_flops(forward, params) == lm_flops(cfg, *shape, training=False)["total"]


def test_lm_formula_is_the_encoder_decoder_one_without_source_or_cross_attention():
  """GPT-2 small by hand, and as `model_flops` of a model with no encoder layers and an
  empty source, less the decoder's cross-attention Q and O (its K and V see no source)."""
  d, f, layers, vocab, length = 768, 3072, 12, 50257, 1024
  cfg = TransformerConfig(vocab, d_model=d, num_heads=12, d_ff=f, num_encoder_layers=0,
                          num_decoder_layers=layers, max_len=length)
  assert lm_weights_per_token(cfg) == layers * (4 * d * d + 2 * d * f) + d * vocab
  assert lm_weights_per_token(cfg) == 123_532_032   # of 124M: no positions, biases, norms
  flops = lm_flops(cfg, batch_size=2, length=length)
  assert flops["weights"] == 6 * 2 * length * lm_weights_per_token(cfg)
  assert flops["attention"] == 2 * 12 * d * layers * length * length   # no causal halving
  seq2seq = model_flops(cfg, batch_size=2, src_length=0, tgt_length=length)
  cross_query_output = 6 * 2 * length * layers * 2 * d * d
  assert flops["weights"] == seq2seq["weights"] - cross_query_output
  assert flops["attention"] == seq2seq["attention"]
  assert lm_flops(cfg, 2, length, training=False)["total"] * 3 == flops["total"]


def test_matmul_flops_counts_scan_iterations_and_refuses_while_loops():
  w = jnp.ones((4, 4))
  one = 2 * 3 * 4 * 4
  assert matmul_flops(lambda x: x @ w, jnp.ones((3, 4))) == one
  scanned = lambda x: jax.lax.scan(lambda c, _: (c @ w, None), x, length=5)[0]
  assert matmul_flops(scanned, jnp.ones((3, 4))) == 5 * one
  looped = lambda x: jax.lax.while_loop(lambda c: c.sum() < 1e3, lambda c: c @ w, x)
  with pytest.raises(ValueError, match="while loop"):
    matmul_flops(looped, jnp.ones((3, 4)))
