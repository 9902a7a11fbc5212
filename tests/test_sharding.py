"""Sharding over a device mesh (8 CPU devices, see conftest): layouts agree with one device,
parameters are split as the logical-axis rules say, and checkpoints move between meshes.
Sharded decoding: tests/test_sharding_decoding.py; two processes under jax.distributed:
tests/test_distributed.py."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import assert_close, random_tokens, tiny_config

from transformer_jax import BOS_ID, EOS_ID, sharding
from transformer_jax.checkpoint import TrainCheckpoints
from transformer_jax.tasks import Seq2SeqTask
from transformer_jax.training.state import (
  checkpoint_arrays,
  create_train_state,
  new_train_state,
  state_from_checkpoint,
)
from transformer_jax.training.steps import make_eval_step, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {                      # the layouts on 8 devices
    "data8": dict(data=8),
    "fsdp8": dict(data=1, fsdp=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
}
STEPS = 3
# 4 heads, vocab 40, d_model 32, d_ff 64: every sharded dimension divides its mesh axes.
CFG = tiny_config(num_heads=4, dropout_rate=0.1)
OPTIMIZER = optax.adam(3e-3, b2=0.98)

needs_8_devices = pytest.mark.skipif(jax.device_count() < 8,
                                     reason="needs 8 devices (conftest forces 8 CPU devices)")


def _batch(rows: int = 16) -> dict[str, np.ndarray]:
  src = random_tokens(0, rows, 9)
  tgt = random_tokens(1, rows, 6)
  src[::3, 6:] = 0                               # some padding
  bos = np.full((rows, 1), BOS_ID, np.int32)
  eos = np.full((rows, 1), EOS_ID, np.int32)
  return {"src": src, "tgt_in": np.concatenate([bos, tgt], 1),
          "tgt_out": np.concatenate([tgt, eos], 1)}


TASK = Seq2SeqTask(CFG, label_smoothing=0.1)


def _init_fn(batch):
  return lambda: new_train_state(TASK.init_params(jax.random.PRNGKey(0)), OPTIMIZER, 0)


def _train_single_device():
  """The plain, unsharded path: the reference."""
  batch = _batch()
  state = create_train_state(TASK.init_params(jax.random.PRNGKey(0)), OPTIMIZER, 0)
  step = make_train_step(TASK, OPTIMIZER, lambda s: 3e-3)
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return jax.device_get(state), losses


def _zero1_shardings(mesh):
  """The rules' state shardings with the optimizer state split over data (ZeRO-1)."""
  boxed = jax.eval_shape(_init_fn(None))
  shardings = sharding.shardings_for(boxed, mesh)
  return shardings.replace(opt_state=sharding.split_over_data(shardings.opt_state,
                                                              boxed.opt_state))


def _train_on(mesh, shardings=None):
  batch = _batch()
  state, state_sharding = sharding.create_sharded(_init_fn(batch), mesh, shardings=shardings)
  step = make_train_step(TASK, OPTIMIZER, lambda s: 3e-3, 1, state_sharding,
                         sharding.batch_sharding(mesh),
                         split_gradients_over_data=shardings is not None)
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, sharding.to_global(batch, mesh))
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.fixture(scope="module")
def reference():
  return _train_single_device()


# ------------------------------------------------------------------------- mesh shape
@pytest.mark.parametrize("sizes, devices, shape", [
    (dict(data=-1), 8, (8, 1, 1)),
    (dict(data=-1, tensor=4), 8, (2, 1, 4)),
    (dict(data=2, fsdp=-1, tensor=2), 8, (2, 2, 2)),
    (dict(data=1, fsdp=1, tensor=1), 1, (1, 1, 1)),
])
def test_mesh_shape_resolves_minus_one(sizes, devices, shape):
  assert sharding.resolve_mesh_shape(sizes, devices) == shape


@pytest.mark.parametrize("sizes, devices, message", [
    (dict(data=4), 8, "needs 4 devices but 8 are available"),
    (dict(data=3, tensor=-1), 8, "do not divide the 8 available devices"),
    (dict(data=-1, fsdp=-1), 8, "at most one axis may be -1"),
    (dict(data=0), 8, "mesh.data=0"),
    (dict(model=2), 8, "unknown mesh axes ['model']"),
])
def test_mesh_that_does_not_fit_is_refused(sizes, devices, message):
  with pytest.raises(sharding.MeshError) as e:
    sharding.resolve_mesh_shape(sizes, devices)
  assert message in str(e.value)


def test_batch_must_split_evenly_over_data_and_fsdp():
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2)) if jax.device_count() >= 8 else None
  if mesh is None:
    pytest.skip("needs 8 devices")
  sharding.check_batch_fits(16, mesh)
  with pytest.raises(sharding.MeshError, match="batch_size=6 is not divisible by mesh "
                     "data\\*fsdp=4"):
    sharding.check_batch_fits(6, mesh)


# ------------------------------------------------------------------ equal results
@needs_8_devices
@pytest.mark.parametrize("layout", [*LAYOUTS, "data8_zero1"])
def test_layouts_match_one_device(reference, layout):
  ref_state, ref_losses = reference
  mesh = sharding.make_mesh(LAYOUTS[layout.removesuffix("_zero1")])
  state, losses = _train_on(mesh, _zero1_shardings(mesh) if "zero1" in layout else None)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert losses[-1] < losses[0]                    # it trained
  got = jax.device_get(state)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got.params)[0],
                          jax.tree_util.tree_leaves(ref_state.params)):
    # A key bias shifts every score of a query equally, which softmax ignores: its gradient
    # is rounding noise, which Adam scales up to full-size steps, so it is not comparable.
    if "['key']['bias']" not in jax.tree_util.keystr(path):
      assert_close(a, b, atol=1e-6, rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: assert_close(a, b, atol=1e-7, rtol=1e-5),
                         got.opt_state, ref_state.opt_state)


@needs_8_devices
@pytest.mark.parametrize("zero1", [False, True])
def test_gradients_summed_explicitly_match_the_partitioner_s_and_bfloat16_stays_close(zero1):
  """mesh.reduce_gradients_in: "float32" sums the 8 replicas' gradients in a shard_map and
  gives the partitioner's step; "bfloat16" rounds them to bfloat16 for the sum: close to it,
  not equal. Under ZeRO-1 the sum is a reduce-scatter into the optimizer state's split.
  Adam's first moment after one step is 0.1 x the gradient: compared there."""
  from transformer_jax.options import MeshOptions, UserError
  task = Seq2SeqTask(tiny_config(num_heads=4, dropout_rate=0.0), label_smoothing=0.1)
  mesh = sharding.make_mesh(dict(data=8))
  init = lambda: new_train_state(task.init_params(jax.random.PRNGKey(0)), OPTIMIZER, 0)
  shardings = _zero1_shardings(mesh) if zero1 else None
  batch = sharding.to_global(_batch(), mesh)
  moments, losses = {}, {}
  for how in ("auto", "float32", "bfloat16"):
    state, state_sharding = sharding.create_sharded(init, mesh, shardings=shardings)
    step = make_train_step(task, OPTIMIZER, lambda s: 3e-3, 1, state_sharding,
                           sharding.batch_sharding(mesh), split_gradients_over_data=zero1,
                           reduce_gradients_in=how)
    if how == "float32":
      hlo = step.lower(state, batch).compile().as_text()
      assert (" reduce-scatter(" in hlo) == zero1
    state, metrics = step(state, batch)
    moments[how] = jax.tree_util.tree_leaves(jax.device_get(state.opt_state[0].mu))
    losses[how] = float(metrics["loss"])
  assert losses["float32"] == pytest.approx(losses["auto"], rel=1e-6)
  for a, b in zip(moments["float32"], moments["auto"]):
    assert_close(a, b, atol=1e-9, rtol=1e-5)
  flat = {how: np.concatenate([np.ravel(x) for x in m]) for how, m in moments.items()}
  error = np.linalg.norm(flat["bfloat16"] - flat["auto"]) / np.linalg.norm(flat["auto"])
  assert 0 < error < 1e-2, error           # bfloat16 keeps 8 bits of mantissa: ~0.4% a value
  with pytest.raises(UserError, match="mesh.fsdp=1 and mesh.tensor=1"):
    MeshOptions(data=4, fsdp=2, reduce_gradients_in="bfloat16")


# ------------------------------------------------------------- the layout itself
def _spec(state, path_fragment: str, tree: str = "params"):
  leaves = jax.tree_util.tree_flatten_with_path(getattr(state, tree))[0]
  matches = [(jax.tree_util.keystr(p), x) for p, x in leaves
             if path_fragment in jax.tree_util.keystr(p)]
  assert matches, path_fragment
  return matches[0][1].sharding.spec


def _param_bytes_per_device(params) -> int:
  """Bytes of parameters held by device 0."""
  return sum(shard.data.nbytes for x in jax.tree_util.tree_leaves(params)
             for shard in x.addressable_shards if shard.device == jax.devices()[0])


@needs_8_devices
def test_parameters_and_optimizer_state_are_sharded_as_the_rules_say():
  batch = _batch()
  total = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(jax.eval_shape(
      lambda: TASK.init_params(jax.random.PRNGKey(0)))))
  per_device = {}
  for name, sizes in [("data8", dict(data=8)), ("fsdp8", dict(fsdp=8)),
                      ("tensor4", dict(data=2, tensor=4))]:
    state, _ = sharding.create_sharded(_init_fn(batch), sharding.make_mesh(sizes))
    per_device[name] = _param_bytes_per_device(state.params)
    ffn_in = "['encoder']['layer_0']['feed_forward']['wi']['kernel']"
    if name == "fsdp8":
      assert _spec(state, ffn_in) == jax.sharding.PartitionSpec("fsdp", "tensor")
      assert _spec(state, "['embedding']") == jax.sharding.PartitionSpec("tensor", "fsdp")
      # Adam's moments live where their parameters live.
      assert _spec(state, ffn_in, "opt_state") == _spec(state, ffn_in)
    if name == "tensor4":
      assert _spec(state, "['query']['kernel']") == jax.sharding.PartitionSpec(
          "fsdp", "tensor", None)
      shard_shape = state.params["encoder"]["layer_0"]["feed_forward"]["wi"]["kernel"] \
          .addressable_shards[0].data.shape
      assert shard_shape == (CFG.d_model, CFG.d_ff // 4)
  assert per_device["data8"] == total                    # replicated
  assert per_device["fsdp8"] < total / 7                 # ~1/8 (biases over heads replicate)
  assert total / 4 <= per_device["tensor4"] < total / 3  # ~1/4 (norms replicate)


def _collective_bytes_of_train_step(mesh, rows: int) -> int:
  """Bytes that the compiled train step's collectives return per device and step."""
  from transformer_jax.aot.hlo_cost import collective_bytes
  abstract, state_sharding = sharding.abstract_sharded(_init_fn(None), mesh)
  rows_sharding = sharding.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows_sharding)
           for k, v in _batch(rows).items()}
  step = make_train_step(TASK, OPTIMIZER, lambda s: 3e-3, 1, state_sharding, rows_sharding)
  return sum(collective_bytes(step.lower(abstract, batch).compile().as_text()).values())


@needs_8_devices
def test_under_fsdp_the_step_gathers_weights_not_activations():
  """With the parameters split along d_model over fsdp, the model keeps its layers' outputs
  split over the batch (sharding.activations_split_over_batch), so the step moves
  parameter-sized data whatever the batch. Left to the partitioner, this step moved 4x as
  much at 4x the rows: it resharded the activations to match the weights."""
  mesh = sharding.make_mesh(dict(fsdp=8))
  small, large = (_collective_bytes_of_train_step(mesh, rows) for rows in (16, 64))
  assert large < 1.25 * small


@needs_8_devices
def test_zero1_splits_the_optimizer_state_over_data_and_leaves_the_parameters_replicated():
  from configs import default
  from transformer_jax.training.experiment import Experiment
  config = default.get_config()
  config.model.update(d_model=32, d_ff=64, num_encoder_layers=1, num_decoder_layers=1)
  config.mesh.update(data=8, shard_optimizer_state=True)
  state, shardings = Experiment.create(config, data=False, vocab_sizes=(40, None)) \
      .abstract_state()
  ffn_in = "['encoder']['layer_0']['feed_forward']['wi']['kernel']"
  assert "data" not in str(_spec(state, ffn_in))                  # parameters: replicated
  assert _spec(state, ffn_in, "opt_state") == jax.sharding.PartitionSpec(("data", "fsdp"),
                                                                         "tensor")
  assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(state.params))
  moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim]
  per_device = sum(np.prod(x.sharding.shard_shape(x.shape)) for x in moments)
  assert per_device < sum(x.size for x in moments) / 7     # ~1/8 (sizes 8 does not divide stay)


@needs_8_devices
def test_zero1_checkpoint_restores_onto_the_replicated_layout_and_back(tmp_path):
  mesh = sharding.make_mesh(dict(data=8))
  state, _ = _train_on(mesh, _zero1_shardings(mesh))
  expected = jax.device_get(state)
  checkpoints = TrainCheckpoints(str(tmp_path / "ckpt"), {"run": 1}, {"kind": "test"})
  checkpoints.save(3, checkpoint_arrays(state), {"position": 3})
  checkpoints.wait()
  replicated, _ = sharding.create_sharded(_init_fn(None), mesh)
  restored = state_from_checkpoint(checkpoints.restore(checkpoint_arrays(replicated)).arrays)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(restored), expected)
  checkpoints.save(4, checkpoint_arrays(restored), {"position": 4})
  checkpoints.wait()
  again = state_from_checkpoint(checkpoints.restore(
      checkpoint_arrays(sharding.create_sharded(_init_fn(None), mesh,
                                                shardings=_zero1_shardings(mesh))[0])).arrays)
  assert "data" in str(jax.tree_util.tree_leaves(again.opt_state)[1].sharding.spec)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(again), expected)
  checkpoints.close()


@needs_8_devices
def test_indivisible_dimensions_are_replicated_not_refused():
  cfg = tiny_config(num_heads=2)                        # 2 heads cannot split 4 ways
  task = Seq2SeqTask(cfg)
  init = lambda: new_train_state(task.init_params(jax.random.PRNGKey(0)), OPTIMIZER, 0)
  state, _ = sharding.create_sharded(init, sharding.make_mesh(dict(data=2, tensor=4)))
  assert _spec(state, "['query']['kernel']") == jax.sharding.PartitionSpec("fsdp", None, None)


# ------------------------------------------------------------------- checkpoints
@needs_8_devices
def test_checkpoint_restores_onto_another_mesh(tmp_path):
  state, _ = _train_on(sharding.make_mesh(dict(fsdp=8)))
  expected = jax.device_get(state)
  checkpoints = TrainCheckpoints(str(tmp_path / "ckpt"), {"run": 1}, {"kind": "test"})
  checkpoints.save(3, checkpoint_arrays(state), {"position": 3})
  checkpoints.wait()
  batch = _batch()
  for sizes in [dict(data=1), dict(data=2, fsdp=2, tensor=2)]:
    devices = jax.devices()[:1] if sizes == dict(data=1) else None
    target, target_sharding = sharding.create_sharded(_init_fn(batch),
                                                       sharding.make_mesh(sizes, devices))
    restored = checkpoints.restore(checkpoint_arrays(target))
    assert restored.step == 3 and restored.data_state == {"position": 3}
    restored_state = state_from_checkpoint(restored.arrays)
    for leaf, want in zip(jax.tree_util.tree_leaves(restored_state),
                          jax.tree_util.tree_leaves(target_sharding)):
      assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(restored_state.params),
                           expected.params)
  checkpoints.close()


# ---------------------------------------------------------------------- evaluation
@needs_8_devices
def test_sharded_eval_step_matches_single_device(reference):
  ref_state, _ = reference
  batch = _batch()
  want = make_eval_step(TASK)(ref_state.params, batch)
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  state, state_sharding = sharding.create_sharded(_init_fn(batch), mesh)
  params = jax.device_put(ref_state.params, state_sharding.params)
  got = make_eval_step(TASK, state_sharding.params, sharding.batch_sharding(mesh))(
      params, sharding.to_global(batch, mesh))
  jax.tree_util.tree_map(lambda a, b: assert_close(a, b, rtol=1e-5), got, want)


# ---------------------------------------------------------------- speed-option layouts
@needs_8_devices
def test_scanned_fused_model_shards_and_matches_one_device():
  """scan_layers adds a leading 'layers' axis and fused_qkv a 'qkv' axis: both stay whole
  (replicated), the other axes shard as the rules say, and the sharded model computes the
  one-device loss."""
  cfg = CFG.replace(scan_layers=True, fused_qkv=True, dropout_rate=0.0)
  task = Seq2SeqTask(cfg, label_smoothing=0.1)
  batch = _batch()
  params = task.init_params(jax.random.PRNGKey(0))
  want = make_eval_step(task)(nn.meta.unbox(params), batch)
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  state, state_sharding = sharding.create_sharded(
      lambda: new_train_state(task.init_params(jax.random.PRNGKey(0)), OPTIMIZER, 0),
      mesh)
  qkv = state_sharding.params["encoder"]["layers"]["self_attention"]["qkv"]["kernel"].spec
  assert tuple(qkv) == (None, "fsdp", None, "tensor", None)   # layers, embed, qkv, heads, kv
  got = make_eval_step(task, state_sharding.params, sharding.batch_sharding(mesh))(
      state.params, sharding.to_global(batch, mesh))
  jax.tree_util.tree_map(lambda a, b: assert_close(a, b, rtol=1e-5), got, want)
