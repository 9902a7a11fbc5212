"""What a model is trained on: how a batch becomes model inputs, a loss, predictions and
evaluation metrics. One class per task kind; the loop is the same for all three.

A task's `loss_sums(params, batch, rng, train)` returns sums over the batch (loss, counts),
so gradient accumulation and multi-device reductions normalise once, at the end.
`evaluate(params, batches, eval_step)` takes static-shape batches with the records of their
rows (`arrays`, `records`) and returns metrics (without the "eval/" prefix) and samples
(input, output, reference) as text. Batch keys are those of transformer_jax.data.pipeline.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import bio, decoding
from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.metrics import corpus_bleu, entity_f1, exact_match
from transformer_jax.modules.models import EncoderClassifier, TokenClassifier, Transformer
from transformer_jax.training.losses import cross_entropy_sums

Batch = dict[str, jax.Array]
KINDS = ("seq2seq", "classification", "tagging")


def _dummy_tokens() -> jax.Array:
  return jnp.ones((1, 4), jnp.int32)  # Parameter shapes do not depend on the length.


def teacher_forced_sums(eval_step: Any, params: Any, batches: Sequence[Any]) -> dict[str, float]:
  """Sums of eval_step over batches (padding rows weigh nothing)."""
  totals: dict[str, float] = {}
  for batch in batches:
    for k, v in jax.device_get(eval_step(params, batch.arrays)).items():
      totals[k] = totals.get(k, 0.0) + float(v)
  return totals


def _loss_metrics(totals: dict[str, float]) -> dict[str, float]:
  weight = max(totals["weight"], 1.0)
  return {"loss": totals["loss"] / weight, "accuracy": totals["correct"] / weight,
          "perplexity": float(np.exp(totals["nll"] / weight))}


class Seq2SeqTask:
  """Encoder-decoder training with teacher forcing. Batch keys: src, tgt_in (BOS + target),
  tgt_out (target + EOS); optional src/tgt_positions and src/tgt_segment_ids for packing.
  Evaluation decodes with beam search (`decode`: beam_size, alpha, max_extra_length,
  eval_examples) and scores detokenized outputs against the raw reference text."""

  kind = "seq2seq"
  _OPTIONAL = ("src_positions", "tgt_positions", "src_segment_ids", "tgt_segment_ids")

  def __init__(self, model: Transformer, label_smoothing: float = 0.0,
               tokenizer: Any = None, decode: Any = None):
    if not 0.0 <= label_smoothing < 1.0:
      raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1)")
    self.model, self.label_smoothing = model, label_smoothing
    self.tokenizer, self.decode = tokenizer, decode

  def init_params(self, rng: jax.Array, batch: Batch | None = None) -> Any:
    src = _dummy_tokens() if batch is None else jnp.asarray(batch["src"])
    tgt = _dummy_tokens() if batch is None else jnp.asarray(batch["tgt_in"])
    return self.model.init(rng, src, tgt)["params"]

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    extra = {k: batch[k] for k in self._OPTIONAL if k in batch}
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["src"], batch["tgt_in"], train=train,
                            rngs=rngs, **extra)

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    logits = self.logits(params, batch, rng, train)
    return cross_entropy_sums(logits, batch["tgt_out"], self.label_smoothing if train else 0.0)

  @staticmethod
  def count_tokens(batch: dict[str, Any]) -> int:
    """Non-padding source + target tokens (host side, for tokens/s)."""
    return int((batch["src"] != PAD_ID).sum() + (batch["tgt_out"] != PAD_ID).sum())

  def predict(self, params: Any, batch: dict[str, np.ndarray], beam_size: int, alpha: float,
              max_extra_length: int) -> list[str]:
    """Detokenized outputs for every row of `batch` (beam_size 1: greedy). The output may be
    `max_extra_length` tokens longer than the batch's target width, within max_len."""
    cfg = self.model.config
    max_length = min(batch["tgt_in"].shape[1] + max_extra_length, cfg.max_len)
    out = decoding.generate(cfg, params, batch["src"], beam_size=beam_size, alpha=alpha,
                            max_length=max_length)
    return [self.tokenizer.decode(decoding.strip_special(row)) for row in out]

  def evaluate(self, params: Any, batches: Sequence[Any],
               eval_step: Any) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
    metrics = _loss_metrics(teacher_forced_sums(eval_step, params, batches))
    limit = self.decode.eval_examples or sum(len(b.records) for b in batches)
    sources, predictions, references = [], [], []
    for batch in batches:
      if len(references) >= limit:
        break
      records = batch.records[:limit - len(references)]
      outputs = self.predict(params, batch.arrays, self.decode.beam_size, self.decode.alpha,
                             self.decode.max_extra_length)
      sources += [r["source"] for r in records]
      references += [r["target"] for r in records]
      predictions += outputs[:len(records)]
    metrics["exact_match"] = exact_match(predictions, references)
    metrics["bleu"] = corpus_bleu(predictions, references)
    return metrics, list(zip(sources, predictions, references))


class _EncoderTask:
  """Shared by the encoder-only tasks: parameters, token counts, jitted argmax."""

  def __init__(self, model: Any, label_smoothing: float, labels: Sequence[str]):
    if not 0.0 <= label_smoothing < 1.0:
      raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1)")
    self.model, self.label_smoothing, self.labels = model, label_smoothing, list(labels)
    self._argmax = jax.jit(lambda params, batch: jnp.argmax(
        self.logits(params, batch, None, False), -1))

  def init_params(self, rng: jax.Array, batch: Batch | None = None) -> Any:
    return self.model.init(rng, _dummy_tokens())["params"]

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"], train=train, rngs=rngs,
                            **self._extra_inputs(batch))

  def _extra_inputs(self, batch: Batch) -> dict[str, Any]:
    return {}

  @staticmethod
  def count_tokens(batch: dict[str, Any]) -> int:
    return int((batch["tokens"] != PAD_ID).sum())


class ClassificationTask(_EncoderTask):
  """Sequence classification with an encoder. Batch keys: tokens, positions, segment_ids,
  labels (B, K), label_mask (B, K): K label slots per row, one per packed sequence."""

  kind = "classification"

  def _extra_inputs(self, batch: Batch) -> dict[str, Any]:
    return {"num_segments": batch["labels"].shape[1]}

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    return cross_entropy_sums(self.logits(params, batch, rng, train), batch["labels"],
                              self.label_smoothing if train else 0.0,
                              weights=batch["label_mask"].astype(jnp.float32))

  def predict(self, params: Any, batch: dict[str, np.ndarray]) -> list[str]:
    """The label name of each row's first sequence (one sequence per row)."""
    return [self.labels[i] for i in np.asarray(self._argmax(params, batch))[:, 0]]

  def evaluate(self, params: Any, batches: Sequence[Any],
               eval_step: Any) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
    metrics = _loss_metrics(teacher_forced_sums(eval_step, params, batches))
    del metrics["perplexity"]
    samples = []
    for batch in batches[:1]:
      predicted = self.predict(params, batch.arrays)
      samples += [(r["text"], p, self.labels[r["label"]])
                  for r, p in zip(batch.records, predicted)]
    return metrics, samples


class TaggingTask(_EncoderTask):
  """Token classification (one tag per word). Batch keys: tokens, positions, segment_ids,
  tags (B, T). Evaluation adds entity precision/recall/F1 (conlleval) over the tag names."""

  kind = "tagging"

  def __init__(self, model: Any, label_smoothing: float, labels: Sequence[str],
               bio_constrained: bool = True):
    super().__init__(model, label_smoothing, labels)
    self.bio_constrained = bio_constrained
    self._transitions = bio.allowed_transitions(self.labels)
    self._log_probs = jax.jit(lambda params, batch: jax.nn.log_softmax(
        self.logits(params, batch, None, False).astype(jnp.float32), -1))

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    return cross_entropy_sums(self.logits(params, batch, rng, train), batch["tags"],
                              self.label_smoothing if train else 0.0,
                              weights=(batch["tokens"] != PAD_ID).astype(jnp.float32))

  def predict(self, params: Any, batch: dict[str, np.ndarray]) -> list[list[str]]:
    """Tag names for each row's tokens (one sequence per row): the most likely valid BIO
    sequence (`bio.viterbi`), or with bio_constrained=False each word's argmax."""
    lengths = (batch["tokens"] != PAD_ID).sum(1)
    if self.bio_constrained:
      log_probs = np.asarray(self._log_probs(params, batch))
      ids = [bio.viterbi(row[:n], *self._transitions) for row, n in zip(log_probs, lengths)]
    else:
      ids = np.asarray(self._argmax(params, batch))
    return [[self.labels[i] for i in row[:n]] for row, n in zip(ids, lengths)]

  def evaluate(self, params: Any, batches: Sequence[Any],
               eval_step: Any) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
    metrics = _loss_metrics(teacher_forced_sums(eval_step, params, batches))
    del metrics["perplexity"]
    references, predictions, samples = [], [], []
    for batch in batches:
      for record, tags in zip(batch.records, self.predict(params, batch.arrays)):
        gold = [self.labels[i] for i in record["tags"]]
        tags = tags + ["O"] * (len(gold) - len(tags))  # Words past a truncation: untagged.
        references.append(gold)
        predictions.append(tags)
        samples.append((" ".join(record["words"]), " ".join(tags), " ".join(gold)))
    metrics.update(entity_f1(references, predictions))
    return metrics, samples


def make_model(kind: str, model_cfg: TransformerConfig, num_labels: int | None = None,
               pooling: str = "mean") -> Any:
  if kind == "seq2seq":
    return Transformer(model_cfg)
  if kind == "classification":
    return EncoderClassifier(model_cfg, num_classes=num_labels, pooling=pooling)
  if kind == "tagging":
    return TokenClassifier(model_cfg, num_labels=num_labels)
  raise ValueError(f"task={kind!r}: must be one of {KINDS}")


def make_task(kind: str, model_cfg: TransformerConfig, *, label_smoothing: float = 0.0,
              labels: Sequence[str] | None = None, tokenizer: Any = None, decode: Any = None,
              pooling: str = "mean") -> Seq2SeqTask | ClassificationTask | TaggingTask:
  """The task of `kind` with its model."""
  model = make_model(kind, model_cfg, len(labels) if labels else None, pooling)
  if kind == "seq2seq":
    return Seq2SeqTask(model, label_smoothing, tokenizer, decode)
  if kind == "classification":
    return ClassificationTask(model, label_smoothing, labels)
  return TaggingTask(model, label_smoothing, labels,
                     bio_constrained=bool((decode or {}).get("bio_constrained", True)))
