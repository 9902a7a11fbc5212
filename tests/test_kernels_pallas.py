"""attention_impl="pallas": JAX's Pallas flash attention for GPUs (Triton on a GPU), run
here as it is, in Pallas interpret mode, with the tiles the GPU runs (kernels.pallas_blocks)
on rows of the lengths the GPU sees, scaled down in rows and heads. Values and gradients
against the einsum path over padding, packing with many segments, pad tails, causality and
bf16 inputs; everything finite, padding included; the whole Transformer and LanguageModel
on packed rows."""

from __future__ import annotations

import functools

import attention_cases as cases
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, tiny_config, transformer_variables
from test_kernels import assert_paths_agree

from transformer_jax import Transformer
from transformer_jax.errors import UserError
from transformer_jax.modules import kernels
from transformer_jax.modules.attention import dot_product_attention
from transformer_jax.modules.models import LanguageModel

# Self-attention rows (B = 2): the encoder's (padding), the decoder's and the language
# model's (causal), packed with many segments and pad tails.
CASES = {
    "encoder, padded rows": dict(q_rows=[[100], [128]], t=128, packed=False, causal=False),
    "decoder, causal, a pad tail": dict(q_rows=[[128], [90]], t=128, packed=False, causal=True),
    "packed, 10 segments and pad tails": dict(
        q_rows=[[10] * 9 + [20], [5, 7, 3, 60, 11, 2, 30]], t=128, packed=True, causal=False),
    "language model, packed causal, 2 query tiles": dict(
        q_rows=[[30, 40, 50, 60, 20, 30], [256]], t=256, packed=True, causal=True),
}


def _interpreted(q, k, v, mask):
  return kernels.pallas_attention(q, k, v, mask.query_segments, mask.key_segments,
                                  causal=mask.causal, interpret=True)


@pytest.mark.parametrize("name", list(CASES))
def test_the_pallas_kernel_matches_einsum_and_is_finite_everywhere(name):
  case = cases.make_case(k_rows=None, **CASES[name])
  assert_paths_agree(_interpreted, case, tolerance=1e-4)
  assert cases.evaluate(_interpreted, case).finite    # padding queries included


def test_the_pallas_kernel_in_bf16_is_as_close_to_float32_as_einsum_in_bf16():
  case = cases.make_case(k_rows=None, dtype=jnp.bfloat16,
                         **CASES["language model, packed causal, 2 query tiles"])
  pallas, einsum = cases.evaluate(_interpreted, case), cases.evaluate(cases.einsum, case)
  assert pallas.finite
  for ours, theirs in zip(pallas.errors, einsum.errors):     # output, dQ, dK, dV
    assert ours <= 2 * theirs + 1e-3, (pallas, einsum)


def test_the_tiles_are_the_gpus_where_the_rows_allow_and_refused_otherwise():
  wmt = kernels.pallas_blocks(256)
  assert (wmt.block_q, wmt.block_k, wmt.block_kv_dkv, wmt.block_q_dkv) == (128, 64, 128, 32)
  assert kernels.pallas_blocks(48).block_q == 16
  with pytest.raises(ValueError, match="multiples of 16 tokens; these rows have 100"):
    kernels.pallas_blocks(100)


def test_a_kernel_that_cannot_run_says_why_in_one_line():
  case = cases.make_case([[50], [100]], None, 100, packed=False, causal=True)
  with kernels.target_platform("gpu"), pytest.raises(UserError) as refused:
    dot_product_attention(case.q, case.k, case.v, case.mask, "pallas")
  assert "'pallas' cannot be traced for 'gpu'" in str(refused.value)
  assert "multiples of 16" in str(refused.value) and "\n" not in str(refused.value)


@pytest.fixture
def interpreted_pallas(monkeypatch):
  """The models' "pallas" attention in interpret mode, traced as for a GPU."""
  monkeypatch.setattr(kernels, "pallas_attention",
                      functools.partial(kernels.pallas_attention, interpret=True))
  with kernels.target_platform("gpu"):
    yield


def _loss_and_grads(apply, params, targets, real):
  def loss(params):
    logits = apply(params).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(real, nll, 0.0))
  return jax.value_and_grad(loss)(params)


def _assert_same_loss_and_grads(got, want):
  (got_loss, got_grads), (want_loss, want_grads) = got, want
  assert_close(got_loss, want_loss, atol=1e-4, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert np.isfinite(np.asarray(g)).all()
    assert_close(g, w, atol=1e-4, rtol=1e-3)


def test_a_packed_transformer_with_pallas_self_attention_matches_einsum(interpreted_pallas):
  """Encoder self- and decoder causal self-attention through the kernel, cross-attention
  through einsum: the loss over real targets and every parameter's gradient agree."""
  cfg = tiny_config(d_model=128, num_heads=2, d_ff=64, max_len=128)
  params = transformer_variables(cfg)["params"]
  src_seg = cases.segment_rows([[60, 40, 20], [128]], 128)   # target segment m reads source m
  tgt_seg = cases.segment_rows([[30, 50, 16], [100]], 128)
  src, tgt = cases.tokens(src_seg, 40, seed=3), cases.tokens(tgt_seg, 40, seed=4)
  packed = dict(src_positions=cases.positions(src_seg), tgt_positions=cases.positions(tgt_seg),
                src_segment_ids=src_seg, tgt_segment_ids=tgt_seg)

  def run(implementation):
    model = Transformer(cfg.replace(attention_impl=implementation))
    return _loss_and_grads(lambda p: model.apply({"params": p}, src, tgt, **packed), params,
                           tgt, tgt_seg != 0)
  _assert_same_loss_and_grads(run("pallas"), run("einsum"))


def test_a_packed_language_model_with_pallas_matches_einsum(interpreted_pallas):
  cfg = tiny_config(d_model=128, num_heads=2, d_ff=64, max_len=128, num_decoder_layers=2,
                    positional="rotary", norm_position="pre")
  segments = cases.segment_rows([[20, 33, 41, 9], [128]], 128)
  tokens = cases.tokens(segments, 40, seed=5)
  model = LanguageModel(cfg.replace(attention_impl="einsum"))
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :8]))["params"]

  def run(implementation):
    model = LanguageModel(cfg.replace(attention_impl=implementation))
    return _loss_and_grads(
        lambda p: model.apply({"params": p}, tokens, positions=cases.positions(segments),
                              segment_ids=segments), params, tokens, segments != 0)
  _assert_same_loss_and_grads(run("pallas"), run("einsum"))
