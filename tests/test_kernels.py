"""The fused attention kernels (modules/kernels.py) against the einsum path, on this CPU:
splash attention (TPU) in Pallas interpret mode, values and gradients with respect to Q, K
and V, over padding, packing with several segments per row, causality and T != S; what
`auto` picks; the fallbacks. Outputs at padding queries are never read, so only real
queries are compared (each path is free to put anything finite there). The GPU kernels'
own tests: tests/test_kernels_pallas.py and tests/test_kernels_cudnn.py (on the CPU),
tests/test_kernels_gpu.py (on a GPU)."""

from __future__ import annotations

import functools

import attention_cases as cases
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, tiny_config, transformer_variables

from transformer_jax import Transformer, TransformerConfig, config
from transformer_jax.errors import UserError
from transformer_jax.modules import kernels
from transformer_jax.modules.attention import attend, dot_product_attention

# Each case: query and key segment rows (B = 2), packed or not, causal or not.
CASES = {
    "padding": dict(q_rows=[[40], [128]], k_rows=[[100], [56]], t=128, packed=False,
                    causal=False),
    "causal": dict(q_rows=[[128], [90]], k_rows=None, t=128, packed=False, causal=True),
    "packed": dict(q_rows=[[50, 30, 40], [20, 108]], k_rows=None, t=128, packed=True,
                   causal=True),
    "cross, T != S": dict(q_rows=[[50, 30, 40], [20, 100]], k_rows=[[120, 60, 70], [200, 40]],
                          t=128, s=256, packed=True, causal=False),
}


def _case(name: str) -> cases.Case:
  return cases.make_case(**CASES[name])


def assert_paths_agree(path: cases.Path, case: cases.Case, tolerance: float = 2e-5) -> None:
  """`path` gives the einsum path's output and gradients on `case`, finite, and the mask
  matters (or agreement would prove nothing)."""
  got, got_grads = cases.value_and_grads(path, case)
  want, want_grads = cases.value_and_grads(cases.einsum, case)
  assert_close(got, want, atol=tolerance, rtol=tolerance)
  for g, w in zip(got_grads, want_grads):
    assert np.all(np.isfinite(np.asarray(g)))
    assert_close(g, w, atol=tolerance, rtol=tolerance)
  unmasked = attend(case.q, case.k, case.v, None)
  real = cases.real_queries(case.mask)
  assert not np.allclose(np.asarray(jnp.where(real, unmasked, 0.0)), np.asarray(want),
                         atol=1e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_splash_attention_in_interpret_mode_matches_einsum(name):
  def splash(q, k, v, mask):
    return kernels.splash_attention(q, k, v, mask.query_segments, mask.key_segments,
                                    causal=mask.causal, interpret=True)
  assert_paths_agree(splash, _case(name))


def test_a_kernel_on_the_wrong_backend_falls_back_with_a_warning():
  q, k, v, mask, _ = _case("padding")
  with pytest.warns(UserWarning, match="'splash' falls back to 'xla': the backend is 'cpu'"):
    out = dot_product_attention(q, k, v, mask, "splash")
  real = cases.real_queries(mask)
  assert_close(jnp.where(real, out, 0), jnp.where(real, cases.einsum(q, k, v, mask), 0),
               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", config.KERNELS)
def test_attention_dropout_is_refused_by_the_kernels(implementation):
  with pytest.raises(UserError, match=r"attention_dropout_rate=0\.1: the .* kernel has no "
                                      "attention dropout"):
    TransformerConfig.small(vocab_size=40, attention_impl=implementation,
                            attention_dropout_rate=0.1)


def test_a_packed_transformer_with_the_tpu_kernel_matches_einsum(monkeypatch):
  """The whole model, packed rows, with "auto" compiled for a TPU: splash attention (in
  interpret mode) in encoder self-, decoder causal self- and cross-attention gives the
  einsum model's logits at every real target position."""
  monkeypatch.setattr(kernels, "splash_attention",
                      functools.partial(kernels.splash_attention, interpret=True))
  cfg = tiny_config(d_model=128, num_heads=2, d_ff=64, max_len=128)
  variables = transformer_variables(cfg)
  src_seg = cases.segment_rows([[60, 40], [128]], 128)
  tgt_seg = cases.segment_rows([[30, 50], [100]], 128)
  src, tgt = cases.tokens(src_seg, 40, seed=3), cases.tokens(tgt_seg, 40, seed=4)
  packed = dict(src_positions=cases.positions(src_seg), tgt_positions=cases.positions(tgt_seg),
                src_segment_ids=src_seg, tgt_segment_ids=tgt_seg)
  einsum = Transformer(cfg.replace(attention_impl="einsum")).apply(variables, src, tgt, **packed)
  with kernels.target_platform("tpu"):
    fused = Transformer(cfg.replace(attention_impl="auto")).apply(variables, src, tgt, **packed)
  real = np.asarray(tgt_seg != 0)
  assert_close(np.asarray(fused)[real], np.asarray(einsum)[real], atol=2e-4, rtol=2e-4)


def test_a_served_artifact_is_exported_through_xlas_attention():
  """export builds its Predictor with portable=True: a model trained with a kernel is served
  through XLA's attention (an artifact has symbolic lengths and may run on any platform),
  while predict keeps the saved choice."""
  from types import SimpleNamespace

  from configs import default
  from transformer_jax.checkpoint.snapshots import ModelRecord
  from transformer_jax.predict import Predictor
  config = default.get_config().to_dict()
  config["model"].update(attention_impl="auto", vocab_size=40)
  assets = SimpleNamespace(tokenizer=None, target_tokenizer=None, labels=None)
  record = ModelRecord(path="w", step=1, config=config, assets=assets, averaged_steps=[],
                       modules=[])
  assert Predictor._task(record).model_config.attention_impl == "auto"
  assert Predictor._task(record, portable=True).model_config.attention_impl == "xla"
