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
  spans: set[tuple[str, int, int]] = set()
  start: int | None = None
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
  W/tensorboard/ (TensorBoard's own event writer; TensorFlow is not needed).

  With `resume_step` (a run restarted from its checkpoint at that step), what was logged
  after that step is discarded, since those steps are trained again: lines with a larger
  step are dropped from metrics.jsonl, and a SessionLog.START event at that step makes
  TensorBoard purge its later events, as it does for a restarted TensorFlow job."""

  def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None):
    self.enabled = enabled
    if not enabled:
      return
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    self._event, self._summary = Event, Summary
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
      _drop_lines_after(path, resume_step)
    self._jsonl = open(path, "a")
    self._events = EventFileWriter(os.path.join(workdir, "tensorboard"))
    if resume_step is not None:
      self._events.add_event(Event(wall_time=time.time(), step=int(resume_step),
                                   session_log=SessionLog(status=SessionLog.START)))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    values = {k: float(np.asarray(v)) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
    self._jsonl.flush()
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                   for k, v in values.items()])
    self._events.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._events.close()


def _line_step(line: str) -> float:
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):  # A line cut short by a killed process.
    return float("inf")


def _drop_lines_after(path: str, step: int) -> None:
  """Rewrites a metrics.jsonl without the lines whose step is after `step` (atomically: a
  crash leaves the old or the new file, never a partial one)."""
  with open(path) as f:
    lines = f.readlines()
  kept = [line for line in lines if _line_step(line) <= step]
  if len(kept) == len(lines):
    return
  with open(path + ".tmp", "w") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)
