"""Sequence classification with an encoder: pooled encoder states, a linear layer, one
class per example; evaluated by accuracy.

Records: {"text": str, "label": int} (an index into the label names). Batch keys: tokens,
positions, segment_ids, labels (B, K), label_mask (B, K): K label slots per row, slot k
holding the label of packed sequence k + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.data import readers
from transformer_jax.errors import UserError
from transformer_jax.modules.heads import POOLINGS, EncoderClassifier
from transformer_jax.options import DataOptions, DecodeOptions
from transformer_jax.serving.line_policy import LinePolicy
from transformer_jax.tasks.base import (
  Batch,
  EvalBatch,
  EvalStep,
  Example,
  Samples,
  ids,
  loss_metrics,
  teacher_forced_sums,
)
from transformer_jax.tasks.encoder import EncoderTask
from transformer_jax.tasks.losses import cross_entropy_sums

# TFDS feature names (text, label) by dataset family; others use ("text", "label").
_TFDS_FEATURES = {"glue": ("sentence", "label")}
_DEFAULT_TFDS_FEATURES = ("text", "label")


def _tfds_features(name: str) -> tuple[str, str]:
  return _TFDS_FEATURES.get(name.split("/")[0], _DEFAULT_TFDS_FEATURES)


class ClassificationTask(EncoderTask):
  name = "classification"
  record_keys = ("text", "label")
  sequence_keys = ("tokens",)
  metric_names = ("loss", "accuracy")
  tokenizer_kinds = ("sentencepiece", "words")
  head_options = {**EncoderTask.head_options, "pooling": "mean"}  # mean | max | first
  needs_labels = True
  serving_output = "class_scores"
  long_inputs = "truncate"   # to the tokens data.truncate keeps, as training did

  # ---------------------------------------------------------------------- data
  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions):
    """`{split}.tsv`: `sentence<TAB>label` rows; the class names come from data.labels."""
    labels = readers.parse_labels(data.labels)
    if len(labels) < 2:
      raise UserError(f"data.labels={data.labels!r}: give the class names, "
                      "comma-separated, in label-index order (e.g. 'negative,positive')")

    clean = readers.text_cleaner(data.br_tags)

    def loader(split: str) -> Callable[[], Sequence[dict]]:
      return lambda: readers.read_tsv(readers.find_file(directory, f"{split}.tsv"), labels,
                                      clean)
    return {s: loader(s) for s in splits}, labels

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    from transformer_jax.data.tfds_source import feature_text
    text, label = _tfds_features(name)
    clean = readers.text_cleaner(data.br_tags)
    return lambda ex, i: {"text": clean(feature_text(ex[text])), "label": int(ex[label])}

  @classmethod
  def tfds_labels(cls, features: Any, name: str) -> list[str]:
    return list(features[_tfds_features(name)[1]].names)

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str, None]:
    return record["text"], None

  # ------------------------------------------------------------------- records
  def record_from_line(self, line: str) -> dict:
    return {"text": line, "label": 0}

  def line_policy(self, data: DataOptions) -> LinePolicy:
    """Also `<br />` tags as spaces where the training's text had them so (data.br_tags)."""
    return dataclasses.replace(super().line_policy(data), br_tags=data.br_tags)

  def featurize(self, record: dict) -> Example:
    return {"tokens": ids(self.tokenizer.encode(record["text"])),
            **self._word_features(record["text"].split()),
            "label": np.asarray(record["label"], np.int32)}

  def packing_lengths(self, length: int, max_per_row: int | None) -> dict[str, int]:
    if max_per_row is None:   # One label slot per packed example: their number is the bound.
      raise UserError("data.max_segments must be > 0 when packing classification examples")
    return {**super().packing_lengths(length, max_per_row), "label": max_per_row}

  def _targets(self, get: Any) -> dict[str, np.ndarray]:
    return {"labels": get("label"), "label_mask": get("label_segment_ids") > 0}

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    return {**super().batch_spec(rows, length),
            "labels": jax.ShapeDtypeStruct((rows, max_per_row), jnp.int32),
            "label_mask": jax.ShapeDtypeStruct((rows, max_per_row), jnp.bool_)}

  # --------------------------------------------------------------------- model
  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    super().check_head(head, tokenizer_kind)
    if head["pooling"] not in POOLINGS:
      raise UserError(f"model.pooling={head['pooling']!r}: must be one of {POOLINGS}")

  def build_model(self, model_config: TransformerConfig) -> EncoderClassifier:
    return EncoderClassifier(model_config, num_classes=len(self.labels),
                             pooling=self.head["pooling"],
                             char_features=self.head["char_features"])

  def _serving_batch(self, tokens: jax.Array) -> dict[str, jax.Array]:
    # One label slot per row, as in predict's batches (it sets the model's num_segments).
    return {**super()._serving_batch(tokens),
            "labels": jnp.zeros((tokens.shape[0], 1), jnp.int32)}

  def _serving_scores(self, logits: jax.Array) -> jax.Array:
    return logits[:, 0]                      # (B, C): the row's one sequence

  def _extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    return {"num_segments": batch["labels"].shape[1]}

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    return cross_entropy_sums(self.logits(params, batch, rng, train), batch["labels"],
                              self.label_smoothing if train else 0.0,
                              weights=batch["label_mask"].astype(jnp.float32))

  # ---------------------------------------------------------------- evaluation
  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    """The label name of each row's first sequence (one sequence per row)."""
    return [self.labels[i] for i in np.asarray(self._argmax(params, batch))[:, 0]]

  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    metrics = loss_metrics(teacher_forced_sums(eval_step, params, batches))
    del metrics["perplexity"]
    samples = []
    for batch in batches[:1]:
      predicted = self.predict(params, batch.arrays, decode)
      samples += [(r["text"], p, self.labels[r["label"]])
                  for r, p in zip(batch.records, predicted)]
    return metrics, samples
