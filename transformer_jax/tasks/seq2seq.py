"""Sequence to sequence (config task="seq2seq": translation, or the synthetic digit jobs):
encoder-decoder training with teacher forcing, evaluation by beam search scored with sacreBLEU
and exact match.

Records: {"source": str, "target": str}. Batch keys: src, tgt_in (BOS + target), tgt_out
(target + EOS), and for packed rows src/tgt_positions and src/tgt_segment_ids.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import decoding
from transformer_jax.config import BOS_ID, EOS_ID, TransformerConfig
from transformer_jax.data import readers
from transformer_jax.metrics import corpus_bleu, exact_match
from transformer_jax.modules.models import Transformer
from transformer_jax.options import DataOptions, DecodeOptions
from transformer_jax.tasks.base import (
  Batch,
  EvalBatch,
  EvalStep,
  Example,
  Samples,
  ids,
  loss_metrics,
  padded_getter,
  teacher_forced_sums,
)
from transformer_jax.tasks.losses import TokenPredictingTask


class Seq2SeqTask(TokenPredictingTask):
  name = "seq2seq"
  record_keys = ("source", "target")
  sequence_keys = ("src", "tgt_in", "tgt_out")
  token_keys = {"src": "source", "tgt_in": "target"}
  counted_keys = ("src", "tgt_out")
  metric_names = ("loss", "accuracy", "perplexity", "exact_match", "bleu")
  tokenizer_kinds = ("sentencepiece",)   # outputs are detokenized text
  model_inputs = 2
  has_target_text = True
  can_split = False   # a source and its target cannot be cut at the same tokens
  serving_output = "token_ids"
  _OPTIONAL = ("src_positions", "tgt_positions", "src_segment_ids", "tgt_segment_ids")
  target_key = "tgt_out"

  # ---------------------------------------------------------------------- data
  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions):
    """`{split}.{source_language}` and `{split}.{target_language}`, line i translating
    line i."""
    src, tgt = data.source_language, data.target_language

    def loader(split: str) -> Callable[[], Sequence[dict]]:
      return lambda: readers.read_parallel(readers.find_file(directory, f"{split}.{src}"),
                                           readers.find_file(directory, f"{split}.{tgt}"))
    return {s: loader(s) for s in splits}, None

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    from transformer_jax.data.tfds_source import feature_text
    src, tgt = data.source_language, data.target_language
    return lambda ex, i: {"source": feature_text(ex[src]), "target": feature_text(ex[tgt])}

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str, str]:
    return record["source"], record["target"]

  # ------------------------------------------------------------------- records
  def record_from_line(self, line: str) -> dict:
    return {"source": line, "target": ""}

  def featurize(self, record: dict) -> Example:
    target = self.target_tokenizer.encode(record["target"])
    return {"src": ids(self.tokenizer.encode(record["source"])),
            "tgt_in": ids([BOS_ID] + target), "tgt_out": ids(target + [EOS_ID])}

  def is_empty(self, example: Example) -> bool:
    """No source tokens, or no target tokens (tgt_out holds only EOS)."""
    return len(example["src"]) == 0 or len(example["tgt_out"]) == 1

  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    get = padded_getter(packed, rows)
    return {"src": get("src"), "src_positions": get("src_positions"),
            "src_segment_ids": get("src_segment_ids"), "tgt_in": get("tgt_in"),
            "tgt_out": get("tgt_out"), "tgt_positions": get("tgt_in_positions"),
            "tgt_segment_ids": get("tgt_in_segment_ids")}

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    keys = ("src", "src_positions", "src_segment_ids", "tgt_in", "tgt_out", "tgt_positions",
            "tgt_segment_ids")
    return {k: jax.ShapeDtypeStruct((rows, length), jnp.int32) for k in keys}

  # --------------------------------------------------------------------- model
  def build_model(self, model_config: TransformerConfig) -> Transformer:
    return Transformer(model_config)

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool,
             return_hidden: bool = False) -> jax.Array:
    extra = {k: batch[k] for k in self._OPTIONAL if k in batch}
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["src"], batch["tgt_in"], train=train,
                            rngs=rngs, return_hidden=return_hidden, **extra)

  # ---------------------------------------------------------------- evaluation
  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    """Detokenized outputs for every row (beam_size 1: greedy). An output may be
    `max_extra_length` tokens longer than the batch's target width, within max_len."""
    out = decoding.generate(self.model_config, params, batch["src"],
                            beam_size=decode.beam_size, alpha=decode.alpha,
                            max_length=self._output_length(batch["tgt_in"].shape[1], decode))
    return [self.target_tokenizer.decode(decoding.strip_special(row)) for row in out]

  def _output_length(self, width: Any, decode: DecodeOptions) -> Any:
    """`max_extra_length` tokens longer than the padded batch width, within max_len
    (`width` may be a symbolic dimension, in an exported function)."""
    return jax.core.min_dim(width + decode.max_extra_length, self.model_config.max_len)

  def serving_function(self, decode: DecodeOptions) -> Callable[[Any, jax.Array], jax.Array]:
    """Encode and search (beam, or greedy for beam_size 1) in one function: (B, S) source
    ids -> (B, T) output ids, T = the output length predict uses for width S."""
    def translate(params: Any, src: jax.Array) -> jax.Array:
      return decoding.search(self.model, params, src, self._output_length(src.shape[1], decode),
                             decode.beam_size, decode.alpha)
    return translate

  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    metrics = loss_metrics(teacher_forced_sums(eval_step, params, batches))
    sources, predictions, references = [], [], []
    for batch in batches:
      outputs = self.predict(params, batch.arrays, decode)
      sources += [r["source"] for r in batch.records]
      references += [r["target"] for r in batch.records]
      predictions += outputs[:len(batch.records)]
    metrics["exact_match"] = exact_match(predictions, references)
    metrics["bleu"] = corpus_bleu(predictions, references)
    return metrics, list(zip(sources, predictions, references))

  def attention(self, params: Any, text: str, output: str) -> tuple[Any, dict[str, list[str]]]:
    """Attention over `text` and the model's own translation `output` of it."""
    source_ids = self.tokenizer.encode(text)
    target_ids = [BOS_ID] + self.target_tokenizer.encode(output)[:self.model_config.max_len - 1]
    labels = {"source": self._token_labels(self.tokenizer, source_ids),
              "target": ["<s>"] + self._token_labels(self.target_tokenizer, target_ids[1:])}
    _, state = self._einsum_model().apply(
        {"params": params}, np.asarray([source_ids], np.int32),
        np.asarray([target_ids], np.int32), mutable=["intermediates"])
    return state["intermediates"], labels
