"""Decoding: the KV cache against the full decoder, greedy vs beam search, EOS handling,
beam scores and the length penalty, and generate()'s argument checks.

Models are tiny and untrained; every jitted function is compiled once per config and reused
with different parameter values (random inits, an EOS/PAD bias on the output layer).
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import decoding
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig
from transformer_jax.modules.models import Transformer

jax.config.update("jax_default_matmul_precision", "highest")

VOCAB = 12
SRC_LEN = 6
MAX_LENGTH = 8


def small_config(**overrides) -> TransformerConfig:
  params = dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
                dropout_rate=0.0, max_len=16)
  params.update(overrides)
  return TransformerConfig.small(vocab_size=VOCAB, **params)


# Untied output layer: its bias lets a test make EOS likely and PAD impossible.
UNTIED = small_config(tie_output=False)


@functools.lru_cache(maxsize=None)
def _init_fn(cfg: TransformerConfig):
  """One compiled init per config (a fresh jax.jit per call would recompile every time)."""
  dummy = jnp.ones((1, 4), jnp.int32)
  return jax.jit(lambda key: nn.meta.unbox(Transformer(cfg).init(key, dummy, dummy)["params"]))


@functools.lru_cache(maxsize=None)
def init_params(cfg: TransformerConfig, seed: int):
  return _init_fn(cfg)(jax.random.PRNGKey(seed))


def biased_params(seed: int, eos_bias: float, cfg: TransformerConfig = UNTIED):
  """Random untied model whose output bias adds `eos_bias` to EOS and forbids PAD (so a
  decoded sequence never holds PAD before its end and teacher forcing sees no padding)."""
  params = init_params(cfg, seed)
  bias = params["decoder"]["output_projection"]["bias"]
  bias = bias.at[EOS_ID].add(eos_bias).at[PAD_ID].set(-1e4)
  decoder = {**params["decoder"],
             "output_projection": {**params["decoder"]["output_projection"], "bias": bias}}
  return {**params, "decoder": decoder}


def random_src(seed: int, batch: int = 8, length: int = SRC_LEN) -> np.ndarray:
  """Sources of random lengths 1..length (at least one full-length row), PAD after."""
  rng = np.random.default_rng(seed)
  src = rng.integers(3, VOCAB, size=(batch, length)).astype(np.int32)
  lengths = rng.integers(1, length + 1, size=batch)
  lengths[0] = length
  src[np.arange(length)[None, :] >= lengths[:, None]] = PAD_ID
  return src


@functools.lru_cache(maxsize=None)
def full_log_probs_fn(cfg: TransformerConfig):
  model = Transformer(cfg)
  return jax.jit(lambda params, src, tgt: jax.nn.log_softmax(
      model.apply({"params": params}, src, tgt), -1))


def greedy(cfg: TransformerConfig, params, src, max_length: int = MAX_LENGTH) -> np.ndarray:
  """decoding.greedy_search, through generate (which compiles it once per config/shape)."""
  return decoding.generate(cfg, params, src, max_length=max_length, beam_size=1)


@functools.lru_cache(maxsize=None)
def beam_fn(cfg: TransformerConfig, max_length: int, beam_size: int, alpha: float):
  model = Transformer(cfg)
  return jax.jit(lambda params, src: decoding.beam_search(model, params, src, max_length,
                                                          beam_size, alpha))


def first_eos_lengths(out: np.ndarray) -> np.ndarray:
  """Per row: length up to and including the first EOS, or 0 where there is none."""
  has = (out == EOS_ID).any(1)
  return np.where(has, np.argmax(out == EOS_ID, 1) + 1, 0)


def teacher_forced_log_prob(cfg, params, src: np.ndarray, out: np.ndarray,
                            lengths: np.ndarray) -> np.ndarray:
  """log P(out[:L]) under the full (uncached) model, L = lengths per row."""
  batch, width = out.shape
  tgt_in = np.zeros((batch, width), np.int32)
  tgt_in[:, 0] = BOS_ID
  tgt_in[:, 1:] = out[:, :-1]
  tgt_in[np.arange(width)[None, :] >= lengths[:, None]] = PAD_ID
  log_probs = np.asarray(full_log_probs_fn(cfg)(params, src, tgt_in), np.float64)
  picked = np.take_along_axis(log_probs, out[:, :, None], -1)[..., 0]
  return (picked * (np.arange(width)[None, :] < lengths[:, None])).sum(1)


# ------------------------------------------------------------------- cache vs full decoder
@functools.lru_cache(maxsize=None)
def _cached_log_probs_fn(cfg: TransformerConfig, max_length: int):
  """Creates the cache, then steps it over every position of a teacher-forced target."""
  model = Transformer(cfg)

  def run(params, src, tgt):
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    stepper = decoding._cached_stepper(model, params, encoded, src, max_length, beams=1)
    cache = stepper.carry
    outs = []
    for i in range(tgt.shape[1]):
      log_probs, cache = stepper.step(cache, tgt, tgt[:, i], jnp.array(i))
      outs.append(log_probs)
    return jnp.stack(outs, 1)
  return jax.jit(run)


@pytest.mark.parametrize("overrides", [
    dict(norm_position="post"),
    dict(norm_position="pre", positional="learned", num_decoder_layers=2),
], ids=["post_ln_sinusoidal", "pre_ln_learned_positions_2_layers"])
def test_cached_decoding_matches_full_decoder(overrides):
  cfg = small_config(**overrides)
  params = init_params(cfg, 1)
  rng = np.random.default_rng(3)
  batch, length = 5, 7
  src = random_src(4, batch)
  tgt = rng.integers(3, VOCAB, size=(batch, length)).astype(np.int32)
  tgt[:, 0] = BOS_ID
  lengths = np.array([7, 1, 4, 6, 2])                # Target prefixes of different lengths.
  valid = np.arange(length)[None, :] < lengths[:, None]
  tgt[~valid] = PAD_ID

  full = np.asarray(full_log_probs_fn(cfg)(params, src, tgt))
  cached = np.asarray(_cached_log_probs_fn(cfg, length)(params, src, tgt))
  assert cached.shape == full.shape == (batch, length, VOCAB)
  np.testing.assert_allclose(cached[valid], full[valid], atol=1e-5, rtol=1e-5)
  # Non-trivial distributions, so agreement is meaningful.
  assert np.abs(np.diff(full[valid], axis=-1)).max() > 1e-3


def test_cross_attention_keys_values_are_cached_once():
  cfg = small_config(norm_position="pre", positional="learned", num_decoder_layers=2)
  model = Transformer(cfg)
  params = init_params(cfg, 2)
  src = jnp.asarray(random_src(5, 3))

  @jax.jit
  def init_and_step(params, src):
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    stepper = decoding._cached_stepper(model, params, encoded, src, MAX_LENGTH, beams=1)
    cache = stepper.carry
    # A step without the encoder output (the stepper passes encoded=None) reads the cache.
    bos = jnp.full((src.shape[0],), BOS_ID, jnp.int32)
    log_probs, new_cache = stepper.step(cache, bos[:, None], bos, jnp.array(0))
    full = jax.nn.log_softmax(model.apply({"params": params}, src,
                                          jnp.full((src.shape[0], 1), BOS_ID, jnp.int32)))
    return encoded, cache, log_probs, new_cache, full[:, 0]

  encoded, cache, log_probs, new_cache, full = init_and_step(params, src)
  for i in range(cfg.num_decoder_layers):
    layer = cache["decoder"][f"layer_{i}"]
    cross = layer["cross_attention"]
    assert set(cross) >= {"cross_key", "cross_value"}
    shape = (3, SRC_LEN, cfg.num_heads, cfg.head_dim)
    assert cross["cross_key"].shape == cross["cross_value"].shape == shape
    # They are the key/value projections of the encoder output.
    for name in ("key", "value"):
      proj = params["decoder"][f"layer_{i}"]["cross_attention"][name]
      expected = jnp.einsum("bsd,dnh->bsnh", encoded, proj["kernel"]) + proj["bias"]
      np.testing.assert_allclose(cross[f"cross_{name}"], expected, atol=1e-5, rtol=1e-5)
    assert not np.any(layer["self_attention"]["cached_key"])     # nothing written yet

  assert log_probs.shape == (3, VOCAB)
  for i in range(cfg.num_decoder_layers):
    old, new = cache["decoder"][f"layer_{i}"], new_cache["decoder"][f"layer_{i}"]
    for name in ("cross_key", "cross_value"):      # Not recomputed or modified by a step.
      np.testing.assert_array_equal(new["cross_attention"][name], old["cross_attention"][name])
    written = np.any(new["self_attention"]["cached_key"] != 0, axis=(0, 1, 3))   # (B, K, L, H)
    assert written.tolist() == [True] + [False] * (len(written) - 1)   # position 0 only
  np.testing.assert_allclose(log_probs, full, atol=1e-5, rtol=1e-5)

  # Without a cache, cross-attention cannot run on encoded=None.
  with pytest.raises(ValueError, match="encoder output"):
    model.apply({"params": params}, None, src, jnp.ones((3, 1), jnp.int32),
                method=Transformer.decode)


# --------------------------------------------------------------------- greedy and beam
EOS_BIASES = (0.0, 1.0, 2.0, 3.0, 5.0)


def test_beam_size_one_equals_greedy():
  beam1 = beam_fn(UNTIED, MAX_LENGTH, 1, 0.6)
  eos_rows = no_eos_rows = 0
  for seed, eos_bias in enumerate(EOS_BIASES):
    params = biased_params(seed, eos_bias)
    src = random_src(100 + seed)
    expected = greedy(UNTIED, params, src)
    actual, _ = beam1(params, src)
    np.testing.assert_array_equal(np.asarray(actual), expected, err_msg=f"seed {seed}")
    has_eos = (expected == EOS_ID).any(1)
    eos_rows += int(has_eos.sum())
    no_eos_rows += int((~has_eos).sum())
  assert eos_rows > 0 and no_eos_rows > 0   # Both the EOS and the max_length endings.


@pytest.mark.parametrize("beam_size", [1, 4])
def test_nothing_follows_eos(beam_size):
  """A finished hypothesis never grows: after the first EOS there is only PAD."""
  eos_rows = 0
  for seed, eos_bias in enumerate(EOS_BIASES):
    params = biased_params(seed, eos_bias)
    for j in range(2):
      src = random_src(300 + 10 * seed + j)
      out = decoding.generate(UNTIED, params, src, max_length=MAX_LENGTH,
                              beam_size=beam_size)
      assert out.shape == (src.shape[0], MAX_LENGTH)
      lengths = first_eos_lengths(out)
      for row, n in zip(out, lengths):
        if n:
          assert (row[n:] == PAD_ID).all(), row
          assert (row[:n - 1] != PAD_ID).all(), row   # PAD is forbidden by the bias.
        else:
          assert (row != PAD_ID).all(), row           # Ran to max_length.
      eos_rows += int((lengths > 0).sum())
  assert eos_rows > 0


def test_beam_search_scores_at_least_greedy():
  """Beam 4's best score >= the greedy hypothesis's score, both as
  log P / ((5 + len) / 6) ** alpha with len counting EOS, where greedy ended with EOS.

  This is what a beam is for, but not a theorem: beams are pruned by raw log P and a source
  stops at K finished hypotheses, so the greedy path can be lost. On these random models it
  failed for 1 of ~1600 sources tried (seeds not used here); the seeds below are fixed."""
  alpha = 0.6
  beam4 = beam_fn(UNTIED, MAX_LENGTH, 4, alpha)
  compared = 0
  for seed, eos_bias in enumerate(EOS_BIASES):
    params = biased_params(seed, eos_bias)
    src = random_src(400 + seed)
    g = greedy(UNTIED, params, src)
    _, beam_scores = beam4(params, src)
    lengths = first_eos_lengths(g)
    log_p = teacher_forced_log_prob(UNTIED, params, src, g, lengths)
    greedy_scores = log_p / decoding.length_penalty(lengths.astype(np.float64), alpha)
    ended = lengths > 0
    compared += int(ended.sum())
    assert (np.asarray(beam_scores)[ended] >= greedy_scores[ended] - 1e-4).all(), (
        seed, np.asarray(beam_scores), greedy_scores, lengths)
  assert compared >= 5


def test_beam_search_score_is_normalised_log_prob_of_its_output():
  """The score beam_search returns is log P(output) / length_penalty(len), recomputed here
  by teacher forcing; len counts EOS, or is max_length for a hypothesis cut off there."""
  alpha = 0.6
  beam4 = beam_fn(UNTIED, MAX_LENGTH, 4, alpha)
  ended_rows = 0
  for seed, eos_bias in enumerate(EOS_BIASES):
    params = biased_params(seed, eos_bias)
    src = random_src(500 + seed)
    out, scores = beam4(params, src)
    out = np.asarray(out)
    lengths = first_eos_lengths(out)
    ended_rows += int((lengths > 0).sum())
    lengths = np.where(lengths > 0, lengths, MAX_LENGTH)
    log_p = teacher_forced_log_prob(UNTIED, params, src, out, lengths)
    expected = log_p / decoding.length_penalty(lengths.astype(np.float64), alpha)
    np.testing.assert_allclose(np.asarray(scores), expected, rtol=1e-4, atol=1e-4)
  assert ended_rows > 0


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.0])
def test_length_penalty_formula(alpha):
  lengths = np.array([1.0, 2.0, 5.0, 10.0, 37.0])
  np.testing.assert_allclose(np.asarray(decoding.length_penalty(jnp.asarray(lengths), alpha)),
                             ((5.0 + lengths) / 6.0) ** alpha, rtol=1e-6)
  assert float(decoding.length_penalty(jnp.float32(1.0), alpha)) == pytest.approx(1.0)


def test_generate_rejects_bad_arguments():
  params = biased_params(0, 0.0)
  src = random_src(0, 2)
  with pytest.raises(ValueError, match="max_len"):
    decoding.generate(UNTIED, params, src, max_length=UNTIED.max_len + 1)
  with pytest.raises(ValueError, match="beam_size"):
    decoding.generate(UNTIED, params, src, max_length=4, beam_size=0)


def test_strip_special():
  assert decoding.strip_special([5, 0, 6, EOS_ID, 7, 0]) == [5, 6]
  assert decoding.strip_special(np.array([5, 6, 7])) == [5, 6, 7]
  assert decoding.strip_special([EOS_ID, 5]) == []


@pytest.mark.parametrize("beam_size", [1, 4])
def test_pad_and_bos_are_never_decoded(beam_size):
  """Even a model that prefers PAD and BOS above everything never emits them: they would
  desynchronise the cache from the full decoder and vanish in detokenization."""
  params = init_params(UNTIED, 0)
  bias = params["decoder"]["output_projection"]["bias"]
  bias = bias.at[PAD_ID].set(50.0).at[BOS_ID].set(40.0)
  params = {**params, "decoder": {**params["decoder"], "output_projection": {
      **params["decoder"]["output_projection"], "bias": bias}}}
  out = decoding.generate(UNTIED, params, random_src(0), max_length=MAX_LENGTH,
                          beam_size=beam_size)
  lengths = first_eos_lengths(out)
  for row, n in zip(out, lengths):
    n = n or len(row)  # No EOS: the whole row is output.
    assert (row[:n] != PAD_ID).all() and (row != BOS_ID).all(), row


# ------------------------------------------- without the cache; scanned and fused layouts
@pytest.mark.parametrize("beam_size", [1, 4])
def test_decoding_without_cache_equals_cached(beam_size):
  """Recomputing the decoder over the prefix at every step (the benchmark's baseline) gives
  the same outputs as the KV cache."""
  ended = 0
  for seed, eos_bias in [(1, 0.5), (2, 1.0), (3, 2.0)]:   # varied outputs, some with EOS
    params, src = biased_params(seed, eos_bias), random_src(600 + seed)
    cached = decoding.generate(UNTIED, params, src, max_length=MAX_LENGTH, beam_size=beam_size)
    recomputed = decoding.generate(UNTIED, params, src, max_length=MAX_LENGTH,
                                   beam_size=beam_size, use_cache=False)
    np.testing.assert_array_equal(recomputed, cached, err_msg=f"seed {seed}")
    ended += int((first_eos_lengths(cached) > 0).sum())
    assert len({tuple(row) for row in cached}) > 1        # outputs depend on the source
  assert ended > 0


@pytest.mark.parametrize("beam_size", [1, 4])
def test_scanned_fused_layers_decode_the_same(beam_size):
  """The cache works through nn.scan (a leading layer axis on every cache array, beams
  gathered along the batch axis behind it) and with the fused QKV projection."""
  from transformer_jax.params import fuse_qkv, stack_layers
  cfg = small_config(tie_output=False, num_decoder_layers=2)
  fast = cfg.replace(scan_layers=True, fused_qkv=True)
  base = init_params(cfg, 1)
  bias = base["decoder"]["output_projection"]["bias"].at[EOS_ID].add(1.0).at[PAD_ID].set(-1e4)
  params = {**base, "decoder": {**base["decoder"], "output_projection": {
      **base["decoder"]["output_projection"], "bias": bias}}}
  src = random_src(700)
  expected = decoding.generate(cfg, params, src, max_length=MAX_LENGTH, beam_size=beam_size)
  actual = decoding.generate(fast, fuse_qkv(stack_layers(params)), src, max_length=MAX_LENGTH,
                             beam_size=beam_size)
  np.testing.assert_array_equal(actual, expected)
  assert len({tuple(row) for row in expected}) > 1 and (first_eos_lengths(expected) > 0).any()
