"""Decoding a model sharded over a device mesh (8 CPU devices, see conftest): beam search on
a mesh returns one device's tokens, splits its rows over the batch axes, and under fsdp
gathers weights rather than activations."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_sharding import CFG, _batch, _init_fn, _train_single_device, needs_8_devices

from transformer_jax import sharding


@pytest.fixture(scope="module")
def reference():
  """The unsharded model after a few training steps: the parameters decoded here."""
  return _train_single_device()


@needs_8_devices
@pytest.mark.parametrize("beam_size", [1, 3])
def test_decoding_a_sharded_model_matches_one_device(reference, beam_size):
  from transformer_jax import decoding
  ref_state, _ = reference
  cfg = CFG.replace(dropout_rate=0.0)
  src = _batch(8)["src"]
  want = decoding.generate(cfg, ref_state.params, src, max_length=8, beam_size=beam_size)
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  _, state_sharding = sharding.create_sharded(_init_fn(_batch()), mesh)
  params = jax.device_put(ref_state.params, state_sharding.params)
  got = decoding.generate(cfg, params, src, max_length=8, beam_size=beam_size)
  np.testing.assert_array_equal(got, want)


def _decode_on(mesh, params, rows: int):
  """Beam search (3 beams) on `mesh` as evaluation compiles it; `rows` source rows."""
  from transformer_jax import decoding
  search = decoding.compiled_search(CFG.replace(dropout_rate=0.0), 3, 0.6, 8,
                                    rows=sharding.batch_sharding(mesh))
  return search.lower(params, _batch(rows)["src"]).compile()


@needs_8_devices
def test_decoding_splits_the_rows_over_the_batch_axes(reference):
  """Each device decodes its share of the rows: a host batch arrives replicated, and without
  the split every device of a data=8 mesh searched all 64 rows."""
  mesh = sharding.make_mesh(dict(data=8))
  params = jax.device_put(reference[0].params, sharding.replicated(mesh))
  one_device = jax.device_put(reference[0].params, jax.devices()[0])
  flops = [_decode_on(m, p, 64).cost_analysis()["flops"]
           for m, p in ((mesh, params), (sharding.make_mesh({}, jax.devices()[:1]), one_device))]
  assert flops[0] < flops[1] / 4


@needs_8_devices
def test_under_fsdp_decoding_gathers_weights_not_activations(reference):
  """Under fsdp, beam search keeps each layer's output and its own state split over the
  batch, so it gathers the weights once instead of all-reducing activations. Left to the
  partitioner it split the matmuls along the fsdp-split d_model: 4x the traffic at 4x the
  rows. (What still grows here is the CPU top_k gathering its candidates' scores; the
  TPU compile splits it over the rows.)"""
  from transformer_jax import decoding
  from transformer_jax.aot.hlo_cost import collective_bytes
  mesh = sharding.make_mesh(dict(fsdp=8))
  _, state_sharding = sharding.create_sharded(_init_fn(None), mesh)
  params = jax.device_put(reference[0].params, state_sharding.params)
  moved = [sum(collective_bytes(_decode_on(mesh, params, rows).as_text()).values())
           for rows in (16, 64)]
  assert moved[1] < 2 * moved[0]
  cfg, src = CFG.replace(dropout_rate=0.0), _batch(16)["src"]
  np.testing.assert_array_equal(
      decoding.generate(cfg, params, src, max_length=8, beam_size=3),
      decoding.generate(cfg, reference[0].params, src, max_length=8, beam_size=3))
