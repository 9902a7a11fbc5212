"""Masked-language-model pretraining of an encoder (BERT's objective) on the text of a
classification or tagging data set, without its labels: "self-pretraining" (Krishna et al.,
"Downstream Datasets Make Surprisingly Good Pretraining Corpora", ACL 2023). A classifier
or tagger then starts from it with `init_from` (training/recipe.py runs both stages).

Records: {"text": str}, read through the task that `data.text_of` names (its files in
data.dir, or its TFDS converter), plus the lines of `data.extra_text` in the training split
(IMDB's unlabelled reviews; a file name in data.dir, or a path relative to it or absolute).
Batch keys: tokens, positions, segment_ids[, chars].

Masking happens in the loss, on the device, with the step's random key: each epoch sees new
masks (RoBERTa's dynamic masking); evaluation uses one fixed key, so its figures compare
across steps. Of the real tokens (ids past the specials: never padding), `model.mask_rate`
are chosen; of those, 80% become <mask>, 10% a random token and 10% stay as they are, and
the loss and accuracy count the chosen positions only. `<s>` serves as <mask>: the encoder
tasks never feed it, and every vocabulary has it. A word's character features are hidden
where the word is replaced, so its spelling does not give it away.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import BOS_ID, PAD_ID, TransformerConfig
from transformer_jax.data import readers
from transformer_jax.data.vocab import SPECIALS, strip_special
from transformer_jax.errors import UserError
from transformer_jax.modules.heads import MaskedLanguageModel
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

MASK_ID = BOS_ID
FIRST_MASKABLE = len(SPECIALS)          # ids below are <pad>, <s>, </s>, <unk>
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1     # of the chosen tokens; the rest stay as they are
_EVAL_KEY = 0                           # the one masking key of every evaluation


def mask_tokens(rng: jax.Array, tokens: jax.Array, rate: float,
                vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """BERT's masking of tokens (B, T): (the model's input, the chosen positions whose
  original token the loss asks for, the positions replaced by <mask> or a random token)."""
  choose, action, draw = jax.random.split(rng, 3)
  chosen = jax.random.bernoulli(choose, rate, tokens.shape) & (tokens >= FIRST_MASKABLE)
  roll = jax.random.uniform(action, tokens.shape)
  masked = chosen & (roll < MASK_SHARE)
  randomized = chosen & (roll >= MASK_SHARE) & (roll < MASK_SHARE + RANDOM_SHARE)
  random_ids = jax.random.randint(draw, tokens.shape, FIRST_MASKABLE, vocab_size, tokens.dtype)
  inputs = jnp.where(masked, MASK_ID, jnp.where(randomized, random_ids, tokens))
  return inputs, chosen, masked | randomized


def _record_text(record: dict, text_task: Any) -> str:
  text = text_task.tokenizer_texts(record)[0]
  return " ".join(text) if isinstance(text, list) else text


def _text_task(data: DataOptions) -> Any:
  """The encoder task class whose data holds the text (data.text_of)."""
  from transformer_jax.tasks import TASKS  # the registry imports this module
  encoder_tasks = [name for name, cls in TASKS.items()
                   if issubclass(cls, EncoderTask) and not cls.pretraining]
  if data.text_of not in encoder_tasks:
    raise UserError(f"data.text_of={data.text_of!r}: name the task whose data holds the "
                    f"text to pretrain on, one of {', '.join(encoder_tasks)}")
  return TASKS[data.text_of]


class MaskedLMTask(EncoderTask):
  name = "mlm"
  record_keys = ("text",)
  sequence_keys = ("tokens",)
  metric_names = ("loss", "accuracy", "perplexity")
  tokenizer_kinds = ("sentencepiece", "words")
  head_options = {**EncoderTask.head_options, "mask_rate": 0.15}
  serving_output = "token_ids"
  pretraining = True

  # ---------------------------------------------------------------------- data
  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions):
    """The text of the records of data.text_of's files; the training split also holds each
    line of data.extra_text (a file in data.dir, or a path from it), if named."""
    text_task = _text_task(data)
    loaders, _ = text_task.local_splits(directory, splits, data)
    extra = readers.find_file(directory, data.extra_text) if data.extra_text else None

    def loader(split: str) -> Callable[[], Sequence[dict]]:
      def load() -> list[dict]:
        texts = [_record_text(r, text_task) for r in loaders[split]()]
        if extra and split == data.train_split:
          texts += readers.read_text(extra, readers.text_cleaner(data.br_tags))
        return [{"text": t} for t in texts]
      return load
    return {s: loader(s) for s in splits}, None

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    if data.extra_text:
      raise UserError("data.extra_text names a file in data.dir: it is for data.source="
                      "'local'; with TFDS set data.extra_text=''")
    text_task = _text_task(data)
    convert = text_task.tfds_converter(name, data)
    return lambda ex, i: {"text": _record_text(convert(ex, i), text_task)}

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str, None]:
    return record["text"], None

  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    super().check_head(head, tokenizer_kind)
    rate = head["mask_rate"]
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate < 1:
      raise UserError(f"model.mask_rate={rate!r}: must be in (0, 1)")

  # ------------------------------------------------------------------- records
  def record_from_line(self, line: str) -> dict:
    return {"text": line}

  def featurize(self, record: dict) -> Example:
    return {"tokens": ids(self.tokenizer.encode(record["text"])),
            **self._word_features(record["text"].split())}

  def _targets(self, get: Any) -> dict[str, np.ndarray]:
    return {}

  # --------------------------------------------------------------------- model
  def build_model(self, model_config: TransformerConfig) -> MaskedLanguageModel:
    return MaskedLanguageModel(model_config, char_features=self.head["char_features"])

  def masked_batch(self, batch: Batch, rng: jax.Array) -> tuple[Batch, jax.Array]:
    """The batch as the model reads it (masked tokens, hidden characters) and the chosen
    positions."""
    inputs, chosen, replaced = mask_tokens(rng, batch["tokens"], self.head["mask_rate"],
                                           self.model_config.vocab_size)
    masked = {**batch, "tokens": inputs}
    if "chars" in batch:
      masked["chars"] = jnp.where(replaced[..., None], PAD_ID, batch["chars"])
    return masked, chosen

  def predictions_per_row(self, length: int) -> int:
    """K, the positions of a row the output layer scores: twice the expected count of
    chosen ones, which a row of real tokens exceeds with negligible probability (a chosen
    position past the K-th is masked but not scored)."""
    return min(length, max(1, math.ceil(2 * self.head["mask_rate"] * length)))

  def masked_inputs(self, batch: Batch, rng: jax.Array | None,
                    train: bool) -> tuple[Batch, jax.Array, jax.Array | None]:
    """The batch masked with the step's key (evaluation: one fixed key) plus `predict_at`
    (B, K), the positions the output layer scores; their weights (B, K) (1: chosen); and
    the key left for the model (None in evaluation)."""
    if train:
      rng, mask_rng = jax.random.split(rng)
    else:
      mask_rng = jax.random.PRNGKey(_EVAL_KEY)
    masked, chosen = self.masked_batch(batch, mask_rng)
    # The chosen positions first, in order; K of them scored.
    order = jnp.argsort(~chosen, axis=1, stable=True)
    masked["predict_at"] = order[:, :self.predictions_per_row(chosen.shape[1])]
    weights = jnp.take_along_axis(chosen, masked["predict_at"], 1).astype(jnp.float32)
    return masked, weights, rng

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    masked, weights, rng = self.masked_inputs(batch, rng, train)
    return cross_entropy_sums(self.logits(params, masked, rng, train),
                              jnp.take_along_axis(batch["tokens"], masked["predict_at"], 1),
                              self.label_smoothing if train else 0.0, weights=weights)

  def _extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    return {"predict_at": batch["predict_at"]} if "predict_at" in batch else {}

  def _serving_scores(self, logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, -1).astype(jnp.int32)        # (B, S): the likeliest tokens

  # ---------------------------------------------------------------- evaluation
  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    """Each row's likeliest token at every position, as text (unmasked input: the model's
    reconstruction of the line)."""
    best = np.asarray(self._argmax(params, batch))
    lengths = (np.asarray(batch["tokens"]) != PAD_ID).sum(1)
    return [self.tokenizer.decode(strip_special(row[:n])) for row, n in zip(best, lengths)]

  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    """Loss, accuracy and perplexity over the masked positions; no samples."""
    return loss_metrics(teacher_forced_sums(eval_step, params, batches)), []
