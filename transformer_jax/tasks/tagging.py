"""Token classification (one tag per word, e.g. named entities in BIO tags) with an
encoder; evaluated by token accuracy and entity precision/recall/F1 (conlleval).

Records: {"words": list[str], "tags": list[int]} (indices into the tag names). Batch keys:
tokens, positions, segment_ids, [chars,] tags (B, T). Predictions are the most likely valid
BIO sequence (`bio.viterbi`), or each word's argmax with decode.bio_constrained=False.

model.crf: a linear-chain CRF output layer (modules/crf.py). Training maximises the
likelihood of the whole tag sequence, among the BIO-valid ones (invalid transitions score
-1e4); decoding is Viterbi over the per-word scores plus the learned transition scores.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import bio
from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.data import readers
from transformer_jax.errors import UserError
from transformer_jax.metrics import entity_f1
from transformer_jax.modules import crf
from transformer_jax.modules.heads import TokenClassifier, crf_scores
from transformer_jax.options import DataOptions, DecodeOptions
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

_TFDS_FEATURES = ("tokens", "ner")   # as in TFDS conll2003
_FORBIDDEN = -1e4   # a CRF transition that BIO forbids (finite: no inf - inf in gradients)


class TaggingTask(EncoderTask):
  name = "tagging"
  record_keys = ("words", "tags")
  sequence_keys = ("tokens", "tags")
  metric_names = ("loss", "accuracy", "precision", "recall", "f1")
  tokenizer_kinds = ("words",)   # tags align to words
  head_options = {**EncoderTask.head_options, "crf": False}
  needs_labels = True
  serving_output = "tag_scores"
  long_inputs = "window"   # a longer sentence: overlapping windows, stitched per word

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._transitions = bio.allowed_transitions(self.labels)
    self._decode_scores = jax.jit(lambda params, batch: self._serving_scores(
        self.logits(params, batch, None, False)))

  # ---------------------------------------------------------------------- data
  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions):
    """`{split}.txt` in CoNLL format; the tag set is data.labels, or the training file's."""
    paths = {s: readers.find_file(directory, f"{s}.txt") for s in splits}
    sentences = {s: readers.read_conll(paths[s]) for s in splits}
    labels = readers.parse_labels(data.labels) or readers.tag_names_of(
        sentences[data.train_split])

    def loader(split: str) -> Callable[[], Sequence[dict]]:
      return lambda: readers.tag_ids(sentences[split], labels, paths[split])
    return {s: loader(s) for s in splits}, labels

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    from transformer_jax.data.tfds_source import feature_text
    words_key, tags_key = _TFDS_FEATURES

    def convert(ex: dict, index: int) -> dict:
      words = [feature_text(w) for w in np.asarray(ex[words_key]).tolist()]
      tags = [int(t) for t in np.asarray(ex[tags_key]).tolist()]
      if len(words) != len(tags):
        raise readers.DataFormatError(
            f"TFDS {name} example {index}: {len(words)} {words_key} but {len(tags)} "
            f"{tags_key} tags; they must align one to one")
      return {"words": words, "tags": tags}
    return convert

  @classmethod
  def tfds_labels(cls, features: Any, name: str) -> list[str]:
    return list(features[_TFDS_FEATURES[1]].feature.names)

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[list[str], None]:
    return record["words"], None

  # ------------------------------------------------------------------- records
  def record_from_line(self, line: str) -> dict:
    words = line.split()
    return {"words": words, "tags": [0] * len(words)}

  def featurize(self, record: dict) -> Example:
    return {"tokens": ids(self.tokenizer.encode_words(record["words"])),
            **self._word_features(record["words"]), "tags": ids(record["tags"])}

  def _targets(self, get: Any) -> dict[str, np.ndarray]:
    return {"tags": get("tags")}

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    return {**super().batch_spec(rows, length, max_per_row),
            "tags": jax.ShapeDtypeStruct((rows, length), jnp.int32)}

  # --------------------------------------------------------------------- model
  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    super().check_head(head, tokenizer_kind)
    if not isinstance(head["crf"], bool):
      raise UserError(f"model.crf={head['crf']!r}: must be True or False")

  def build_model(self, model_config: TransformerConfig) -> TokenClassifier:
    return TokenClassifier(model_config, num_labels=len(self.labels),
                           char_features=self.head["char_features"], crf=self.head["crf"])

  def _serving_scores(self, logits: jax.Array) -> jax.Array:
    """What the tag decode reads, (B, S, L): per-token log-probabilities, or with a CRF its
    emission scores (the loader adds the transition scores, `serving_constants`)."""
    if self.head["crf"]:
      return logits.astype(jnp.float32)
    return jax.nn.log_softmax(logits.astype(jnp.float32), -1)

  def serving_constants(self, params: Any) -> dict[str, Any]:
    if not self.head["crf"]:
      return {}
    start, transitions, end = (np.asarray(s, np.float64).tolist() for s in crf_scores(params))
    return {"crf": {"start": start, "transitions": transitions, "end": end}}

  def _constrained_crf_scores(self, params: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The CRF's scores with BIO's forbidden starts and transitions scoring -1e4."""
    start, transitions, end = crf_scores(params)
    allowed_start, allowed = (jnp.asarray(a) for a in self._transitions)
    return (jnp.where(allowed_start, start, _FORBIDDEN),
            jnp.where(allowed, transitions, _FORBIDDEN), end)

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    logits = self.logits(params, batch, rng, train)
    valid = batch["tokens"] != PAD_ID
    sums = cross_entropy_sums(logits, batch["tags"], self.label_smoothing if train else 0.0,
                              weights=valid.astype(jnp.float32))
    if self.head["crf"]:
      # The loss per token is the sequences' negative log-likelihood over their length, so
      # it normalises by the token count like the cross-entropy; accuracy stays per word.
      nll = crf.negative_log_likelihood(logits, batch["tags"], valid,
                                        batch["positions"] == 0,
                                        *self._constrained_crf_scores(params)).sum()
      sums.update(loss=nll, nll=nll)
    return sums

  # ---------------------------------------------------------------- evaluation
  def predict_scores(self, params: Any, batch: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Each row's (words, L) scores that the tag decode reads (`_serving_scores`)."""
    lengths = (batch["tokens"] != PAD_ID).sum(1)
    scores = np.asarray(self._decode_scores(params, batch))
    return [row[:n] for row, n in zip(scores, lengths)]

  def outputs_from_scores(self, params: Any, rows: Sequence[np.ndarray],
                          decode: DecodeOptions) -> list[str]:
    return [" ".join(tags) for tags in self._tags(params, rows, decode)]

  def _tags(self, params: Any, rows: Sequence[np.ndarray],
            decode: DecodeOptions) -> list[list[str]]:
    """Tag names from each row's per-word scores: the best BIO sequence (with the CRF's
    transition scores), or each word's argmax unless decode.bio_constrained."""
    learned = tuple(np.asarray(s) for s in crf_scores(params)) if self.head["crf"] else None
    best = bio.best_tags(rows, [len(r) for r in rows], self._transitions, crf=learned,
                         constrained=decode.bio_constrained)
    return [[self.labels[i] for i in row] for row in best]

  def predict_tags(self, params: Any, batch: Mapping[str, np.ndarray],
                   decode: DecodeOptions) -> list[list[str]]:
    """Tag names for each row's tokens (one sequence per row)."""
    return self._tags(params, self.predict_scores(params, batch), decode)

  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    return self.outputs_from_scores(params, self.predict_scores(params, batch), decode)

  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    metrics = loss_metrics(teacher_forced_sums(eval_step, params, batches))
    del metrics["perplexity"]
    references, predictions, samples = [], [], []
    for batch in batches:
      for record, tags in zip(batch.records, self.predict_tags(params, batch.arrays, decode)):
        gold = [self.labels[i] for i in record["tags"]]
        tags = tags + ["O"] * (len(gold) - len(tags))  # Words past a truncation: untagged.
        references.append(gold)
        predictions.append(tags)
        samples.append((" ".join(record["words"]), " ".join(tags), " ".join(gold)))
    metrics.update(entity_f1(references, predictions))
    return metrics, samples
