"""attention_impl="cudnn" on this CPU: the unpacked call run by JAX's own XLA reference of it,
and the packed layout checked through what it describes (the call itself needs a GPU:
tests/test_kernels_gpu.py). The layout covers every query, never lets a real query see a
padding key, and is sized by the packer's bound, which the packer enforces."""

from __future__ import annotations

import attention_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import featurizing_task
from test_kernels import assert_paths_agree

from configs import default
from transformer_jax import Transformer, TransformerConfig
from transformer_jax.data import pipeline
from transformer_jax.errors import UserError
from transformer_jax.modules import cudnn, kernels
from transformer_jax.training.experiment import Experiment

# Query and key segment rows (B = 3) of packed rows, M = 4 segments at most.
LAYOUT_CASES = {
    "self-attention with pad tails": dict(q_rows=[[50, 30, 40], [20, 108], [7, 9, 11, 13]],
                                          k_rows=None, t=128, causal=True),
    "cross, T != S, pad tails on both sides": dict(
        q_rows=[[50, 30, 40], [20, 100], [10, 10]], k_rows=[[120, 60, 70], [200, 40], [5, 6]],
        t=128, s=256, causal=False),
    "cross, full key rows facing padded queries": dict(
        q_rows=[[50, 30], [20, 60], [60, 40]], k_rows=[[100, 28], [64, 64], [30, 98]],
        t=128, causal=False),
    "cross, padded keys facing full query rows, and an empty row": dict(
        q_rows=[[64, 64], [128], []], k_rows=[[30, 40], [90], []], t=128, causal=False),
}
BOUND = 4


def _slots(offsets, lengths) -> dict[tuple[int, int], range]:
  """(row, slot) -> the positions the slot covers, for the slots present (length > 0)."""
  offsets, lengths = np.asarray(offsets), np.asarray(lengths)
  return {(b, m): range(offsets[b, m], offsets[b, m] + lengths[b, m])
          for b in range(lengths.shape[0]) for m in range(lengths.shape[1]) if lengths[b, m] > 0}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_the_packed_layout_covers_every_query_and_hides_padding_keys(name):
  case = cases.make_case(packed=True, max_segments=BOUND, heads=1, depth=8,
                         **LAYOUT_CASES[name])
  mask = case.mask
  (q_off, q_len), (kv_off, kv_len) = cudnn.packed_layout(mask.query_segments,
                                                         mask.key_segments, BOUND)
  rows, t, s = mask.query_segments.shape[0], mask.query_segments.shape[1], case.k.shape[1]
  assert q_off.shape == kv_off.shape == (rows, BOUND + 2)      # M + 1 slots, and the end
  assert q_len.shape == kv_len.shape == (rows, BOUND + 1)
  queries, keys = _slots(q_off, q_len), _slots(kv_off, kv_len)
  assert queries.keys() == keys.keys()    # each slot has queries and keys (at least one)
  for b in range(rows):                   # every query in exactly one slot; keys in at most one
    assert sorted(i for (r, _), span in queries.items() if r == b for i in span) == list(range(t))
    covered = [j for (r, _), span in keys.items() if r == b for j in span]
    assert len(covered) == len(set(covered)) and set(covered) <= set(range(s))
  described = np.zeros((rows, t, s), bool)
  for slot, span in queries.items():
    for n, i in enumerate(span):
      for m, j in enumerate(keys[slot]):
        described[slot[0], i, j] = not mask.causal or m <= n
  real = np.asarray(mask.query_segments != 0)
  dense = np.asarray(jnp.broadcast_to(mask.dense(), (rows, 1, t, s)))[:, 0]
  np.testing.assert_array_equal(described[real], dense[real])   # real queries: the mask
  padding_keys = np.asarray(mask.key_segments == 0)
  assert not (described[real] & padding_keys[np.nonzero(real)[0]]).any()


def test_the_traced_call_gets_the_packers_bound(monkeypatch):
  """The whole Transformer, traced for a GPU with attention_impl="cudnn": every call gets
  the layout of max_segments + 1 slots, not one slot per token, and warns once that the
  packed layout is unproven."""
  from jax._src.cudnn import fused_attention_stablehlo as binding
  slots = []

  def recorder(query, key, value, *, q_offsets, kv_offsets, **kwargs):
    slots.append((q_offsets.shape, kv_offsets.shape))
    return jnp.zeros_like(query)
  monkeypatch.setattr(binding, "dot_product_attention", recorder)
  cfg = TransformerConfig.small(vocab_size=40, d_model=32, num_heads=2, max_len=64,
                                attention_impl="cudnn", max_segments=3)
  seg = cases.segment_rows([[20, 30, 10], [64]], 64)
  tokens = cases.tokens(seg, 40)
  packed = dict(src_positions=cases.positions(seg), tgt_positions=cases.positions(seg),
                src_segment_ids=seg, tgt_segment_ids=seg)
  model = Transformer(cfg)
  with kernels.target_platform("gpu"), pytest.warns(UserWarning, match="packed layout has not"):
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, tokens, **packed)
    jax.eval_shape(model.apply, variables, tokens, tokens, **packed)
  assert len(slots) == 2 * (2 + 2 * 2)     # init and apply: 2 encoder, 2 x 2 decoder layers
  assert set(slots) == {((2, 5), (2, 5))}


def test_gradients_at_positions_no_segment_covers_are_zero():
  """Whatever a kernel leaves at padding (here NaN), nothing of it reaches the weights."""
  valid = jnp.array([[True, True, False]])
  x = jnp.ones((1, 3, 2, 4))
  poisoned = jnp.where(valid, 1.0, jnp.nan)[:, :, None, None]
  grad = jax.grad(lambda x: jnp.sum(cudnn._zero_gradient_outside(x, valid) * poisoned))(x)
  assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[:, 2].any()


@pytest.mark.parametrize("name", ["padding", "causal"])
def test_the_unpacked_call_matches_einsum_through_jaxs_reference(name):
  """The lengths and causal flag handed to cuDNN, run by JAX's XLA reference of the same
  call (jax.nn.dot_product_attention with implementation='xla')."""
  from test_kernels import CASES

  def reference(q, k, v, mask):
    return cudnn.attention(q, k, v, mask.query_segments, mask.key_segments,
                           causal=mask.causal, packed=False, implementation="xla")
  assert_paths_agree(reference, cases.make_case(**CASES[name]))


def test_a_device_batch_beyond_cudnns_32_bit_indexing_is_refused():
  big = jax.ShapeDtypeStruct((2048, 1024, 16, 64), jnp.bfloat16)     # 2^31 elements
  rows = jax.ShapeDtypeStruct((2048, 1024), jnp.int32)
  with pytest.raises(UserError, match=r"2048 x 1024 x 16 x 64 = 2,147,483,648 elements"):
    jax.eval_shape(lambda q, s: cudnn.attention(q, q, q, s, s, causal=True, packed=False),
                   big, rows)


def test_packed_rows_with_cudnn_need_the_packers_bound_before_any_data_is_read():
  config = default.get_config()
  config.model.attention_impl = "cudnn"
  config.data.source = "local"
  config.data.dir = "/nonexistent"     # never read: the refusal comes first
  with pytest.raises(UserError, match=r"needs data.max_segments > 0"):
    Experiment.create(config, data=False, vocab_sizes=(40, None))
  config.data.max_segments = 16
  experiment = Experiment.create(config, data=False, vocab_sizes=(40, None))
  assert experiment.model_config.max_segments == 16
  config.model.max_segments = 3       # a saved config's copy: the data's bound wins
  assert Experiment.create(config, data=False,
                           vocab_sizes=(40, None)).model_config.max_segments == 16


def test_no_packed_batch_exceeds_the_bound():
  records = [{"source": "1 2", "target": "3"}] * 40         # short: many would fit a row
  task = featurizing_task("seq2seq", _Digits())
  for batch in pipeline.train_iterator(records, task, batch_size=2, max_length=32, seed=0,
                                       max_segments=BOUND, prefetch=0, num_epochs=1):
    assert batch["src_segment_ids"].max() <= BOUND
    assert (batch["src_segment_ids"].max(1) == BOUND).any()   # the bound, not the row, binds


class _Digits:
  vocab_size = 16
  encode = staticmethod(lambda text: [4 + int(c) for c in text.split()])
