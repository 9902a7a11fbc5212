"""The data layer: tokenizers, the Grain pipeline (packing, sharding, seeded shuffling,
checkpointable iterator state, length limits, eval buckets); the readers: tests/test_readers.py.
All data files are small ones the tests write themselves."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grain
import numpy as np
import pytest
from conftest import featurizing_task

from configs.default import text_data
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.data import pipeline
from transformer_jax.data.corpus import local_corpus
from transformer_jax.data.text_data import TextData
from transformer_jax.data.tokenizer import SentencePieceTokenizer, WordVocab, load_tokenizer
from transformer_jax.data.vocab import SymbolVocab
from transformer_jax.options import DataOptions
from transformer_jax.tasks import Seq2SeqTask

DIGITS = SymbolVocab([str(d) for d in range(10)])


def write(path, lines, gz: bool = False) -> str:
  data = "".join(line + "\n" for line in lines).encode("utf-8")
  if gz:
    path = str(path) + ".gz"
    with gzip.open(path, "wb") as f:
      f.write(data)
  else:
    with open(path, "wb") as f:
      f.write(data)
  return str(path)


def digit_records(count: int, seed: int = 0, max_len: int = 9) -> list[dict]:
  """Distinct seq2seq records over digit symbols: source i -> its reverse."""
  rng = np.random.default_rng(seed)
  records, seen = [], set()
  while len(records) < count:
    source = " ".join(str(d) for d in rng.integers(0, 10, rng.integers(1, max_len + 1)))
    if source not in seen:
      seen.add(source)
      records.append({"source": source, "target": " ".join(source.split()[::-1])})
  return records


def seq2seq_iterator(records, **kwargs) -> pipeline.TrainIterator:
  args = dict(batch_size=4, max_length=16, seed=0, prefetch=0)
  args.update(kwargs)
  return pipeline.train_iterator(records, featurizing_task("seq2seq", DIGITS), **args)


def packed_sources(batches) -> list[tuple[int, ...]]:
  """Every source sequence in packed seq2seq batches, split at segment boundaries, after
  checking that positions restart at 0 in each segment and padding has segment 0."""
  out = []
  for batch in batches:
    for row, segments, positions in zip(batch["src"], batch["src_segment_ids"],
                                        batch["src_positions"]):
      assert (row[segments == 0] == PAD_ID).all() and (row[segments > 0] != PAD_ID).all()
      for segment in range(1, segments.max() + 1):
        members = segments == segment
        np.testing.assert_array_equal(positions[members], np.arange(members.sum()))
        out.append(tuple(row[members]))
  return out


# --------------------------------------------------------------------------- tokenizers
TEXTS = ["a small dog runs on the grass", "two dogs play in the park", "a man rides a bike",
         "the children play football on the grass", "a woman reads a book in the park"] * 20


@pytest.fixture(scope="module")
def spm_tokenizer() -> SentencePieceTokenizer:
  return SentencePieceTokenizer.train(TEXTS, vocab_size=60)


def test_sentencepiece_round_trip_and_fixed_special_ids(spm_tokenizer, tmp_path):
  tok = spm_tokenizer
  assert 4 < tok.vocab_size <= 60
  for text in set(TEXTS) | {"a dog reads"}:
    ids = tok.encode(text)
    assert ids and min(ids) > UNK_ID           # No specials inside text...
    assert tok.decode(ids) == text             # ... and detokenization is exact.
  assert UNK_ID in tok.encode("Zebra")         # Unseen characters map to UNK.
  assert tok.decode([BOS_ID] + tok.encode("a dog") + [EOS_ID, PAD_ID]) == "a dog"
  path = str(tmp_path / "vocab.json")
  tok.save(path)
  assert os.path.exists(tmp_path / "vocab.model")
  loaded = load_tokenizer(path)
  assert loaded.model_proto == tok.model_proto
  assert all(loaded.encode(t) == tok.encode(t) for t in TEXTS)


def test_word_vocab_shapes_digits_and_save(tmp_path):
  vocab = WordVocab.build([["EU", "rejects", "German", "call"], ["EU", "in", "1996"],
                           ["EU", "rejects", "in", "1997"]], min_count=2)
  assert vocab.words == ["EU", "0000", "in", "rejects"]   # 1996 and 1997 share "0000".
  ids = vocab.encode("EU rejects Bonn IBM tiny 2001 --")
  assert vocab.decode(ids) == "EU rejects <unk:Xx> <unk:X> <unk:x> 0000 <unk:.>"
  assert len(ids) == 7 and min(ids) > UNK_ID
  vocab.save(str(tmp_path / "vocab.json"))
  loaded = load_tokenizer(str(tmp_path / "vocab.json"))
  assert loaded.encode("EU rejects Bonn 2001") == vocab.encode("EU rejects Bonn 2001")
  with pytest.raises(ValueError, match="unknown tokenizer kind"):
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "bpe"}))
    load_tokenizer(str(tmp_path / "bad.json"))


def _multi30k_like(folder, pairs) -> None:
  folder.mkdir(exist_ok=True)
  for split in ("train", "val"):
    write(folder / f"{split}.de", [p[0] for p in pairs], gz=True)
    write(folder / f"{split}.en", [p[1] for p in pairs])


def test_tokenizer_is_trained_once_and_reused_from_the_workdir(tmp_path):
  """A second run on the same workdir loads the saved tokenizer, even if the data changed
  (a resumed run and predict must see the ids the model was trained with)."""
  config = DataOptions.from_dict(text_data(
      dir=str(tmp_path / "a"), source_language="de", target_language="en", eval_split="val",
      vocab_size=80))
  _multi30k_like(tmp_path / "a", [(t.upper(), t) for t in TEXTS])
  _multi30k_like(tmp_path / "b", [("xyz " * 5, "qqq " * 3)] * 50)
  workdir = str(tmp_path / "work")
  first = TextData(Seq2SeqTask, local_corpus(Seq2SeqTask, config), config, 0, workdir)
  assert "trained" in first.summary and os.path.exists(os.path.join(workdir, "vocab.json"))
  config = dataclasses.replace(config, dir=str(tmp_path / "b"))
  second = TextData(Seq2SeqTask, local_corpus(Seq2SeqTask, config), config, 0, workdir)
  assert "loaded" in second.summary
  assert second.tokenizer.model_proto == first.tokenizer.model_proto
  fresh = TextData(Seq2SeqTask, local_corpus(Seq2SeqTask, config), config, 0, str(tmp_path / "other"))
  assert fresh.tokenizer.model_proto != first.tokenizer.model_proto   # Control.


# ---------------------------------------------------------------------------- pipeline
def test_same_seed_same_batches_other_seed_other_batches():
  records = digit_records(60)
  take = lambda seed: [next(it) for it in [seq2seq_iterator(records, seed=seed)]
                       for _ in range(6)]
  a, b, c = take(3), take(3), take(4)
  for x, y in zip(a, b):
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])
  assert any(not np.array_equal(x["src"], z["src"]) for x, z in zip(a, c))


def test_iterator_state_round_trip_resumes_the_same_batches():
  """get_state after k batches (JSON), a fresh iterator set to it, continues with exactly the
  batches the first one yields next, across an epoch boundary and with prefetching."""
  records = digit_records(30)
  first = seq2seq_iterator(records, prefetch=2)
  for _ in range(5):
    next(first)
  state = json.loads(json.dumps(first.get_state()))
  expected = [next(first) for _ in range(12)]
  second = seq2seq_iterator(records, prefetch=2)
  next(second)                                          # Somewhere else first.
  second.set_state(state)
  for want, got in zip(expected, [next(second) for _ in range(12)], strict=True):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  assert second.stats() == first.stats() != {}
  first.close()
  second.close()


def test_one_epoch_packs_every_example_exactly_once_in_static_shapes():
  records = digit_records(50)
  batches = list(seq2seq_iterator(records, batch_size=3, max_length=12, num_epochs=1))
  assert all(b["src"].shape == b["tgt_in"].shape == (3, 12) for b in batches)
  expected = sorted(tuple(DIGITS.encode(r["source"])) for r in records)
  assert sorted(packed_sources(batches)) == expected
  assert len(batches) < len(records) / 3                # Packing put several in a row.
  for batch in batches:   # Target side: same segments; BOS starts, EOS ends each sequence.
    for row in range(3):
      for segment in range(1, batch["tgt_segment_ids"][row].max() + 1):
        members = batch["tgt_segment_ids"][row] == segment
        assert batch["tgt_in"][row][members][0] == BOS_ID
        assert batch["tgt_out"][row][members][-1] == EOS_ID
        assert (batch["src_segment_ids"][row] == segment).any()


def test_two_hosts_take_disjoint_halves_of_every_global_batch():
  """Hosts read the one global order (see tests/test_elastic.py for resuming it elsewhere):
  host i of 2 feeds rows [2i, 2i + 2) of each global batch of 4, so between them they
  pack every example exactly once."""
  records = digit_records(41)
  whole = list(seq2seq_iterator(records, num_epochs=1))
  halves = [list(seq2seq_iterator(records, shard_index=i, shard_count=2, num_epochs=1))
            for i in range(2)]
  for batch, first, second in zip(whole, *halves, strict=True):
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([first[key], second[key]]), batch[key])
  shards = [packed_sources(h) for h in halves]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(tuple(DIGITS.encode(r["source"]))
                                                 for r in records)
  with pytest.raises(ValueError, match="shard 2 of 2"):
    seq2seq_iterator(records, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="batch_size=4 does not split over 3 hosts"):
    seq2seq_iterator(records, shard_index=0, shard_count=3)


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_length_limit_counts_what_it_drops_or_truncates(policy):
  """Counts are exact for the examples read up to the last one packed (the shuffled order is
  Grain's, reproduced here)."""
  records = ([{"source": "1 2 3 4 5 6", "target": "6 5 4 3 2 1"}] * 3 +
             [{"source": "1 2", "target": "2 1"}] * 5 + [{"source": "", "target": "1"}] * 2)
  it = seq2seq_iterator(records, max_length=4, too_long=policy, num_epochs=1)
  sources = packed_sources(list(it))
  assert sorted(sources) == [(5, 6)] * 5 + ([(5, 6, 7, 8)] * 3 if policy == "truncate" else [])
  stats = it.stats()
  order = list(grain.MapDataset.source(records).shuffle(0))
  read, unread = order[:stats["data/examples"]], order[stats["data/examples"]:]
  assert stats["data/too_long"] == sum(len(r["source"].split()) > 4 for r in read) > 0
  assert stats["data/empty"] == sum(r["source"] == "" for r in read)
  # Only examples that pack nothing can follow the last one packed.
  assert all(r["source"] == "" or (policy == "drop" and r["source"] == "1 2 3 4 5 6")
             for r in unread)
  with pytest.raises(ValueError, match="data.too_long"):
    seq2seq_iterator(records, too_long="wrap")


def packed_segments(batches, key: str = "tokens") -> list[tuple[int, ...]]:
  """Every packed sequence of an encoder task's batches, split at segment boundaries."""
  return [tuple(row[segments == s]) for batch in batches
          for row, segments in zip(batch[key], batch["segment_ids"])
          for s in range(1, segments.max() + 1)]


def _has_key(tree, key: str) -> bool:
  if isinstance(tree, dict):
    return key in tree or any(_has_key(v, key) for v in tree.values())
  return isinstance(tree, (list, tuple)) and any(_has_key(v, key) for v in tree)


def test_split_keeps_every_token_in_pieces_and_resumes_mid_example():
  """too_long="split": each text longer than max_length becomes its consecutive pieces, so
  one epoch packs every token once; the iterator state taken between any two batches,
  including ones in the middle of an example's pieces, resumes the same batches."""
  task = featurizing_task("mlm", DIGITS)
  rng = np.random.default_rng(0)
  records = [{"text": " ".join(map(str, rng.integers(0, 10, n)))}
             for n in rng.integers(1, 15, 24)]
  make = lambda: pipeline.train_iterator(records, task, batch_size=2, max_length=4, seed=0,
                                         too_long="split", num_epochs=1, prefetch=0)
  batches, states = [], []
  it = make()
  while True:
    states.append(json.loads(json.dumps(it.get_state())))
    try:
      batches.append(next(it))
    except StopIteration:
      break
  expected = []
  for record in records:
    tokens = task.featurize(record)["tokens"]
    expected += [tuple(tokens[i:i + 4]) for i in range(0, len(tokens), 4)]
  assert sorted(packed_segments(batches)) == sorted(expected)
  long = sum(len(task.featurize(r)["tokens"]) > 4 for r in records)
  assert it.stats()["data/too_long"] == long > 0
  mid_split = [k for k, state in enumerate(states[:-1]) if _has_key(state, "pieces_left")]
  assert mid_split    # the check below covers resuming inside an example's pieces
  for k in range(len(batches)):
    resumed = make()
    resumed.set_state(states[k])
    rest = list(resumed)
    assert len(rest) == len(batches) - k
    for want, got in zip(batches[k:], rest):
      for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_split_is_refused_for_a_task_whose_sides_cannot_be_cut_alike():
  from transformer_jax.data.sources import check_data_for_task
  from transformer_jax.tasks import MaskedLMTask
  data = DataOptions.from_dict(dict(text_data(dir="d"), too_long="split"))
  check_data_for_task(MaskedLMTask, data)
  with pytest.raises(ValueError, match="data.too_long='split'.*seq2seq"):
    check_data_for_task(Seq2SeqTask, data)


def test_eval_buckets_keep_every_example_in_few_static_shapes():
  records = digit_records(70, max_len=40)
  task = featurizing_task("seq2seq", DIGITS)
  batches, counts = pipeline.eval_batches(records, task, batch_size=8, max_length=32)
  assert sorted(r["source"] for b in batches for r in b.records) == sorted(
      r["source"] for r in records)
  shapes = {b.arrays["src"].shape for b in batches}
  assert shapes <= {(8, 16), (8, 32)}
  long = [r for r in records if len(r["source"].split()) + 1 > 32]
  assert counts.too_long == len(long) > 0
  for batch in batches:
    for row, record in enumerate(batch.records):   # One example per row, in record order.
      ids = DIGITS.encode(record["source"])[:batch.arrays["src"].shape[1]]
      np.testing.assert_array_equal(batch.arrays["src"][row, :len(ids)], ids)
      assert (batch.arrays["src_segment_ids"][row] == (batch.arrays["src"][row] != 0)).all()
    assert (batch.arrays["src"][len(batch.records):] == PAD_ID).all()   # Padding rows.


def test_separate_source_and_target_vocabularies(tmp_path):
  config = DataOptions.from_dict(text_data(
      dir=str(tmp_path / "a"), source_language="de", target_language="en", eval_split="val",
      vocab_size=80, shared_vocab=False))
  _multi30k_like(tmp_path / "a", [(t.upper(), t) for t in TEXTS])
  workdir = str(tmp_path / "work")
  data = TextData(Seq2SeqTask, local_corpus(Seq2SeqTask, config), config, 0, workdir)
  assert data.target_tokenizer is not data.tokenizer
  assert os.path.exists(os.path.join(workdir, "target_vocab.json"))
  assert data.tokenizer.pieces("A DOG") != data.target_tokenizer.pieces("A DOG")
  task = featurizing_task("seq2seq", data.tokenizer, target_tokenizer=data.target_tokenizer)
  for batch in data.eval_batches(task, "val", batch_size=4, limit=3):
    for row, record in zip(batch.arrays["tgt_out"], batch.records):
      assert data.target_tokenizer.decode(row) == record["target"]
  reloaded = TextData(Seq2SeqTask, local_corpus(Seq2SeqTask, config), config, 0, workdir)
  assert reloaded.target_tokenizer.model_proto == data.target_tokenizer.model_proto
  assert reloaded.tokenizer.model_proto == data.tokenizer.model_proto
  # The model gets both sizes; one shared embedding table cannot serve two vocabularies.
  from configs import multi30k
  from transformer_jax.training.experiment import model_config
  run = multi30k.get_config()
  sizes = (data.tokenizer.vocab_size, data.target_tokenizer.vocab_size)
  with pytest.raises(ValueError, match="share_embeddings"):
    model_config(run, Seq2SeqTask, *sizes)
  run.model.share_embeddings = False
  cfg, _ = model_config(run, Seq2SeqTask, *sizes)
  assert (cfg.vocab_size, cfg.tgt_vocab_size) == (data.tokenizer.vocab_size,
                                                  data.target_tokenizer.vocab_size)
