"""TFDS sources through `tfds.data_source`, on `tfds.testing.mock_data` (these machines
cannot download datasets): records of each kind, the wmt14 and imdb configs training a few
steps end to end, misaligned tagging data and unprepared datasets failing clearly."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import conll2003, imdb, wmt14_ende_base
from configs.default import text_data
from transformer_jax import tasks
from transformer_jax.data.readers import DataFormatError
from transformer_jax.data.tfds_source import DatasetNotPreparedError, tfds_corpus
from transformer_jax.options import DataOptions
from transformer_jax.training import loop


def _data(**fields) -> DataOptions:
  return DataOptions.from_dict(text_data(source="tfds", **fields))


def test_records_of_each_kind_from_mock_data():
  with tfds.testing.mock_data(num_examples=7):
    wmt = tfds_corpus(tasks.Seq2SeqTask, _data(name="wmt14_translate/de-en", source_language="en",
                                       target_language="de", test_split="test"))
    pairs = wmt.split("validation")
    assert len(pairs) == 7 and wmt.labels is None
    assert all(isinstance(p["source"], str) and isinstance(p["target"], str) for p in pairs)
    assert pairs[0] != pairs[1]
    sst = tfds_corpus(tasks.ClassificationTask, _data(name="glue/sst2"))
    assert sst.labels == ["negative", "positive"]
    assert {type(r["text"]) for r in sst.split("train")} == {str}
    assert {r["label"] for r in sst.split("train")} <= {0, 1}
    assert tfds_corpus(tasks.ClassificationTask, _data(name="imdb_reviews")).labels == ["neg", "pos"]
    with pytest.raises(IndexError):
      sst.split("train")[7]


def _aligned_conll(self, split, decoders=None, **kwargs):
  """A data source for mock conll2003 whose tokens and tags align (the random mock's do
  not)."""
  rng = np.random.default_rng(0)
  records = []
  for _ in range(12):
    n = int(rng.integers(1, 6))
    records.append({"tokens": np.array([f"w{int(i)}" for i in rng.integers(0, 9, n)]),
                    "ner": rng.integers(0, 9, n), "pos": rng.integers(0, 5, n),
                    "chunks": rng.integers(0, 5, n)})
  return records


def test_tagging_from_tfds_checks_alignment():
  config = _data(name="conll2003", tokenizer="words")
  with tfds.testing.mock_data(num_examples=5):       # Random mock: lengths differ.
    corpus = tfds_corpus(tasks.TaggingTask, config)
    assert corpus.labels[:3] == ["O", "B-PER", "I-PER"]
    with pytest.raises(DataFormatError, match=r"conll2003 example 0: \d+ tokens but \d+ ner"):
      corpus.split("train")[0]
  with tfds.testing.mock_data(as_data_source_fn=_aligned_conll):
    record = tfds_corpus(tasks.TaggingTask, config).split("validation")[3]
    assert len(record["words"]) == len(record["tags"]) > 0


def test_unprepared_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(DatasetNotPreparedError, match=r"tfds build imdb_reviews "
                     r"--file_format=array_record.*tfds_data_dir"):
    tfds_corpus(tasks.ClassificationTask, _data(name="imdb_reviews", tfds_data_dir=str(tmp_path)))
  with pytest.raises(ValueError, match="no such dataset"):
    tfds_corpus(tasks.ClassificationTask, _data(name="no_such_dataset_xyz",
                                        tfds_data_dir=str(tmp_path)))


def _tiny(config, steps: int = 4):
  config.update(dict(num_train_steps=steps, log_every_steps=2, eval_every_steps=steps,
                     checkpoint_every_steps=steps, batch_size=8, grad_accum_steps=1))
  config.data.update(dict(vocab_size=40, max_length=32, eval_max_length=32,
                          tokenizer_max_examples=20, prefetch=0))
  config.model.update(dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                           num_decoder_layers=min(config.model.num_decoder_layers, 1),
                           max_len=64, dropout_rate=0.0))
  config.decode.update(dict(beam_size=2, max_extra_length=4))
  config.eval.update(dict(examples=4, batch_size=8))
  return config


@pytest.mark.parametrize("name", ["wmt14", "imdb", "conll2003"])
def test_configs_train_on_mock_tfds(name, tmp_path):
  """The wmt14 config as written (a TFDS source) runs end to end on mock data; so do the
  imdb and conll2003 configs switched to TFDS as their docstrings say."""
  config = {"wmt14": wmt14_ende_base, "imdb": imdb, "conll2003": conll2003}[name].get_config()
  if name == "conll2003":
    config.data.update(dict(source="tfds", name="conll2003", eval_split="validation"))
  if name == "imdb":
    config.data.update(dict(source="tfds", name="imdb_reviews", eval_split="test"))
    config.average_checkpoints = 0
  config = _tiny(config)
  kwargs = {"as_data_source_fn": _aligned_conll} if name == "conll2003" else {}
  with tfds.testing.mock_data(num_examples=24, **kwargs):
    final = loop.train_and_evaluate(config, str(tmp_path / name))
  metric = {"wmt14": "test/bleu", "imdb": "eval/accuracy", "conll2003": "eval/f1"}[name]
  assert metric in final and np.isfinite(final["eval/loss"])
  assert os.path.exists(tmp_path / name / "vocab.json")
