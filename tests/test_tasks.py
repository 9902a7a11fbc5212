"""Tasks on packed data: packing never lets one example see another (packed and unpacked
batches give the same per-example loss and outputs, for all three task kinds), entity F1
with conlleval's semantics, and train.py's loop on local files of each kind (training on
packed batches, metrics, resume, predict)."""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax
import pytest
from conftest import featurizing_task, tiny_config
from test_data import DIGITS, digit_records, seq2seq_iterator

from transformer_jax import tasks
from transformer_jax.data import pipeline
from transformer_jax.metrics import entity_f1, entity_spans

jax.config.update("jax_default_matmul_precision", "highest")


@functools.lru_cache(maxsize=None)
def _task_and_params(kind: str):
  cfg = tiny_config(vocab_size=DIGITS.vocab_size, max_len=32,
                    num_decoder_layers=1 if kind == "seq2seq" else 0)
  task = tasks.task_class(kind)(cfg, labels=["a", "b", "c"])
  params = jax.jit(task.init_params)(jax.random.PRNGKey(1))
  return task, params


def _logits(kind: str, batch: dict) -> np.ndarray:
  task, params = _task_and_params(kind)
  return np.asarray(jax.jit(lambda p, b: task.logits(p, b, None, False))(params, batch))


def _segments(segment_ids: np.ndarray):
  """(row, segment id, boolean mask) for every packed sequence of a batch."""
  for row, ids in enumerate(segment_ids):
    for segment in range(1, ids.max() + 1):
      yield row, segment, ids == segment


def _rows_of(kind: str, records: list[dict], length: int) -> dict:
  """Each record alone in its own row (the unpacked reference)."""
  batches, _ = pipeline.eval_batches(records, featurizing_task(kind, DIGITS),
                                     batch_size=len(records),
                                     max_length=length)
  (batch,) = batches
  return batch.arrays


def test_packed_and_unpacked_seq2seq_give_the_same_per_example_loss():
  records = digit_records(14)
  packed = next(seq2seq_iterator(records, batch_size=4, max_length=24))
  assert packed["src_segment_ids"].max() >= 3                  # Several pairs in a row.
  unpacked = _rows_of("seq2seq", records, 16)
  by_source = {tuple(r[r != 0]): i for i, r in enumerate(unpacked["src"])}

  def token_losses(batch):
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        _logits("seq2seq", batch), batch["tgt_out"]))
  packed_losses, single_losses = token_losses(packed), token_losses(unpacked)
  compared = 0
  for row, segment, target in _segments(packed["tgt_segment_ids"]):
    source = packed["src"][row][packed["src_segment_ids"][row] == segment]
    single = by_source[tuple(source)]
    np.testing.assert_allclose(packed_losses[row][target],
                               single_losses[single][unpacked["tgt_out"][single] != 0],
                               rtol=1e-5, atol=1e-6)
    compared += 1
  assert compared >= 6
  # Control: without the segment ids, the packed pairs see each other and the loss changes.
  leaky = dict(packed, src_segment_ids=(packed["src"] != 0).astype(np.int32),
               tgt_segment_ids=(packed["tgt_in"] != 0).astype(np.int32))
  assert np.abs(token_losses(leaky) - packed_losses).max() > 1e-3


def _encoder_records(kind: str, count: int) -> list[dict]:
  rng = np.random.default_rng(5)
  records = []
  for _ in range(count):
    words = [str(d) for d in rng.integers(0, 10, rng.integers(1, 7))]
    if kind == "classification":
      records.append({"text": " ".join(words), "label": int(rng.integers(0, 3))})
    else:
      records.append({"words": words, "tags": [int(t) for t in rng.integers(0, 3, len(words))]})
  return records


class _DigitWords:
  """DIGITS as a word vocabulary (encode_words) for the tagging featurizer."""
  vocab_size = DIGITS.vocab_size
  encode_words = staticmethod(lambda words: DIGITS.encode(" ".join(words)))


@pytest.mark.parametrize("kind", ["classification", "tagging"])
def test_packed_and_unpacked_encoder_tasks_give_the_same_outputs(kind):
  records = _encoder_records(kind, 12)
  featurizer = featurizing_task(kind, DIGITS if kind == "classification" else _DigitWords)
  packed = next(pipeline.train_iterator(records, featurizer, batch_size=3, max_length=16,
                                        seed=0, max_segments=6, prefetch=0))
  assert packed["segment_ids"].max() >= 3
  batches, _ = pipeline.eval_batches(records, featurizer, batch_size=12, max_length=16)
  unpacked = batches[0].arrays
  by_tokens = {tuple(r[r != 0]): i for i, r in enumerate(unpacked["tokens"])}
  packed_out, single_out = _logits(kind, packed), _logits(kind, unpacked)
  task, params = _task_and_params(kind)
  for row, segment, members in _segments(packed["segment_ids"]):
    single = by_tokens[tuple(packed["tokens"][row][members])]
    if kind == "classification":   # Slot k of a row is segment k + 1.
      assert packed["label_mask"][row, segment - 1]
      assert packed["labels"][row, segment - 1] == unpacked["labels"][single, 0]
      np.testing.assert_allclose(packed_out[row, segment - 1], single_out[single, 0],
                                 rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(packed["tags"][row][members],
                                    unpacked["tags"][single][unpacked["tokens"][single] != 0])
      np.testing.assert_allclose(packed_out[row][members],
                                 single_out[single][unpacked["tokens"][single] != 0],
                                 rtol=1e-5, atol=1e-5)
  # The summed loss over the same examples agrees too (padding slots weigh nothing).
  one_epoch = list(pipeline.train_iterator(records, featurizer, batch_size=3, max_length=16,
                                           seed=0, max_segments=6, prefetch=0, num_epochs=1))
  sums = lambda b: jax.device_get(task.loss_sums(params, b, None, False))
  packed_total = sum(sums(b)["loss"] for b in one_epoch)
  assert sum(sums(b)["weight"] for b in one_epoch) == sums(unpacked)["weight"]
  np.testing.assert_allclose(packed_total, sums(unpacked)["loss"], rtol=1e-5)


# -------------------------------------------------------------------------- entity F1
def test_entity_spans_follow_conlleval_chunk_rules():
  assert entity_spans(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 2), ("LOC", 3, 4)}
  assert entity_spans(["O", "I-PER", "I-PER"]) == {("PER", 1, 3)}          # I- after O starts.
  assert entity_spans(["B-PER", "I-LOC"]) == {("PER", 0, 1), ("LOC", 1, 2)}  # Type change.
  assert entity_spans(["B-PER", "B-PER"]) == {("PER", 0, 1), ("PER", 1, 2)}
  assert entity_spans(["I-ORG", "B-ORG", "I-ORG"]) == {("ORG", 0, 1), ("ORG", 1, 3)}
  assert entity_spans(["O", "O"]) == set()


def test_entity_f1_hand_computed():
  gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
  # Sentence 1: PER right, LOC typed as ORG. Sentence 2: ORG right, MISC span too short,
  # and an extra PER. Gold 4 entities, predicted 5, correct 2.
  pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "B-PER", "B-MISC", "O"]]
  scores = entity_f1(gold, pred)
  assert scores["precision"] == pytest.approx(40.0)
  assert scores["recall"] == pytest.approx(50.0)
  assert scores["f1"] == pytest.approx(2 * 40 * 50 / 90)
  assert entity_f1(gold, gold) == {"precision": 100.0, "recall": 100.0, "f1": 100.0}
  assert entity_f1([["O"]], [["O"]])["f1"] == 0.0
  with pytest.raises(ValueError, match="sentence 1: 3 predicted tags for 4 words"):
    entity_f1(gold, [pred[0], pred[1][:3]])


# ------------------------------------------------------------------- train.py on files
from test_data import write  # noqa: E402

from configs import multi30k  # noqa: E402
from transformer_jax.predict import Predictor  # noqa: E402
from transformer_jax.training import loop  # noqa: E402

NUMBERS = {"null": "zero", "eins": "one", "zwei": "two", "drei": "three", "vier": "four",
           "fünf": "five", "sechs": "six", "sieben": "seven", "acht": "eight", "neun": "nine"}


def _number_corpus(folder) -> str:
  """German number words -> English ones: train/val/test files, val gzipped."""
  folder.mkdir()
  rng = np.random.default_rng(0)
  for split, count in (("train", 300), ("val", 24), ("test", 16)):
    words = [list(rng.choice(list(NUMBERS), rng.integers(1, 6))) for _ in range(count)]
    gz = split == "val"
    write(folder / f"{split}.de", [" ".join(w) for w in words], gz)
    write(folder / f"{split}.en", [" ".join(NUMBERS[x] for x in w).capitalize() + "."
                                   for w in words], gz)
  return str(folder)


def _tiny_seq2seq_config(data_dir: str, steps: int):
  config = multi30k.get_config()
  config.update(dict(num_train_steps=steps, log_every_steps=5, eval_every_steps=100,
                     checkpoint_every_steps=5, batch_size=8, keep_checkpoints=2,
                     average_checkpoints=0))
  config.data.update(dict(dir=data_dir, eval_split="val", test_split="test", vocab_size=60,
                          max_length=24, eval_max_length=32, prefetch=1))
  config.model.update(dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                           num_decoder_layers=1, dropout_rate=0.1, max_len=64))
  config.optimizer.update(dict(schedule="rsqrt", learning_rate=3e-3, warmup_steps=5))
  config.decode.update(dict(beam_size=2, max_extra_length=8))
  config.eval.update(dict(examples=8, batch_size=16))
  return config


def _lines(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_seq2seq_on_parallel_files_trains_packed_resumes_and_predicts(tmp_path):
  data_dir = _number_corpus(tmp_path / "numbers")
  straight = str(tmp_path / "straight")
  final = loop.train_and_evaluate(_tiny_seq2seq_config(data_dir, 20), straight)
  lines = _lines(straight)
  train = [l for l in lines if "train/loss" in l]
  assert [l["step"] for l in train] == [5, 10, 15, 20]
  assert train[-1]["train/loss"] < train[0]["train/loss"]
  assert train[-1]["data/examples"] > 20 * 8                   # Several pairs per row.
  assert {"eval/bleu", "eval/loss", "test/bleu", "test/exact_match"} <= set(final)
  assert os.path.exists(os.path.join(straight, "vocab.model"))

  # Stopped at 10 and resumed: the data position continues, so the run equals the straight one.
  resumed = str(tmp_path / "resumed")
  loop.train_and_evaluate(_tiny_seq2seq_config(data_dir, 10), resumed)
  again = loop.train_and_evaluate(_tiny_seq2seq_config(data_dir, 20), resumed)
  strip = lambda ls: [{k: v for k, v in l.items() if not k.startswith("perf/")}
                      for l in ls if l["step"] > 10]
  for a, b in zip(strip(_lines(resumed)), strip(lines), strict=True):
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
  assert again == pytest.approx(final, rel=1e-5, abs=1e-6)

  predictor = Predictor(straight)
  beam2 = predictor.decode_options(beam_size=2)
  outputs = predictor.predict_lines(["eins zwei", "", "neun acht sieben"], beam2)
  assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
  assert predictor.predict_lines(["eins zwei"], beam2) == outputs[:1]  # Batch-invariant.


from configs import conll2003, sst2  # noqa: E402


def _shrink(config, steps: int, **data):
  config.update(dict(num_train_steps=steps, log_every_steps=steps // 2,
                     eval_every_steps=steps, checkpoint_every_steps=steps, batch_size=8,
                     average_checkpoints=0))
  config.data.update(dict(prefetch=1, max_length=32, eval_max_length=32, **data))
  config.model.update(dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                           dropout_rate=0.0, attention_dropout_rate=0.0, max_len=32))
  config.optimizer.update(dict(learning_rate=1e-2, warmup_steps=2))
  config.decode.update(dict(batch_size=16))
  return config


def sentiment_corpus(folder) -> None:
  """train.tsv.gz and dev.tsv: one word (dull/bad or fine/good) decides the label."""
  rng = np.random.default_rng(0)
  for split, count in (("train", 200), ("dev", 30)):
    lines = ["sentence\tlabel"]
    for _ in range(count):
      label = int(rng.integers(0, 2))
      words = list(rng.choice(["a", "film", "the", "plot", "is"], 3)) + [
          ["dull", "bad"][rng.integers(0, 2)] if label == 0 else ["fine", "good"][rng.integers(0, 2)]]
      lines.append(" ".join(rng.permutation(words)) + " \t" + str(label))
    write(folder / f"{split}.tsv", lines, gz=split == "train")


def entity_corpus(folder) -> None:
  """train.txt and dev.txt.gz in CoNLL format: "<name> visited <place> ." sentences."""
  rng = np.random.default_rng(1)
  names, places = ["Smith", "Jones", "Brown"], ["Paris", "Rome", "Oslo"]
  for split, count in (("train", 150), ("dev", 20)):
    lines = []
    for _ in range(count):
      lines += [f"{rng.choice(names)} NNP B-PER", "visited VBD O",
                f"{rng.choice(places)} NNP B-LOC", ". . O", ""]
    write(folder / f"{split}.txt", lines, gz=split == "dev")


def test_classification_on_tsv_files_trains_and_predicts(tmp_path):
  sentiment_corpus(tmp_path)
  workdir = str(tmp_path / "run")
  final = loop.train_and_evaluate(_shrink(sst2.get_config(), 40, dir=str(tmp_path)), workdir)
  assert set(final) == {"eval/loss", "eval/accuracy"}
  assert final["eval/accuracy"] >= 0.9                 # One word decides: learnt quickly.
  train = [l for l in _lines(workdir) if "train/loss" in l]
  assert train[-1]["train/loss"] < train[0]["train/loss"]
  with open(os.path.join(workdir, "labels.json")) as f:
    assert json.load(f) == {"labels": ["negative", "positive"]}
  predictor = Predictor(workdir)
  assert predictor.predict_lines(["the film is good", "a dull plot", ""])[:2] == [
      "positive", "negative"]


def test_averaging_the_last_checkpoints_gives_the_final_model_and_metrics(tmp_path):
  """config.average_checkpoints: the mean of the newest N checkpoints is exported, its
  evaluation is the run's final one, --eval_only on the export agrees, predict serves it."""
  sentiment_corpus(tmp_path)
  workdir = str(tmp_path / "run")
  config = _shrink(sst2.get_config(), 30, dir=str(tmp_path))
  config.update(dict(checkpoint_every_steps=10, keep_checkpoints=3, average_checkpoints=3))
  final = loop.train_and_evaluate(config, workdir)
  export = os.path.join(workdir, "exports", "step_30_avg3")
  last = _lines(workdir)[-1]
  assert last["step"] == 30 and last["eval/averaged_checkpoints"] == 3
  assert last["eval/accuracy"] == final["eval/accuracy"]
  assert loop.evaluate_saved(config, workdir, export) == pytest.approx(
      {k: v for k, v in final.items()}, rel=1e-6)
  with open(os.path.join(export, "manifest", "metadata")) as f:
    assert json.load(f)["averaged_steps"] == [10, 20, 30]
  assert os.path.samefile(Predictor(workdir).path, export)


@pytest.mark.parametrize("word_options", [
    {"crf": False, "char_features": 0, "word_dropout": 0.0},
    {"crf": True, "char_features": 16, "char_max_length": 8, "word_dropout": 0.1}],
    ids=["softmax", "crf_chars_word_dropout"])
def test_tagging_on_conll_files_trains_predicts_and_scores_entities(tmp_path, word_options):
  entity_corpus(tmp_path)
  workdir = str(tmp_path / "run")
  config = _shrink(conll2003.get_config(), 40, dir=str(tmp_path))
  config.model.update(word_options)
  final = loop.train_and_evaluate(config, workdir)
  assert {"eval/f1", "eval/precision", "eval/recall", "eval/accuracy"} <= set(final)
  assert final["eval/f1"] >= 90.0
  predictor = Predictor(workdir)
  assert predictor.labels == ["O", "B-LOC", "B-PER"]
  out = predictor.predict_lines(["Jones visited Oslo .", "", "Brown visited"])
  assert out[0] == "B-PER O B-LOC O" and out[1] == "" and len(out[2].split()) == 2

  # The command line gives the same, one line of tags per line of words.
  from test_cli import _run
  infile, outfile = tmp_path / "in.txt", tmp_path / "out.txt"
  infile.write_text("Jones visited Oslo .\n\nBrown visited\n")
  code, output = _run("-m", "transformer_jax.predict", f"--workdir={workdir}",
                      f"--input={infile}", f"--output={outfile}")
  assert code == 0, output
  assert outfile.read_text().split("\n")[:-1] == out
