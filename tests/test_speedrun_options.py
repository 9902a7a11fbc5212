"""The modded-nanogpt speedrun's model options (TransformerConfig), each by its property:
ReLU² is the feed-forward's ReLU squared; zero-initialised residual projections make every
layer start as the identity; soft-capped logits are c * tanh(logits / c) and never reach c;
bad values name the field. Muon, the speedrun's optimizer: tests/test_muon.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lm import MODERN, _params, _tokens, lm_config

from transformer_jax import trees
from transformer_jax.errors import UserError
from transformer_jax.modules.layers import FeedForward
from transformer_jax.modules.models import LanguageModel


def test_relu2_is_the_square_of_relu():
  cfg = lm_config(activation="relu2", use_bias=False)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 32)), jnp.float32)
  ffn = FeedForward(cfg)
  params = nn.meta.unbox(ffn.init(jax.random.key(0), x)["params"])
  wi, wo = (np.asarray(params[n]["kernel"]) for n in ("wi", "wo"))
  expected = np.maximum(np.asarray(x) @ wi, 0) ** 2 @ wo
  np.testing.assert_allclose(ffn.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, MODERN])
def test_zero_initialised_residual_projections_make_each_layer_the_identity(options):
  """At initialisation the logits do not depend on any attention or feed-forward weight but
  the two zeroed projections: redrawing all the others changes nothing."""
  cfg = lm_config(**options, zero_init_residual=True)
  params, other = nn.meta.unbox(_params(cfg, 0)), nn.meta.unbox(_params(cfg, 1))
  zeroed = [p for p, _ in trees.named_leaves(params) if p.endswith(("out/kernel", "wo/kernel"))]
  assert len(zeroed) == 2 * cfg.num_decoder_layers
  assert all(not np.any(trees.get_path(params, p)) for p in zeroed)
  mixed = trees.flatten(params)
  mixed.update({p: x for p, x in trees.named_leaves(other) if "/layer_" in p})
  tokens = _tokens(0, 2, 8)
  logits = lambda p: np.asarray(LanguageModel(cfg).apply({"params": p}, tokens))
  np.testing.assert_array_equal(logits(params), logits(trees.unflatten(mixed)))
  plain = lm_config(**options)
  assert any(np.any(trees.get_path(nn.meta.unbox(_params(plain, 0)), p)) for p in zeroed)


def test_soft_capped_logits_are_c_tanh_of_the_logits():
  cap = 2.0
  params, tokens = _params(lm_config()), _tokens(0, 2, 8)
  raw = np.asarray(LanguageModel(lm_config()).apply({"params": params}, tokens))
  capped = np.asarray(LanguageModel(lm_config(logit_softcap=cap)).apply({"params": params},
                                                                         tokens))
  assert np.abs(raw).max() > cap
  np.testing.assert_allclose(capped, cap * np.tanh(raw / cap), rtol=1e-5, atol=1e-6)
  assert np.abs(capped).max() < cap


@pytest.mark.parametrize("change, field", [
    (dict(activation="relu3"), "activation"), (dict(zero_init_residual=1), "zero_init_residual"),
    (dict(logit_softcap=-1.0), "logit_softcap")])
def test_bad_values_name_the_field(change, field):
  with pytest.raises(UserError, match=rf"\b{field}\b"):
    lm_config(**change)
