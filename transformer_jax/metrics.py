"""Evaluation metrics (exact match, BLEU, entity F1) and metric writers (metrics.jsonl and
TensorBoard, no TensorFlow)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np
import sacrebleu


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
  """Percentage of predictions equal to their reference (after whitespace normalisation)."""
  if len(predictions) != len(references):
    raise ValueError(f"{len(predictions)} predictions vs {len(references)} references")
  if not references:
    return 0.0
  same = sum(" ".join(p.split()) == " ".join(r.split()) for p, r in zip(predictions, references))
  return 100.0 * same / len(references)


def corpus_bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
  """sacreBLEU corpus BLEU (13a tokenisation, cased) on detokenized text."""
  if len(predictions) != len(references):
    raise ValueError(f"{len(predictions)} predictions vs {len(references)} references")
  return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def _split_tag(label: str) -> tuple[str, str]:
  """"B-PER" -> ("B", "PER"); "O" -> ("O", "")."""
  prefix, _, kind = label.partition("-")
  return (prefix, kind) if kind else (label, "")


def entity_spans(labels: Sequence[str]) -> set[tuple[str, int, int]]:
  """Entities (type, start, end exclusive) in one sentence's BIO tags, by the chunk rules
  of the CoNLL shared task's conlleval script: an entity starts at B-, or at I- after O or
  after another type; it ends before B-, O or another type."""
  spans, start = set(), None
  previous, previous_type = "O", ""
  for i, label in enumerate(list(labels) + ["O"]):
    tag, kind = _split_tag(label)
    ends = (previous in ("B", "I") and tag in ("B", "O")) or (
        previous != "O" and previous_type != kind)
    if start is not None and ends:
      spans.add((previous_type, start, i))
      start = None
    if tag == "B" or (tag == "I" and previous == "O") or (tag != "O" and previous_type != kind):
      start = i
    previous, previous_type = tag, kind
  return spans


def entity_f1(references: Sequence[Sequence[str]],
              predictions: Sequence[Sequence[str]]) -> dict[str, float]:
  """Corpus-level entity precision, recall and F1 in percent (exact span and type), as
  conlleval reports them. Each item is one sentence's tag sequence."""
  if len(references) != len(predictions):
    raise ValueError(f"{len(predictions)} predicted vs {len(references)} reference sentences")
  correct = found = expected = 0
  for number, (gold, guess) in enumerate(zip(references, predictions)):
    if len(gold) != len(guess):
      raise ValueError(f"sentence {number}: {len(guess)} predicted tags for {len(gold)} words")
    gold_spans, guess_spans = entity_spans(gold), entity_spans(guess)
    correct += len(gold_spans & guess_spans)
    found += len(guess_spans)
    expected += len(gold_spans)
  precision = 100.0 * correct / found if found else 0.0
  recall = 100.0 * correct / expected if expected else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return {"precision": precision, "recall": recall, "f1": f1}


class MetricWriter:
  """Appends {"step": N, name: value, ...} lines to W/metrics.jsonl and scalar events to
  W/tensorboard/ (TensorBoard's own event writer; TensorFlow is not needed)."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    self._event, self._summary = Event, Summary
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    self._events = EventFileWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    values = {k: float(np.asarray(v)) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
    self._jsonl.flush()
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                   for k, v in values.items()])
    self._events.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

  def flush(self) -> None:
    if self.enabled:
      self._jsonl.flush()
      self._events.flush()

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._events.close()
