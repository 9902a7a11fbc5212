"""Model-level properties: padding invariance, causality, packing, positional encodings,
encode/decode on their own, classifier heads, parameter counts and embedding sharing."""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  VOCAB,
  assert_close,
  pad_to,
  random_tokens,
  tiny_config,
  transformer_apply,
  transformer_variables,
)

from transformer_jax import (
  EncoderClassifier,
  TokenClassifier,
  Transformer,
  TransformerConfig,
  count_params,
)
from transformer_jax.config import BOS_ID
from transformer_jax.modules.embedding import InputEmbedding, sinusoidal_table, token_embedding

# Two model variants used throughout: the paper's layout, and the modern options with two
# layers per stack (so a leak through a second layer would show).
VARIANTS = {
    "post-sinusoidal-xla": dict(),
    "pre-learned-einsum-2layers": dict(norm_position="pre", positional="learned",
                                       attention_impl="einsum", num_encoder_layers=2,
                                       num_decoder_layers=2),
}


def _batch():
  """src (2, 8) and tgt (2, 7); the second row has 5 real source and 4 real target tokens."""
  src = random_tokens(20, 2, 8)
  tgt = random_tokens(21, 2, 7)
  src[1, 5:] = 0
  tgt[1, 4:] = 0
  return src, tgt


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


# ----------------------------------------------------------------------- padding invariance
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformer_logits_ignore_appended_padding(variant):
  cfg = tiny_config(**VARIANTS[variant])
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt = _batch()
  real = tgt != 0
  logits = np.asarray(apply(variables, src, tgt))
  cases = [("both", pad_to(src, 12), pad_to(tgt, 10))]
  if variant == "post-sinusoidal-xla":  # Each side alone too (more compilations: one variant).
    cases += [("source", pad_to(src, 12), tgt), ("target", src, pad_to(tgt, 10))]
  for name, s, t in cases:
    padded = np.asarray(apply(variables, s, t))[:, : tgt.shape[1]]
    np.testing.assert_allclose(padded[real], logits[real], atol=1e-5, rtol=1e-5, err_msg=name)
  # A row alone, without any padding, gives the same logits as inside the padded batch.
  alone = np.asarray(apply(variables, src[1:, :5], tgt[1:, :4]))
  assert_close(alone[0], logits[1, :4])
  # Control: the padding is ignored because it is id 0; real tokens there change the output.
  filled = src.copy()
  filled[1, 5:] = 7
  assert _max_diff(apply(variables, filled, tgt)[1, :4], logits[1, :4]) > 1e-4


@functools.lru_cache(maxsize=None)
def _classifier_variables(kind: str):
  cfg = tiny_config()
  model = TokenClassifier(cfg, num_labels=9) if kind == "token" else EncoderClassifier(
      cfg, num_classes=3)
  return jax.jit(model.init)(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))


@functools.lru_cache(maxsize=None)
def _classifier(pooling: str | None):
  """(apply, variables) for EncoderClassifier(pooling) or, for None, TokenClassifier.
  Pooling adds no parameters, so the three poolings share one set."""
  cfg = tiny_config()
  if pooling is None:
    return jax.jit(TokenClassifier(cfg, num_labels=9).apply), _classifier_variables("token")
  model = EncoderClassifier(cfg, num_classes=3, pooling=pooling)
  return jax.jit(model.apply), _classifier_variables("sequence")


@pytest.mark.parametrize("pooling", ["mean", "max", "first"])
def test_encoder_classifier_ignores_padding(pooling):
  apply, variables = _classifier(pooling)
  tokens, _ = _batch()
  out = apply(variables, tokens)
  assert_close(apply(variables, pad_to(tokens, 12)), out)
  if pooling != "first":  # Control: non-pad ids in the padded slots do change the pooled output.
    filled = tokens.copy()
    filled[1, 5:] = 7
    assert _max_diff(apply(variables, filled)[1], out[1]) > 1e-4


def test_token_classifier_ignores_padding():
  apply, variables = _classifier(None)
  tokens, _ = _batch()
  out = np.asarray(apply(variables, tokens))
  real = tokens != 0
  assert_close(np.asarray(apply(variables, pad_to(tokens, 12)))[:, :8][real], out[real])
  assert_close(apply(variables, tokens[1:, :5])[0], out[1, :5])


def test_all_padding_rows_give_finite_outputs():
  """A row with no real token (batch padding) must not poison a batch with inf/NaN: it pools
  to zeros (mean and max alike), and the encoder-decoder stays finite too."""
  tokens, tgt = _batch()
  tokens[0] = 0
  pooled_outputs = {}
  for pooling in ("mean", "max", "first"):
    apply, variables = _classifier(pooling)
    out = np.asarray(apply(variables, tokens))
    assert np.all(np.isfinite(out)), pooling
    pooled_outputs[pooling] = out
  assert_close(pooled_outputs["max"][0], pooled_outputs["mean"][0])
  apply, variables = _classifier(None)
  assert np.all(np.isfinite(np.asarray(apply(variables, tokens))))
  cfg = tiny_config()
  logits = np.asarray(transformer_apply(cfg)(transformer_variables(cfg), tokens, tgt))
  assert np.all(np.isfinite(logits))


# ---------------------------------------------------------------------------------- heads
@pytest.mark.parametrize("pooling", ["mean", "max", "first"])
def test_encoder_classifier_output_shape(pooling):
  apply, variables = _classifier(pooling)
  out = apply(variables, _batch()[0])
  assert out.shape == (2, 3) and out.dtype == jnp.float32
  assert np.all(np.isfinite(out))


def test_token_classifier_output_shape():
  apply, variables = _classifier(None)
  out = apply(variables, _batch()[0])
  assert out.shape == (2, 8, 9) and out.dtype == jnp.float32
  assert np.all(np.isfinite(out))


@pytest.mark.parametrize("make, field", [
    (lambda cfg: EncoderClassifier(cfg, num_classes=1), "num_classes"),
    (lambda cfg: EncoderClassifier(cfg, num_classes=0), "num_classes"),
    (lambda cfg: EncoderClassifier(cfg, num_classes=3.0), "num_classes"),
    (lambda cfg: EncoderClassifier(cfg, num_classes=3, pooling="cls"), "pooling"),
    (lambda cfg: EncoderClassifier(cfg, num_classes=3, pooling=None), "pooling"),
    (lambda cfg: TokenClassifier(cfg, num_labels=1), "num_labels"),
    (lambda cfg: TokenClassifier(cfg, num_labels="9"), "num_labels"),
], ids=["classes=1", "classes=0", "classes=float", "pooling=cls", "pooling=None",
        "labels=1", "labels=str"])
def test_invalid_head_arguments_raise_naming_the_field(make, field):
  with pytest.raises(ValueError, match=rf"\b{field}\b"):
    make(tiny_config())


# ------------------------------------------------------------------------------ causality
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("t", [0, 3])
def test_decoder_is_causal(variant, t):
  cfg = tiny_config(**VARIANTS[variant])
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src = random_tokens(24, 2, 8)
  tgt = random_tokens(25, 2, 7)
  changed = tgt.copy()
  changed[:, t + 1:] = (tgt[:, t + 1:] % (VOCAB - 1)) + 1        # different real tokens
  assert np.all(changed[:, t + 1:] != tgt[:, t + 1:])
  before = np.asarray(apply(variables, src, tgt))
  after = np.asarray(apply(variables, src, changed))
  assert_close(after[:, : t + 1], before[:, : t + 1])
  per_position = np.abs(after - before).max(axis=(0, 2))
  assert np.all(per_position[t + 1:] > 1e-4), per_position


# -------------------------------------------------------------------------------- packing
def _packed_example():
  a_src, a_tgt = random_tokens(30, 1, 4), random_tokens(31, 1, 3)
  b_src, b_tgt = random_tokens(32, 1, 3), random_tokens(33, 1, 4)
  src = np.concatenate([a_src, b_src, np.zeros((1, 2), np.int32)], 1)        # (1, 9)
  tgt = np.concatenate([a_tgt, b_tgt, np.zeros((1, 1), np.int32)], 1)        # (1, 8)
  packing = dict(
      src_segment_ids=np.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]], np.int32),
      src_positions=np.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]], np.int32),
      tgt_segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32),
      tgt_positions=np.array([[0, 1, 2, 0, 1, 2, 3, 0]], np.int32))
  return (a_src, a_tgt), (b_src, b_tgt), src, tgt, packing


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_packed_pairs_match_separate_runs(positional):
  cfg = tiny_config(positional=positional)
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  (a_src, a_tgt), (b_src, b_tgt), src, tgt, packing = _packed_example()
  packed = np.asarray(apply(variables, src, tgt, **packing))[0]
  alone_a = np.asarray(apply(variables, a_src, a_tgt))[0]
  alone_b = np.asarray(apply(variables, b_src, b_tgt))[0]
  assert_close(packed[:3], alone_a)
  assert_close(packed[3:7], alone_b)

  # Controls: with one segment the second pair sees the first; without restarting
  # positions it is encoded at the wrong offsets. Either way its logits change. (Arrays, not
  # None, keep the call signature and so the compiled program.)
  one_segment = (src != 0).astype(np.int32), (tgt != 0).astype(np.int32)
  no_segments = dict(packing, src_segment_ids=one_segment[0], tgt_segment_ids=one_segment[1])
  no_restart = dict(packing, src_positions=np.arange(9, dtype=np.int32)[None],
                    tgt_positions=np.arange(8, dtype=np.int32)[None])
  for kwargs in (no_segments, no_restart):
    wrong = np.asarray(apply(variables, src, tgt, **kwargs))[0]
    assert _max_diff(wrong[3:7], alone_b) > 1e-4


# ------------------------------------------------------------------- positional encodings
@pytest.mark.parametrize("max_len, d_model", [(128, 64), (16, 7)])
def test_sinusoidal_table_matches_formula(max_len, d_model):
  table = sinusoidal_table(max_len, d_model)
  assert table.shape == (max_len, d_model) and table.dtype == np.float32
  for pos in (0, 1, 5, max_len - 1):
    for col in sorted({0, 1, 2, 3, d_model - 2, d_model - 1}):
      i = col // 2
      angle = pos / (10000.0 ** (2 * i / d_model))
      expected = math.sin(angle) if col % 2 == 0 else math.cos(angle)
      assert abs(float(table[pos, col]) - expected) < 1e-6, (pos, col)
  assert np.all(np.abs(table) <= 1.0)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_input_embedding_is_scaled_token_embedding_plus_position(positional):
  cfg = tiny_config(positional=positional)
  module = InputEmbedding(cfg, token_embedding(cfg, VOCAB, "embedding"))
  tokens = random_tokens(34, 2, 6)
  positions = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]], np.int32)
  variables = module.init(jax.random.PRNGKey(0), tokens, positions)
  out = np.asarray(module.apply(variables, tokens, positions))
  params = variables["params"]
  table = np.asarray(jax.tree_util.tree_leaves(params["embedding"])[0])
  if positional == "sinusoidal":
    pe = sinusoidal_table(cfg.max_len, cfg.d_model)
  else:
    pe = np.asarray(jax.tree_util.tree_leaves(params["positional"])[0])
  assert pe.shape == (cfg.max_len, cfg.d_model)
  expected = table[tokens] * np.sqrt(cfg.d_model) + pe[positions]
  assert_close(out, expected)


# -------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encode_then_decode_equals_call(variant):
  cfg = tiny_config(**VARIANTS[variant])
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt = _batch()
  encoded = apply(variables, src, method=Transformer.encode)
  assert encoded.shape == (2, 8, cfg.d_model)
  logits = apply(variables, encoded, src, tgt, method=Transformer.decode)
  assert_close(logits, apply(variables, src, tgt))
  # Control: the decoder does use the encoder output.
  other = apply(variables, encoded[::-1], src, tgt, method=Transformer.decode)
  assert _max_diff(other, logits) > 1e-4


@pytest.mark.parametrize("zero_start", [True, False])
def test_zero_decoder_start_reads_zeros_for_bos(zero_start):
  """With zero_decoder_start the decoder's BOS input is a zero vector (Marian's and
  CTranslate2's decoder start): its logits do not move when the BOS embedding row does,
  except the column that scores BOS as an output (the tied projection). Without it, they do."""
  cfg = tiny_config(zero_decoder_start=zero_start)
  apply = transformer_apply(cfg)
  variables = transformer_variables(cfg)
  src, tgt = _batch()
  tgt[:, 0] = BOS_ID
  moved = jax.tree_util.tree_map(lambda x: x, variables)
  table = moved["params"]["shared_embedding"]["embedding"]
  moved["params"]["shared_embedding"]["embedding"] = table.at[BOS_ID].add(1.0)
  others = np.arange(cfg.vocab_size) != BOS_ID
  change = _max_diff(apply(moved, src, tgt)[..., others], apply(variables, src, tgt)[..., others])
  assert (change < 1e-6) if zero_start else (change > 1e-3)


# ------------------------------------------------------------------------ parameter counts
def _param_shapes(cfg: TransformerConfig):
  dummy = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), dummy, dummy)
  return shapes["params"]


@pytest.mark.parametrize("preset, millions", [("base", 63.08), ("big", 214.25)])
def test_paper_parameter_counts(preset, millions):
  cfg = getattr(TransformerConfig, preset)(37000)
  count = count_params(_param_shapes(cfg))
  assert abs(count / 1e6 - millions) / millions < 0.01, count


def _leaf_shapes(params) -> list[tuple[str, tuple[int, ...]]]:
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(flax.linen.meta.unbox(params)))
  return [("/".join(path), tuple(leaf.shape)) for path, leaf in flat.items()]


def test_shared_embedding_is_a_single_table():
  cfg = tiny_config()
  leaves = _leaf_shapes(_param_shapes(cfg))
  tables = [name for name, shape in leaves if shape == (VOCAB, cfg.d_model)]
  assert tables == ["shared_embedding/embedding"]
  assert not any("output_projection" in name for name, _ in leaves)


@pytest.mark.parametrize("tie_output", [True, False])
def test_unshared_embeddings_add_exactly_the_expected_parameters(tie_output):
  d, v_src, v_tgt = 32, VOCAB, VOCAB + 7
  shared = count_params(_param_shapes(tiny_config()))
  cfg = tiny_config(share_embeddings=False, tie_output=tie_output, target_vocab_size=v_tgt)
  leaves = _leaf_shapes(_param_shapes(cfg))
  assert sorted(n for n, s in leaves if s in ((v_src, d), (v_tgt, d))) == [
      "source_embedding/embedding", "target_embedding/embedding"]
  extra = v_tgt * d                               # a second (target) embedding table
  if not tie_output:
    extra += d * v_tgt + v_tgt                    # pre-softmax projection kernel + bias
  assert count_params(_param_shapes(cfg)) - shared == extra
  assert any("output_projection" in n for n, _ in leaves) == (not tie_output)


@pytest.mark.parametrize("tie_output", [True, False])
def test_tied_output_projection_reads_the_embedding(tie_output):
  """Perturbing the target-embedding row of a token absent from the inputs changes exactly
  that token's logit when the output is tied, and nothing when it is not."""
  # (Same configs as the option tests in test_options.py, so the parameters are shared.)
  cfg = tiny_config(share_embeddings=False, tie_output=tie_output, target_vocab_size=VOCAB + 7)
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt = _batch()
  absent = VOCAB + 3                       # a target id; _batch draws ids below VOCAB
  assert not np.any(tgt == absent)
  perturbed = jax.tree_util.tree_map(np.array, variables)             # a mutable copy
  # A random direction: a constant shift would be invisible to zero-mean LayerNorm outputs.
  delta = np.random.default_rng(1).normal(size=cfg.d_model).astype(np.float32)
  perturbed["params"]["target_embedding"]["embedding"][absent] += delta
  before = np.asarray(apply(variables, src, tgt))
  after = np.asarray(apply(perturbed, src, tgt))
  assert before.shape[-1] == cfg.tgt_vocab_size
  others = np.arange(cfg.tgt_vocab_size) != absent
  assert_close(after[..., others], before[..., others])
  assert (_max_diff(after[..., absent], before[..., absent]) > 1e-3) == tie_output
