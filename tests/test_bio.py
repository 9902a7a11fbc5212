"""BIO-constrained decoding of tag sequences (transformer_jax/bio.py)."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from conftest import tiny_config

from transformer_jax.bio import allowed_transitions, viterbi
from transformer_jax.metrics import entity_spans
from transformer_jax.options import DecodeOptions
from transformer_jax.tasks import TaggingTask

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _valid(tags: list[str]) -> bool:
  previous = "O"
  for tag in tags:
    if tag.startswith("I-") and previous not in (f"B-{tag[2:]}", f"I-{tag[2:]}"):
      return False
    previous = tag
  return True


def _log_probs(seed: int, length: int) -> np.ndarray:
  logits = np.random.default_rng(seed).normal(size=(length, len(LABELS))) * 3.0
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_allowed_transitions_restrict_only_inside_tags():
  start, transition = allowed_transitions(LABELS)
  assert start.tolist() == [True, True, False, True, False]
  assert transition[:, 2].tolist() == [False, True, True, False, False]   # I-PER
  assert transition[:, 4].tolist() == [False, False, False, True, True]   # I-LOC
  assert transition[:, [0, 1, 3]].all()
  start, transition = allowed_transitions(["NOUN", "VERB"])                # not BIO
  assert start.all() and transition.all()


@pytest.mark.parametrize("seed", range(8))
def test_viterbi_is_the_best_valid_sequence(seed):
  log_probs = _log_probs(seed, 5)
  tags = viterbi(log_probs, *allowed_transitions(LABELS))
  assert _valid([LABELS[i] for i in tags])
  best = max((seq for seq in itertools.product(range(len(LABELS)), repeat=5)
              if _valid([LABELS[i] for i in seq])),
             key=lambda seq: log_probs[np.arange(5), seq].sum())
  assert tags.tolist() == list(best)


def test_viterbi_keeps_a_valid_argmax_and_mends_an_invalid_one():
  valid = np.log(np.full((3, 5), 0.01))
  valid[[0, 1, 2], [1, 2, 0]] = np.log(0.96)              # B-PER I-PER O
  assert viterbi(valid, *allowed_transitions(LABELS)).tolist() == [1, 2, 0]
  invalid = valid.copy()
  invalid[1] = np.log([0.01, 0.01, 0.01, 0.01, 0.96])       # B-PER I-LOC: a type switch
  invalid[1, 2] = np.log(0.5)                               # ... I-PER second best
  tags = [LABELS[i] for i in viterbi(invalid, *allowed_transitions(LABELS))]
  assert tags == ["B-PER", "I-PER", "O"]
  assert entity_spans(tags) == {("PER", 0, 2)}


def test_viterbi_handles_empty_and_single_word_sentences():
  start, transition = allowed_transitions(LABELS)
  assert viterbi(np.zeros((0, 5)), start, transition).tolist() == []
  alone = np.log([[0.05, 0.05, 0.8, 0.05, 0.05]])          # I-PER cannot open a sentence
  assert LABELS[viterbi(alone, start, transition)[0]] != "I-PER"


def test_tagging_task_decodes_valid_bio_and_config_can_turn_it_off():
  """An untrained tagger's per-word argmax is often invalid BIO; the task's predictions
  never are, and they keep the argmax wherever the argmax sequence is valid."""
  labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
  cfg = tiny_config(num_decoder_layers=0)
  task = TaggingTask(cfg, labels=labels)
  on, off = DecodeOptions(), DecodeOptions(bio_constrained=False)
  assert on.bio_constrained and not off.bio_constrained
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, cfg.vocab_size, size=(16, 12)).astype(np.int32)
  tokens[:, 9:] = 0                                                   # padding
  batch = {"tokens": tokens, "positions": np.tile(np.arange(12, dtype=np.int32), (16, 1)),
           "segment_ids": (tokens != 0).astype(np.int32)}
  params = task.init_params(jax.random.PRNGKey(3))
  valid_rows = 0
  for fixed, free in zip(task.predict_tags(params, batch, on),
                         task.predict_tags(params, batch, off)):
    assert len(fixed) == len(free) == 9 and _valid(fixed)
    if _valid(free):
      valid_rows += 1
      assert fixed == free
  assert valid_rows < 16            # the property was exercised on invalid argmax rows
