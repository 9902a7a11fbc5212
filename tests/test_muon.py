"""Muon (optimizer.name="muon": optax.contrib.muon for the layers' hidden matrices, AdamW for
the rest; training/optimizers.py): which parameters it orthogonalises, that their updates
are orthogonalised (equal singular values, as Adam's are not), that it shards over a mesh
as Adam does (the same steps as one device) and that a checkpointed run resumes exactly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from test_sharding import TASK, _batch, needs_8_devices

from transformer_jax import sharding
from transformer_jax.checkpoint import TrainCheckpoints
from transformer_jax.options import OptimizerOptions
from transformer_jax.training.optimizers import make_optimizer, make_schedule, muon_dimensions
from transformer_jax.training.state import (
  checkpoint_arrays,
  create_train_state,
  new_train_state,
  state_from_checkpoint,
)
from transformer_jax.training.steps import make_train_step

DIMENSIONS = optax.contrib.MuonDimensionNumbers
OPTIONS = OptimizerOptions(name="muon", schedule="constant", learning_rate=3e-3,
                           warmup_steps=0, muon_learning_rate=0.02, weight_decay=0.01)
SCHEDULE = make_schedule(OPTIONS, 32, 10)
MUON = make_optimizer(OPTIONS, SCHEDULE)


def _params():
  return jax.device_get(create_train_state(TASK.init_params(jax.random.PRNGKey(0)), MUON,
                                           0).params)


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
  labelled = {jax.tree_util.keystr(path): dims for path, dims in
              jax.tree_util.tree_flatten_with_path(
                  muon_dimensions(_params()),
                  is_leaf=lambda x: x is None or isinstance(x, DIMENSIONS))[0]}
  muon = {path for path, dims in labelled.items() if dims is not None}
  assert muon and all(path.endswith("['kernel']") and any(
      f"['{name}']" in path for name in ("query", "key", "value", "out", "wi", "wo"))
                      for path in muon)
  rest = set(labelled) - muon
  assert any("embed" in path for path in rest) and any("scale" in path for path in rest)
  assert not any("['kernel']" in path and "feed_forward" in path for path in rest)


def _kernel_spread(tx: optax.GradientTransformation) -> float:
  """The largest over the smallest singular value of tx's first update of a feed-forward
  kernel (D x F), from a random gradient."""
  params = _params()
  grads = jax.tree_util.tree_map(
      lambda p: jax.random.normal(jax.random.PRNGKey(p.size), p.shape, p.dtype), params)
  updates, _ = tx.update(grads, tx.init(params), params)
  kernel = updates["encoder"]["layer_0"]["feed_forward"]["wi"]["kernel"]
  values = np.linalg.svd(np.asarray(kernel, np.float64), compute_uv=False)
  return float(values.max() / values.min())


def test_a_hidden_matrix_update_is_orthogonalised():
  """Muon's singular values all near one value (Newton-Schulz's), where Adam's spread."""
  assert _kernel_spread(MUON) < 1.8 < _kernel_spread(optax.adam(3e-3))


def test_fewer_newton_schulz_steps_orthogonalise_less():
  """muon_ns_steps reaches optax: one iteration leaves the singular values further apart
  than the default's five."""
  one = make_optimizer(dataclasses.replace(OPTIONS, muon_ns_steps=1), SCHEDULE)
  assert _kernel_spread(MUON) < 1.8 < _kernel_spread(one)


def _fresh(mesh):
  init = lambda: new_train_state(TASK.init_params(jax.random.PRNGKey(0)), MUON, 0)  # noqa: E731
  return sharding.create_sharded(init, mesh)


@needs_8_devices
def test_muon_shards_as_adam_does_and_resumes_exactly(tmp_path):
  """data2_fsdp2_tensor2 against one device: the same losses and parameters; and 2 steps,
  a checkpoint, a restore onto a fresh sharded state and 2 more: bit for bit the 4 steps."""
  state = create_train_state(TASK.init_params(jax.random.PRNGKey(0)), MUON, 0)
  step = make_train_step(TASK, MUON, SCHEDULE)
  losses = []
  for _ in range(4):
    state, metrics = step(state, _batch())
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  sharded, state_sharding = _fresh(mesh)
  sharded_step = make_train_step(TASK, MUON, SCHEDULE, 1, state_sharding,
                                 sharding.batch_sharding(mesh))     # compiled once
  checkpoints = TrainCheckpoints(str(tmp_path / "ckpt"), {"run": 1}, {"kind": "test"})
  sharded_losses = []
  for at in range(4):
    if at == 2:
      checkpoints.save(2, checkpoint_arrays(sharded), {"position": 2})
      checkpoints.wait()
    sharded, metrics = sharded_step(sharded, sharding.to_global(_batch(), mesh))
    sharded_losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(sharded_losses, losses, rtol=1e-4)
  straight = jax.device_get(sharded)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(straight.params)[0],
                          jax.tree_util.tree_leaves(jax.device_get(state.params))):
    if "['key']['bias']" not in jax.tree_util.keystr(path):   # rounding noise (test_sharding)
      assert_close(a, b, atol=2e-5, rtol=1e-4)
  resumed = state_from_checkpoint(checkpoints.restore(checkpoint_arrays(_fresh(mesh)[0])).arrays)
  checkpoints.close()
  for _ in range(2):
    resumed, _ = sharded_step(resumed, sharding.to_global(_batch(), mesh))
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(resumed), straight)


def test_muon_fields_are_checked():
  from transformer_jax.errors import UserError
  for field, value in (("muon_learning_rate", 0.0), ("muon_momentum", 1.0),
                       ("muon_ns_steps", 0)):
    with pytest.raises(UserError, match=f"optimizer.{field}"):
      OptimizerOptions(name="muon", **{field: value})
  assert jnp.isfinite(SCHEDULE(0))
