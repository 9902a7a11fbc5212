"""The Task protocol: everything that differs between kinds of task, one class per kind.

The rest of the package calls this interface and never tests a task name: the data layer
(reading files and TFDS examples, tokenizer training, featurizing, packing), the trainer
(model, loss, metrics), predict, export and attention maps.

A task class is used in two stages. Before the data is tokenized, its class methods say how
raw examples become records and which texts train the tokenizers. An instance then binds
the task to its tokenizers, label names and model config:

  task = TaggingTask(model_config, tokenizer=vocab, labels=tags)
  example = task.featurize(record)              # the data pipeline
  sums = task.loss_sums(params, batch, rng, train=True)
  metrics, samples = task.evaluate(params, batches, eval_step, decode)
  outputs = task.predict(params, batch, decode)  # one text line per row

Records are dicts whose keys the task fixes (`record_keys`); batches are dicts of int32
arrays whose keys and shapes `batch_spec` gives. `loss_sums` returns sums over the batch
(loss, nll, correct, weight), so gradient accumulation and multi-device reductions
normalise once, at the end.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.data.pipeline import EvalBatch
from transformer_jax.errors import UserError
from transformer_jax.inputs import check_token_ids
from transformer_jax.options import DataOptions, DecodeOptions
from transformer_jax.serving.line_policy import LinePolicy, kept_tokens

Batch = dict[str, jax.Array]
Example = dict[str, np.ndarray]
Samples = list[tuple[str, str, str]]      # (input, output, reference) as text
EvalStep = Callable[[Any, dict[str, np.ndarray]], dict[str, jax.Array]]


def teacher_forced_sums(eval_step: EvalStep, params: Any,
                        batches: Sequence[EvalBatch]) -> dict[str, float]:
  """Sums of eval_step over batches (padding rows weigh nothing)."""
  totals: dict[str, float] = {}
  for batch in batches:
    for k, v in jax.device_get(eval_step(params, batch.arrays)).items():
      totals[k] = totals.get(k, 0.0) + float(v)
  return totals


def loss_metrics(totals: dict[str, float]) -> dict[str, float]:
  """Mean loss, accuracy and perplexity from summed statistics."""
  weight = max(totals.get("weight", 0.0), 1.0)
  with np.errstate(over="ignore"):   # an untrained model's perplexity may well be inf
    perplexity = float(np.exp(totals.get("nll", 0.0) / weight))
  return {"loss": totals.get("loss", 0.0) / weight,
          "accuracy": totals.get("correct", 0.0) / weight, "perplexity": perplexity}


def ids(values: Iterable[int]) -> np.ndarray:
  return np.asarray(values, np.int32)


def padded_getter(packed: dict[str, np.ndarray], rows: int) -> Callable[[str], np.ndarray]:
  """key -> packed[key] as int32, padded with empty rows to `rows` (a last, partial batch
  keeps the static shape)."""
  def get(key: str) -> np.ndarray:
    x = packed[key].astype(np.int32)
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return get


def check_label_smoothing(value: float) -> None:
  if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise UserError(f"label_smoothing={value!r}: must be in [0, 1)")


class Task(abc.ABC):
  """One kind of task. Subclasses set the class attributes and implement the methods."""

  name: ClassVar[str]                       # the config's `task` value
  record_keys: ClassVar[tuple[str, ...]]    # what a record holds
  sequence_keys: ClassVar[tuple[str, ...]]  # per-token arrays of a featurized example
  # Batch keys holding token ids, and whose vocabulary they index ("source" or "target").
  token_keys: ClassVar[dict[str, str]]
  metric_names: ClassVar[tuple[str, ...]]   # what `evaluate` returns (without "eval/")
  tokenizer_kinds: ClassVar[tuple[str, ...]]  # data.tokenizer values that fit the task
  # Model-group config fields that configure the task's head, not TransformerConfig, with
  # their defaults.
  head_options: ClassVar[dict[str, Any]] = {}
  # Head options that shape parameters a pretraining task's model shares with this one's
  # (init_from takes them from the pretrained model), and whether this is such a task.
  carried_head_options: ClassVar[tuple[str, ...]] = ()
  pretraining: ClassVar[bool] = False
  needs_labels: ClassVar[bool] = False
  # Whether an example can be cut into pieces along its tokens (data.too_long="split"):
  # its sequence features share one token axis.
  can_split: ClassVar[bool] = True
  has_target_text: ClassVar[bool] = False   # a target side with a tokenizer of its own
  # What inference does with a line longer than the model, as training did (serving/
  # line_policy.py): "truncate" it, tag it in overlapping "window"s (a task whose outputs
  # are per token: `predict_scores`), or "refuse" it.
  long_inputs: ClassVar[str] = "refuse"

  def __init__(self, model_config: TransformerConfig, *, tokenizer: Any = None,
               target_tokenizer: Any = None, labels: Sequence[str] | None = None,
               label_smoothing: float = 0.0, head: Mapping[str, Any] | None = None):
    check_label_smoothing(label_smoothing)
    if self.needs_labels and not labels:
      raise UserError(f"a {self.name} task needs label names")
    self.model_config, self.label_smoothing = model_config, label_smoothing
    self.tokenizer, self.target_tokenizer = tokenizer, target_tokenizer or tokenizer
    self.labels = list(labels) if labels is not None else None
    self.head = {**self.head_options, **dict(head or {})}
    self.check_head(self.head, getattr(tokenizer, "kind", None))
    self.model = self.build_model(model_config)

  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    """Raises UserError naming a head option (`model.<name>`) whose value is invalid, or
    that does not fit the tokenizer kind (None: not known yet)."""

  # ------------------------------------------------------------ data (class level)
  @classmethod
  def check_data(cls, data: DataOptions) -> None:
    """Raises UserError naming a `data` field whose value the task cannot read (before
    any data is read; sources.check_data_for_task)."""

  @classmethod
  @abc.abstractmethod
  def local_splits(cls, directory: str, splits: Sequence[str],
                   data: DataOptions) -> tuple[dict[str, Callable[[], Sequence[dict]]],
                                              list[str] | None]:
    """Loaders of the records of each split from files in `directory`, and the label
    names (None if the task has none)."""

  @classmethod
  @abc.abstractmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    """(TFDS example, index) -> record."""

  @classmethod
  def tfds_labels(cls, features: Any, name: str) -> list[str] | None:
    """Label names from a TFDS dataset's feature description."""
    return None

  @classmethod
  @abc.abstractmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str | list[str], str | None]:
    """What a record contributes to training the tokenizers: its input (a text, or a list
    of words where words are the units) and its target text (None without one)."""

  # --------------------------------------------------------------------- records
  @abc.abstractmethod
  def record_from_line(self, line: str) -> dict:
    """A predict input line as a record (its reference fields empty)."""

  @abc.abstractmethod
  def featurize(self, record: dict) -> Example:
    """Record -> one unpadded example: int32 arrays per sequence key (and per-example
    scalars such as a class label)."""

  def is_empty(self, example: Example) -> bool:
    """Nothing to learn from: no input tokens."""
    return len(example[self.sequence_keys[0]]) == 0

  def example_length(self, example: Example) -> int:
    return max(len(example[k]) for k in self.sequence_keys)

  def truncate(self, example: Example, length: int, keep: str = "head") -> Example:
    """The example cut to `length` tokens: its first ones (keep="head"), its last ("tail"),
    or a quarter from the start and the rest from the end ("head_tail": the beginning and
    the conclusion of a long review; Sun et al. 2019, "How to Fine-Tune BERT for Text
    Classification", found it best on IMDB)."""
    return {k: kept_tokens(v, length, keep) if k in self.sequence_keys else v
            for k, v in example.items()}

  def pieces(self, example: Example, length: int) -> list[Example]:
    """The example cut into consecutive pieces of `length` tokens (the last may be
    shorter), each with the example's other features (a class label stays with each)."""
    total = self.example_length(example)
    return [self.window(example, start, length) for start in range(0, total, length)]

  def window(self, example: Example, start: int, length: int) -> Example:
    """Tokens start .. start + length - 1 of the example, with its other features."""
    return {k: v[start:start + length] if k in self.sequence_keys else v
            for k, v in example.items()}

  def line_policy(self, data: DataOptions) -> LinePolicy:
    """What inference does to an input line, as training on `data` did (the default of
    predict's and the server's --too_long; an artifact's manifest keeps it)."""
    return LinePolicy(too_long=self.long_inputs, truncate=data.truncate)

  def packing_lengths(self, length: int, max_per_row: int | None) -> dict[str, int]:
    """Grain's packing `length_struct`: `length` slots per sequence feature."""
    return {k: length for k in self.sequence_keys}

  @abc.abstractmethod
  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Grain's packed features ({k}, {k}_positions, {k}_segment_ids) -> the batch keys of
    `batch_spec`, padded with empty rows to `rows`."""

  @abc.abstractmethod
  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    """The keys, shapes and dtypes of a batch of `rows` rows of `length` tokens, each row
    packing at most `max_per_row` examples."""

  def count_tokens(self, batch: Mapping[str, np.ndarray]) -> int:
    """Non-padding tokens of the batch (host side, for tokens/s)."""
    return int(sum((batch[k] != PAD_ID).sum() for k in self.counted_keys))

  counted_keys: ClassVar[tuple[str, ...]]

  def check_batch(self, batch: Mapping[str, np.ndarray], what: str) -> None:
    """Token ids against the vocabularies and lengths against the model's max_len. Ids from
    the tokenizers are in range by construction; a max_len below the data's lengths is
    caught here, by name."""
    cfg = self.model_config
    sizes = {"source": cfg.vocab_size, "target": cfg.tgt_vocab_size}
    for key, vocab in self.token_keys.items():
      check_token_ids(batch[key], sizes[vocab], cfg.max_len, f"{what}, {key}")

  # ----------------------------------------------------------------------- model
  @abc.abstractmethod
  def build_model(self, model_config: TransformerConfig) -> Any:
    """The Flax module of this task (also used with other attention implementations)."""

  def init_params(self, rng: jax.Array) -> Any:
    """Parameters (boxed with their logical axis names); shapes do not depend on length.
    Initialised through the einsum attention: the attention path does not change the
    parameters, and a fused kernel may not take the dummy's 4 tokens."""
    dummy = jnp.ones((1, 4), jnp.int32)
    return self._einsum_model().init(rng, *[dummy] * self.model_inputs)["params"]

  model_inputs: ClassVar[int] = 1   # token arrays the model's __call__ takes

  @abc.abstractmethod
  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
    ...

  @abc.abstractmethod
  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    ...

  # --------------------------------------------------------------------- serving
  # How the flax-free loader (transformer_jax/serving/lines.py) turns the exported function's
  # output into text: "token_ids" (B, T) detokenized, "class_scores" (B, C) -> a label name,
  # "tag_scores" (B, S, L) log-probabilities -> a tag per token (BIO Viterbi on the host).
  serving_output: ClassVar[str]

  @abc.abstractmethod
  def serving_function(self, decode: DecodeOptions) -> Callable[..., jax.Array]:
    """The pure inference function that `export --format=stablehlo` serializes:
    (params, tokens (B, S) int32, right-padded with PAD[, chars (B, S, serving_word_bytes)])
    -> the `serving_output` array. It must trace with symbolic B and S, and give what
    `predict` gives for a batch of the same padded length."""

  def serving_word_bytes(self) -> int | None:
    """For a model that reads each word's spelling: the bytes per word of the served
    function's `chars` argument (inputs.character_ids of the line's words); else None."""
    return None

  def serving_constants(self, params: Any) -> dict[str, Any]:
    """JSON values the served model's loader needs besides the function's output (e.g. a
    CRF's learned transition scores); the artifact's manifest keeps them."""
    return {}

  def streaming_programs(self, params: Any, rows: Any, length: Any) -> dict[str, Any] | None:
    """For a task whose outputs stream token by token (a language model, tasks/lm.py): the
    programs a served model streams with, for `rows` rows of `length` tokens (symbolic
    dims); None for a task whose outputs do not."""
    return None

  # ------------------------------------------------------------------ evaluation
  @abc.abstractmethod
  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    """Metrics named `metric_names` (without the "eval/" prefix) and samples."""

  @abc.abstractmethod
  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    """One output line per row of `batch` (one example per row): a translation, a label
    name, or space-separated tags."""

  def predict_scores(self, params: Any, batch: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Each row's per-token output scores (its real tokens only), which the windows of a
    long line are stitched from; a task whose long_inputs is "window" defines it."""
    raise NotImplementedError(f"a {self.name} task does not predict in windows")

  def outputs_from_scores(self, params: Any, rows: Sequence[np.ndarray],
                          decode: DecodeOptions) -> list[str]:
    """The output line of each row of `predict_scores` (or of stitched windows)."""
    raise NotImplementedError(f"a {self.name} task does not predict in windows")

  def attention(self, params: Any, text: str, output: str) -> tuple[Any, dict[str, list[str]]]:
    """The attention weights the model sows for one input line `text` whose prediction is
    `output` (its 'intermediates', from the einsum attention path), and the token labels of
    each axis: {"source": [...]}, plus "target" for encoder-decoder tasks. Encoder-only
    tasks attend over the input alone."""
    source_ids = self.tokenizer.encode(text)
    _, state = self._einsum_model().apply({"params": params},
                                          np.asarray([source_ids], np.int32),
                                          mutable=["intermediates"])
    return state["intermediates"], {"source": self._token_labels(self.tokenizer, source_ids)}

  def _token_labels(self, tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([int(i)]) or f"<{int(i)}>" for i in token_ids]

  def _einsum_model(self) -> Any:
    """The same model on the one attention path that returns weights."""
    return self.build_model(self.model_config.replace(attention_impl="einsum"))
