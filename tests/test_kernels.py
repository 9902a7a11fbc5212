"""The fused attention kernels (modules/kernels.py) against the einsum path, on this CPU:
splash attention in Pallas interpret mode, and cuDNN's calls through the library's own
reference (unpacked) or through the mask its packed layout describes. Values and gradients
with respect to Q, K and V, over padding, packing with several segments per row,
causality and T != S. Outputs at padding queries are never read, so only real queries
are compared (each path is free to put anything finite there)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, tiny_config, transformer_variables

from transformer_jax import Transformer, TransformerConfig
from transformer_jax.errors import UserError
from transformer_jax.modules import kernels
from transformer_jax.modules.attention import AttentionMask, attend, dot_product_attention

N, H = 2, 64


def _row_segments(lengths: list[int], width: int) -> list[int]:
  """Segments 1, 2, ... of the given lengths, then padding (0) to `width`."""
  row = [i + 1 for i, n in enumerate(lengths) for _ in range(n)]
  return row + [0] * (width - len(row))


# Each case: query and key segment rows (B = 2), packed or not, causal or not.
CASES = {
    "padding": dict(q=[[40], [128]], k=[[100], [56]], t=128, s=128, packed=False,
                    causal=False),
    "causal": dict(q=[[128], [90]], k=[[128], [90]], t=128, s=128, packed=False, causal=True),
    "packed": dict(q=[[50, 30, 40], [20, 108]], k=[[50, 30, 40], [20, 108]], t=128, s=128,
                   packed=True, causal=True),
    "cross, T != S": dict(q=[[50, 30, 40], [20, 100]], k=[[120, 60, 70], [200, 40]], t=128,
                          s=256, packed=True, causal=False),
}


def _case(name: str, seed: int = 0):
  case = CASES[name]
  rng = np.random.default_rng(seed)
  q_seg = jnp.array([_row_segments(r, case["t"]) for r in case["q"]], jnp.int32)
  k_seg = jnp.array([_row_segments(r, case["s"]) for r in case["k"]], jnp.int32)
  mask = AttentionMask.build(q_seg != 0, k_seg != 0, q_seg if case["packed"] else None,
                             k_seg if case["packed"] else None, causal=case["causal"])
  q, k, v = (jnp.asarray(rng.normal(size=(2, n, N, H)), jnp.float32)
             for n in (case["t"], case["s"], case["s"]))
  cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  return q, k, v, mask, cotangent


def _value_and_grads(fn, q, k, v, mask, cotangent):
  """The output at real queries and the gradients of <output, cotangent> over them."""
  real = (mask.query_segments != 0)[:, :, None, None]
  loss = lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v, mask), 0.0) * cotangent)
  out = jnp.where(real, fn(q, k, v, mask), 0.0)
  return out, jax.grad(loss, (0, 1, 2))(q, k, v)


def _einsum(q, k, v, mask):
  return attend(q, k, v, mask.dense())


def _assert_paths_agree(fn, name: str) -> None:
  q, k, v, mask, cotangent = _case(name)
  got, got_grads = _value_and_grads(fn, q, k, v, mask, cotangent)
  want, want_grads = _value_and_grads(_einsum, q, k, v, mask, cotangent)
  assert_close(got, want, atol=2e-5, rtol=2e-5)
  for g, w in zip(got_grads, want_grads):
    assert np.all(np.isfinite(np.asarray(g)))
    assert_close(g, w, atol=2e-5, rtol=2e-5)
  # The mask must matter, or agreement would prove nothing.
  unmasked = attend(q, k, v, None)
  assert not np.allclose(np.asarray(jnp.where((mask.query_segments != 0)[..., None, None],
                                               unmasked, 0.0)), np.asarray(want), atol=1e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_splash_attention_in_interpret_mode_matches_einsum(name):
  def splash(q, k, v, mask):
    return kernels.splash_attention(q, k, v, mask.query_segments, mask.key_segments,
                                    causal=mask.causal, interpret=True)
  _assert_paths_agree(splash, name)


@pytest.mark.parametrize("name", ["padding", "causal"])
def test_cudnn_call_for_unpacked_rows_matches_einsum(name):
  """The lengths and causal flag handed to cuDNN, run by JAX's XLA reference of the same
  call (jax.nn.dot_product_attention with implementation='xla')."""
  def cudnn_reference(q, k, v, mask):
    return kernels.cudnn_attention(q, k, v, mask.query_segments, mask.key_segments,
                                   causal=mask.causal, packed=False, implementation="xla")
  _assert_paths_agree(cudnn_reference, name)


def _packed_layout_mask(q_offsets, q_lengths, kv_offsets, kv_lengths, t, s, causal):
  """The mask cuDNN's packed layout describes: query i of segment m sees key j of segment
  m (of the key row), and with causality no key later in its segment than i is in its own."""
  q_offsets, q_lengths, kv_offsets, kv_lengths = map(np.asarray, (q_offsets, q_lengths,
                                                                  kv_offsets, kv_lengths))
  mask = np.zeros((q_offsets.shape[0], 1, t, s), bool)
  for b in range(mask.shape[0]):
    for m in range(q_lengths.shape[1]):
      if q_lengths[b, m] < 0:
        assert kv_lengths[b, m] < 0 and q_offsets[b, m] < 0 and kv_offsets[b, m] < 0
        continue
      for i in range(q_lengths[b, m]):
        for j in range(kv_lengths[b, m]):
          if not causal or j <= i:
            mask[b, 0, q_offsets[b, m] + i, kv_offsets[b, m] + j] = True
  return mask


@pytest.mark.parametrize("name", ["packed", "cross, T != S"])
def test_cudnn_packed_layout_describes_the_segment_mask(name):
  """cuDNN's packed rows need a GPU; what can be checked here is that the offsets and
  lengths handed to it describe exactly the einsum path's mask at every real query, and
  that rows end in -1 past their last segment."""
  _, _, _, mask, _ = _case(name)
  t, s = mask.query_segments.shape[1], mask.key_segments.shape[1]
  q_off, q_len = kernels.segment_offsets(mask.query_segments, min(t, s))
  kv_off, kv_len = kernels.segment_offsets(mask.key_segments, min(t, s))
  assert q_off.shape == (2, min(t, s) + 1) and q_len.shape == (2, min(t, s))
  described = _packed_layout_mask(q_off, q_len, kv_off, kv_len, t, s, mask.causal)
  real = np.asarray(mask.query_segments != 0)
  np.testing.assert_array_equal(described[:, 0][real], np.asarray(
      jnp.broadcast_to(mask.dense(), described.shape))[:, 0][real])
  assert np.asarray(q_len)[0, 3:].tolist() == [-1] * (min(t, s) - 3)


def test_auto_is_the_fastest_exact_path_of_the_platform_compiled_for():
  assert kernels.resolve("auto") == "einsum"          # this CPU
  for platform, implementation in (("tpu", "splash"), ("cuda", "cudnn"), ("gpu", "cudnn"),
                                   ("cpu", "einsum")):
    with kernels.target_platform(platform):
      assert kernels.resolve("auto") == implementation
  assert kernels.resolve("xla") == "xla"


def test_a_kernel_on_the_wrong_backend_falls_back_with_a_warning():
  q, k, v, mask, _ = _case("padding")
  with pytest.warns(UserWarning, match="'splash' falls back to 'xla': the backend is 'cpu'"):
    out = dot_product_attention(q, k, v, mask, "splash")
  real = (mask.query_segments != 0)[..., None, None]
  assert_close(jnp.where(real, out, 0), jnp.where(real, _einsum(q, k, v, mask), 0),
               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["cudnn", "splash"])
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
  src_seg = jnp.array([_row_segments([60, 40], 128), _row_segments([128], 128)], jnp.int32)
  tgt_seg = jnp.array([_row_segments([30, 50], 128), _row_segments([100], 128)], jnp.int32)
  rng = np.random.default_rng(3)
  src = jnp.where(src_seg != 0, jnp.asarray(rng.integers(4, 40, src_seg.shape)), 0)
  tgt = jnp.where(tgt_seg != 0, jnp.asarray(rng.integers(4, 40, tgt_seg.shape)), 0)
  positions = lambda seg: jnp.cumsum(jnp.ones_like(seg), 1) - 1 - jnp.maximum.accumulate(
      jnp.where(jnp.diff(seg, prepend=0) != 0, jnp.arange(seg.shape[1]), 0), axis=1)
  packed = dict(src_positions=positions(src_seg), tgt_positions=positions(tgt_seg),
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
