"""The encoder heads' word options: the linear-chain CRF (modules/crf.py and its Viterbi
decode in bio.py), character features, and word dropout."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from transformer_jax.bio import allowed_transitions, viterbi
from transformer_jax.config import UNK_ID
from transformer_jax.inputs import character_ids
from transformer_jax.modules import crf
from transformer_jax.modules.heads import TokenClassifier
from transformer_jax.tasks import TaggingTask

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _random_crf(seed: int, length: int, labels: int):
  rng = np.random.default_rng(seed)
  emissions, start, transitions, end = (rng.normal(size=s).astype(np.float32) * 2 for s in
                                        ((length, labels), (labels,), (labels, labels),
                                         (labels,)))
  return emissions, start, transitions, end


def _path_score(emissions, tags, start, transitions, end) -> float:
  return float(start[tags[0]] + emissions[np.arange(len(tags)), tags].sum()
               + sum(transitions[a, b] for a, b in zip(tags, tags[1:])) + end[tags[-1]])


def _nll(emissions, tags, start, transitions, end, positions=None) -> np.ndarray:
  """crf.negative_log_likelihood of rows `tags` (B, T) over the same emissions (T, L);
  `positions` mark packed sequences (0: a start) and -1 padding."""
  tags = np.atleast_2d(tags)
  positions = np.arange(tags.shape[1]) if positions is None else np.asarray(positions)
  rows = np.broadcast_to(positions, tags.shape)
  return np.asarray(crf.negative_log_likelihood(
      jnp.broadcast_to(jnp.asarray(emissions), (*tags.shape, emissions.shape[-1])),
      jnp.asarray(tags), jnp.asarray(rows >= 0), jnp.asarray(rows == 0), jnp.asarray(start),
      jnp.asarray(transitions), jnp.asarray(end)))


@pytest.mark.parametrize("seed", range(4))
def test_crf_likelihood_is_the_brute_force_softmax_over_all_tag_sequences(seed):
  length, labels = 4, 3
  emissions, start, transitions, end = _random_crf(seed, length, labels)
  paths = np.array(list(itertools.product(range(labels), repeat=length)))
  scores = np.array([_path_score(emissions, p, start, transitions, end) for p in paths])
  nll = _nll(emissions, paths, start, transitions, end)      # every sequence in one batch
  np.testing.assert_allclose(nll, np.logaddexp.reduce(scores) - scores, rtol=1e-5, atol=1e-4)
  # A distribution: the probabilities of all sequences sum to 1.
  np.testing.assert_allclose(np.exp(-nll).sum(), 1.0, rtol=1e-4)


def test_crf_likelihood_of_a_packed_row_is_the_sum_over_its_sequences_and_ignores_padding():
  emissions, start, transitions, end = _random_crf(5, 7, 3)
  tags = np.array([0, 2, 1, 2, 0, 0, 0])
  packed = _nll(emissions, tags, start, transitions, end, positions=[0, 1, 2, 0, 1, -1, -1])[0]
  first = _nll(emissions[:3], tags[:3], start, transitions, end)[0]
  second = _nll(emissions[3:5], tags[3:5], start, transitions, end)[0]
  np.testing.assert_allclose(packed, first + second, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_crf_viterbi_is_the_best_bio_valid_sequence_under_the_learned_scores(seed):
  length = 5
  emissions, start, transitions, end = _random_crf(seed, length, len(LABELS))
  allowed_start, allowed = allowed_transitions(LABELS)
  best = viterbi(emissions, allowed_start, allowed, scores=(start, transitions, end))

  def valid(path):
    return allowed_start[path[0]] and all(allowed[a, b] for a, b in zip(path, path[1:]))
  expected = max((p for p in itertools.product(range(len(LABELS)), repeat=length) if valid(p)),
                 key=lambda p: _path_score(emissions, p, start, transitions, end))
  assert best.tolist() == list(expected)
  # The transition scores matter: without them the choice differs for some seed.
  if seed == 0:
    assert viterbi(emissions, allowed_start, allowed).tolist() != list(expected)


def test_character_ids_are_utf8_bytes_plus_one_truncated_and_zero_padded():
  out = character_ids(["Oslo", "né", "Kristiansand"], 6)
  assert out.shape == (3, 6) and out.dtype == np.int32
  assert out[0].tolist() == [ord(c) + 1 for c in "Oslo"] + [0, 0]
  assert out[1].tolist() == [ord("n") + 1, 0xC3 + 1, 0xA9 + 1, 0, 0, 0]   # é: two bytes
  assert out[2].tolist() == [ord(c) + 1 for c in "Kristi"]


def _classifier_logits(model, params, tokens, chars, train=False, rngs=None):
  return np.asarray(model.apply({"params": params}, jnp.asarray(tokens),
                                chars=jnp.asarray(chars), train=train, rngs=rngs or {}))


def test_character_features_ignore_byte_and_word_padding_and_read_the_spelling():
  model = TokenClassifier(tiny_config(num_decoder_layers=0), num_labels=5, char_features=8)
  words = ["Smith", "visited", "Oslo"]
  tokens, chars = np.array([[5, 6, 7]], np.int32), character_ids(words, 8)[None]
  params = model.init(jax.random.PRNGKey(0), tokens, chars=chars)["params"]
  base = _classifier_logits(model, params, tokens, chars)
  wide = np.pad(chars, ((0, 0), (0, 0), (0, 5)))                     # more byte padding
  np.testing.assert_allclose(_classifier_logits(model, params, tokens, wide), base,
                             rtol=1e-5, atol=1e-6)
  longer = _classifier_logits(model, params, np.pad(tokens, ((0, 0), (0, 4))),
                              np.pad(chars, ((0, 0), (0, 4), (0, 0))))  # padding words
  np.testing.assert_allclose(longer[:, :3], base, rtol=1e-5, atol=1e-6)
  # Same word ids, another spelling of the last word: its output changes.
  respelled = character_ids(["Smith", "visited", "Bergen"], 8)[None]
  assert not np.allclose(_classifier_logits(model, params, tokens, respelled)[0, 2],
                         base[0, 2], atol=1e-4)


def _tagger(word_dropout: float) -> TaggingTask:
  return TaggingTask(tiny_config(num_decoder_layers=0), labels=LABELS,
                     head={"word_dropout": word_dropout})


def test_word_dropout_turns_words_into_unk_in_training_only():
  tokens = np.array([[5, 6, 7, 8, 9, 0, 0]], np.int32)
  real = tokens != 0
  batch = {"tokens": tokens, "positions": np.where(real, np.arange(7), 0).astype(np.int32),
           "segment_ids": real.astype(np.int32)}
  task = _tagger(0.999)                     # no other dropout in tiny_config
  params = task.init_params(jax.random.PRNGKey(0))
  evaluated = np.asarray(task.logits(params, batch, None, False))
  trained = np.asarray(task.logits(params, batch, jax.random.PRNGKey(1), True))
  all_unk = {**batch, "tokens": np.where(real, UNK_ID, 0).astype(np.int32)}
  np.testing.assert_allclose(trained, np.asarray(task.logits(params, all_unk, None, False)),
                             rtol=1e-5, atol=1e-6)
  assert not np.allclose(trained[real], evaluated[real], atol=1e-4)
  # Without word dropout, training-mode logits are the evaluation ones (no dropout here).
  np.testing.assert_allclose(
      np.asarray(_tagger(0.0).logits(params, batch, jax.random.PRNGKey(1), True)), evaluated,
      rtol=1e-5, atol=1e-6)
