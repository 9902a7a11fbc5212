"""Speed features compute the same model: scanned vs unrolled layers, fused vs separate
query/key/value, remat (every policy) vs none, cuDNN attention's fallback vs XLA; and the
train step donates its state, does no host transfer, and keeps float32 parameters and
optimizer state under bfloat16 compute.

Layout changes are checked by converting parameters (transformer_jax.params) and comparing
logits and gradients; remat is checked with dropout on, since it must replay the same masks.
"""

from __future__ import annotations

import functools
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, random_tokens, tiny_config, transformer_variables

from transformer_jax import Transformer
from transformer_jax.modules.models import REMAT_POLICIES
from transformer_jax.params import fuse_qkv, split_qkv, stack_layers, unstack_layers
from transformer_jax.tasks import Seq2SeqTask
from transformer_jax.training.state import create_train_state
from transformer_jax.training.steps import make_train_step

LAYERS = dict(num_encoder_layers=2, num_decoder_layers=3)   # unequal: stacks kept apart


def _config(**overrides):
  return tiny_config(**{**LAYERS, **overrides})


def _batch(vocab: int = 40) -> dict:
  src, tgt = random_tokens(50, 3, 7, vocab), random_tokens(51, 3, 6, vocab)
  src[1, 5:] = 0
  tgt[2, 4:] = 0
  return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def _leaves_equal(a, b) -> bool:
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                       jax.tree_util.tree_leaves(b))))


# ------------------------------------------------------------------ parameter layouts
def _layout(**flags):
  """(config, converter from the default layout's parameters) for a layout."""
  convert = lambda p: p
  if flags.get("scan_layers"):
    convert = stack_layers
  if flags.get("fused_qkv"):
    convert = (lambda c: lambda p: fuse_qkv(c(p)))(convert)
  return _config(**flags), convert


@pytest.mark.parametrize("flags", [dict(scan_layers=True), dict(fused_qkv=True),
                                   dict(scan_layers=True, fused_qkv=True)],
                         ids=["scan", "fused", "scan+fused"])
def test_layout_init_is_the_converted_default_layout(flags):
  cfg, convert = _layout(**flags)
  base = transformer_variables(_config())["params"]
  boxed = Transformer(cfg).init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                                jnp.ones((1, 4), jnp.int32))["params"]
  own = nn.meta.unbox(boxed)
  converted = convert(base)
  assert jax.tree_util.tree_structure(own) == jax.tree_util.tree_structure(converted)
  for x, y in zip(jax.tree_util.tree_leaves(own), jax.tree_util.tree_leaves(converted)):
    assert x.shape == y.shape and x.dtype == y.dtype
  # Logical axis names survive: a leading "layers" axis under scan, "qkv" when fused.
  names = {"/".join(k): v.names for k, v in flax.traverse_util.flatten_dict(
      boxed, is_leaf=lambda _, x: isinstance(x, nn.LogicallyPartitioned)).items()}
  for path, axes in names.items():
    if "/layers/" in path:
      assert axes[0] == "layers", path
  if flags.get("fused_qkv"):
    kernels = [axes for path, axes in names.items() if path.endswith("qkv/kernel")]
    lead = ("layers",) if flags.get("scan_layers") else ()
    assert kernels and all(a == lead + ("embed", "qkv", "heads", "kv") for a in kernels)
  # The fused kernel's slices are initialised like separate projections (xavier per slice).
  if flags == dict(fused_qkv=True):
    qkv = own["encoder"]["layer_0"]["self_attention"]["qkv"]["kernel"]
    separate = base["encoder"]["layer_0"]["self_attention"]["query"]["kernel"]
    limit = float(np.sqrt(6.0 / (separate.shape[0] + separate.shape[1] * separate.shape[2])))
    for i in range(3):
      assert float(np.abs(qkv[:, i]).max()) <= limit
      assert float(np.std(qkv[:, i])) == pytest.approx(float(np.std(separate)), rel=0.2)


def test_conversions_invert_each_other():
  base = transformer_variables(_config())["params"]
  stacked = stack_layers(base)
  assert "layers" in stacked["encoder"] and "layer_0" not in stacked["encoder"]
  assert stacked["decoder"]["layers"]["feed_forward"]["wi"]["kernel"].shape[0] == 3
  assert _leaves_equal(unstack_layers(stacked), base)
  assert _leaves_equal(split_qkv(fuse_qkv(base)), base)
  assert _leaves_equal(split_qkv(unstack_layers(fuse_qkv(stacked))), base)
  # Cross-attention keeps separate projections.
  assert "qkv" not in fuse_qkv(base)["decoder"]["layer_0"]["cross_attention"]
  gap = {"encoder": {"layer_0": base["encoder"]["layer_0"],
                     "layer_2": base["encoder"]["layer_1"]}}
  with pytest.raises(ValueError, match="layer_0..layer_1"):
    stack_layers(gap)


@functools.lru_cache(maxsize=None)
def _loss_and_grad(cfg):
  model = Transformer(cfg)

  def loss(params, batch, key):
    logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], train=True,
                         rngs={"dropout": key})
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, batch["tgt_out"][..., None], -1)[..., 0]
    return (nll * (batch["tgt_out"] != 0)).sum(), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("flags", [dict(scan_layers=True), dict(fused_qkv=True),
                                   dict(scan_layers=True, fused_qkv=True)],
                         ids=["scan", "fused", "scan+fused"])
def test_layout_gives_same_logits_and_gradients(flags):
  cfg, convert = _layout(**flags)
  params = transformer_variables(_config())["params"]
  batch, key = _batch(), jax.random.PRNGKey(0)
  (loss, logits), grads = _loss_and_grad(_config())(params, batch, key)
  (loss2, logits2), grads2 = _loss_and_grad(cfg)(convert(params), batch, key)
  assert_close(logits2, logits)
  assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
  expected = convert(grads)
  assert jax.tree_util.tree_structure(grads2) == jax.tree_util.tree_structure(expected)
  for g2, g in zip(jax.tree_util.tree_leaves(grads2), jax.tree_util.tree_leaves(expected)):
    assert_close(g2, g)


@pytest.mark.parametrize("policy", sorted(REMAT_POLICIES))
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_remat_gives_same_logits_and_gradients(policy, scan):
  """With dropout on: remat must replay the same dropout masks when it recomputes."""
  base = _config(scan_layers=scan, dropout_rate=0.2, attention_dropout_rate=0.1)
  params = transformer_variables(_config())["params"]
  params = stack_layers(params) if scan else params
  batch, key = _batch(), jax.random.PRNGKey(3)
  (loss, logits), grads = _loss_and_grad(base)(params, batch, key)
  (loss2, logits2), grads2 = _loss_and_grad(base.replace(remat_policy=policy))(params, batch,
                                                                               key)
  assert_close(logits2, logits)
  for g2, g in zip(jax.tree_util.tree_leaves(grads2), jax.tree_util.tree_leaves(grads),
                   strict=True):
    assert_close(g2, g)
  # Dropout was active, so the comparison covers its masks.
  (_, deterministic), _ = _loss_and_grad(_config(scan_layers=scan))(params, batch, key)
  assert np.abs(np.asarray(logits) - np.asarray(deterministic)).max() > 1e-3


def test_remat_recomputes_in_the_backward_pass():
  """remat changes the program, not the result: "full" recomputes each layer's forward
  matmuls in the backward pass (more dot products than without remat)."""
  from transformer_jax.flops import matmul_flops
  params, batch = transformer_variables(_config())["params"], _batch()
  counts = {}
  for policy in ("none", "full"):
    grad_fn = _loss_and_grad(_config(remat_policy=policy))
    counts[policy] = matmul_flops(grad_fn, params, batch, jax.random.PRNGKey(0))
  assert counts["full"] > counts["none"]


# -------------------------------------------------------------------- cuDNN fallback
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the non-GPU fallback")
def test_cudnn_falls_back_to_xla_off_gpu():
  params = transformer_variables(_config())["params"]
  batch = _batch()
  expected = Transformer(_config()).apply({"params": params}, batch["src"], batch["tgt_in"])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from transformer_jax.modules import kernels
    kernels._warn_fallback.cache_clear()
    got = Transformer(_config(attention_impl="cudnn")).apply(
        {"params": params}, batch["src"], batch["tgt_in"])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  assert any("falls back to 'xla'" in str(w.message) for w in caught)


# ------------------------------------------------------------------------ train step
def _train_setup(cfg, optimizer):
  task = Seq2SeqTask(cfg, label_smoothing=0.1)
  return task, make_train_step(task, optimizer, optax.constant_schedule(1.0))


def _state(params, optimizer):
  return create_train_state(jax.tree_util.tree_map(jnp.array, params), optimizer, seed=0)


def test_train_step_with_all_speed_features_equals_plain_step():
  """scan + fused QKV + remat: the step's updated parameters and metrics equal the plain
  model's, after converting its parameters (SGD: updates are linear in the gradient)."""
  sgd = optax.sgd(0.5, momentum=0.9)
  fast_cfg = _config(scan_layers=True, fused_qkv=True, remat_policy="dots")
  _, plain_step = _train_setup(_config(), sgd)
  _, fast_step = _train_setup(fast_cfg, sgd)
  params = transformer_variables(_config())["params"]
  batch = jax.device_put(_batch())
  convert = lambda p: fuse_qkv(stack_layers(p))
  plain, plain_metrics = plain_step(_state(params, sgd), batch)
  fast, fast_metrics = fast_step(_state(convert(params), sgd), batch)
  for key in ("loss", "accuracy", "grad_norm"):
    assert float(fast_metrics[key]) == pytest.approx(float(plain_metrics[key]), rel=1e-5)
  expected = convert(jax.device_get(plain.params))
  for x, y in zip(jax.tree_util.tree_leaves(fast.params), jax.tree_util.tree_leaves(expected),
                  strict=True):
    assert_close(x, y)
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree_util.tree_leaves(plain.params), jax.tree_util.tree_leaves(params)))
  assert moved > 1e-3


def test_train_step_donates_state_and_makes_no_host_transfer():
  adam = optax.adam(1e-3)
  _, step = _train_setup(_config(dtype="bfloat16"), adam)
  state = _state(transformer_variables(_config())["params"], adam)
  batch = jax.device_put(_batch())
  step(state, batch)                    # compile outside the guard (constants are staged)
  state = _state(transformer_variables(_config())["params"], adam)
  with jax.transfer_guard("disallow"):  # any implicit host<->device copy raises
    new_state, metrics = step(state, batch)
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state))    # donated
  assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))
  # bfloat16 compute, float32 parameters and Adam moments.
  for x in jax.tree_util.tree_leaves((new_state.params, new_state.opt_state)):
    if jnp.issubdtype(x.dtype, jnp.floating):
      assert x.dtype == jnp.float32


# ------------------------------------------------------------- tied output projection
def test_tied_projection_gradient_equals_autodiff():
  """The training-mode output projection (custom VJP arranged for XLA:CPU) has the values
  and gradients of the plain `x @ table^T` it replaces."""
  from transformer_jax.modules.embedding import tied_projection
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(11, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)
  plain = lambda x, t: jnp.sum(jnp.dot(x, t.T) * g)
  custom = lambda x, t: jnp.sum(tied_projection(x, t) * g)
  assert_close(tied_projection(x, table), jnp.dot(x, table.T))
  for a, b in zip(jax.grad(custom, (0, 1))(x, table), jax.grad(plain, (0, 1))(x, table)):
    assert_close(a, b)
  # Through the model: with no dropout, train=True (custom VJP) and train=False
  # (nn.Embed.attend) give the same gradients.
  cfg, params, batch = _config(), transformer_variables(_config())["params"], _batch()
  loss = lambda p, train: Transformer(cfg).apply({"params": p}, batch["src"], batch["tgt_in"],
                                                 train=train).sum()
  grads = jax.jit(jax.grad(loss), static_argnums=1)
  for a, b in zip(jax.tree_util.tree_leaves(grads(params, True)),
                  jax.tree_util.tree_leaves(grads(params, False)), strict=True):
    assert_close(a, b, atol=1e-4, rtol=1e-4)
