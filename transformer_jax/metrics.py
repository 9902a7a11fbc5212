"""Evaluation metrics and metric writers (metrics.jsonl and TensorBoard, no TensorFlow)."""

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
