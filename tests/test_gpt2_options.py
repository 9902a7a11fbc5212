"""The TransformerConfig options GPT-2 is expressed with: unscaled token embeddings
(scale_embeddings=False) and one token for BOS and EOS (bos_is_eos)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.config import (
  BOS_ID,
  EOS_ID,
  NO_TOKEN_LOGIT,
  PAD_ID,
  UNK_ID,
  TransformerConfig,
)
from transformer_jax.errors import UserError
from transformer_jax.modules.models import LanguageModel
from transformer_jax.tasks.losses import cross_entropy_sums

GPT2_LIKE = dict(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=0,
                 num_decoder_layers=2, max_len=16, norm_position="pre", positional="learned",
                 activation="gelu", dropout_rate=0.0)
TOKENS = jnp.array([[BOS_ID, 7, 9, 12, EOS_ID, 5, PAD_ID, PAD_ID]])


def _model(**overrides):
  cfg = TransformerConfig(**{**GPT2_LIKE, **overrides})
  model = LanguageModel(cfg)
  return model, nn.meta.unbox(model.init(jax.random.PRNGKey(0), TOKENS))


@pytest.mark.parametrize("field", ["scale_embeddings", "bos_is_eos"])
@pytest.mark.parametrize("value", [1, "False", None])
def test_flags_must_be_booleans(field, value):
  with pytest.raises(UserError, match=f"TransformerConfig.{field}="):
    TransformerConfig(vocab_size=10, **{field: value})


def test_scale_embeddings_false_leaves_the_embeddings_as_they_are():
  """The same parameters, with the table scaled by sqrt(d_model) and scale_embeddings=False,
  compute what the default (scaled) model computes: the only difference is that factor."""
  model, variables = _model()
  unscaled, _ = _model(scale_embeddings=False)
  params = variables["params"]
  table = params["embedding"]["embedding"]
  # The tied output reads the table too: scaling it scales the logits by the same factor.
  scaled = {**params, "embedding": {"embedding": table * jnp.sqrt(16.0)}}
  expected = model.apply(variables, TOKENS) * jnp.sqrt(16.0)
  np.testing.assert_allclose(unscaled.apply({"params": scaled}, TOKENS), expected, rtol=1e-4,
                             atol=1e-4)


def test_bos_is_eos_reads_eos_for_bos_and_scores_no_pad_bos_or_unk():
  model, variables = _model(bos_is_eos=True, scale_embeddings=False)
  logits = model.apply(variables, TOKENS)
  assert np.all(np.asarray(logits[..., [PAD_ID, BOS_ID, UNK_ID]]) == NO_TOKEN_LOGIT)
  assert np.all(np.asarray(logits[..., EOS_ID]) > NO_TOKEN_LOGIT / 2)
  np.testing.assert_array_equal(model.apply(variables, TOKENS.at[0, 0].set(EOS_ID)), logits)
  assert np.all(np.isfinite(np.asarray(jax.nn.log_softmax(logits))))
  # In the loss (label smoothing too) PAD, BOS and UNK rows get no gradient, so training
  # leaves them as an import wrote them.
  targets = jnp.array([[7, 9, 12, EOS_ID, 5, 6, PAD_ID, PAD_ID]])
  for smoothing in (0.0, 0.1):
    def loss(params):
      return cross_entropy_sums(model.apply({"params": params}, TOKENS, train=True), targets,
                                smoothing)["loss"]
    value, grads = jax.value_and_grad(loss)(variables["params"])
    table = np.asarray(grads["embedding"]["embedding"])
    assert np.isfinite(value) and np.all(table[[PAD_ID, BOS_ID, UNK_ID]] == 0)
    assert np.any(table[EOS_ID] != 0)


def test_bos_is_eos_sampling_starts_from_eos_and_never_draws_the_absent_ids():
  from transformer_jax import sampling
  model, variables = _model(bos_is_eos=True, scale_embeddings=False)
  prompts = jnp.array([[7, 9, 0], [12, 0, 0]])
  for temperature in (0.0, 5.0):
    out = np.asarray(sampling.generate(model, variables["params"], prompts, 8, temperature,
                                       0, 1.0, 3))
    drawn = out[out != PAD_ID]
    assert not np.isin(drawn, [BOS_ID, UNK_ID]).any()
