"""Language modelling (config task="lm"): a decoder-only Transformer (models.LanguageModel)
trained to predict each next token of plain text, evaluated by loss per token, perplexity and
bits per character over the whole evaluation file, and continuing prompts (sampling.py).

Files: `{split}.txt` or `{split}.txt.gz` in data.dir, UTF-8 text. Records: {"text": str},
the file's pieces at its blank lines, which join back into the whole file. data.layout:
- "stream" (nanoGPT's): the split as one token stream cut into windows of max_length
  tokens, shuffled each epoch. A window's row is BOS + its tokens but the last, predicting
  its tokens: every token of the file is predicted once, from the tokens of its window
  before it.
- "documents": each paragraph (a record, stripped) is BOS + text -> text + EOS, packed into
  rows with segment ids (a longer one is cut into pieces under data.too_long="split").
- "chat" (supervised fine-tuning of an import's chat model): `{split}.jsonl`, one
  conversation a line (data/chat_data.py), rendered with the model's chat template and
  encoded once before the first step (`prepare_records`); its ids but the last predict its
  ids but the first, packed as documents are, and the targets that are not an assistant's
  tokens are PAD, so the loss, accuracy and bits per character count the assistant's
  tokens only (and every packed example keeps its own).

Batch keys: inputs, targets, positions, segment_ids. A prompt line (predict, serving) is
its text as the model's tokenizer encodes a prompt (`data.tokenizer.prompt_ids`: BOS first
for models trained here and where a Hugging Face tokenizer adds it, as Llama's; none for
GPT-2's), `\\n` in it read as a newline and `\\\\` as a backslash; its output line is the
continuation, written the same way. A prompt longer than the context keeps its last tokens
(after its BOS): the model sees max_len tokens, the continuation's among them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import sampling
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig
from transformer_jax.data import readers
from transformer_jax.data.chat_data import ChatEncoder, assistant_texts, read_chat_jsonl
from transformer_jax.data.pipeline import EvalBatch as PipelineBatch
from transformer_jax.data.tokenizer import prompt_ids, prompt_tail
from transformer_jax.errors import UserError
from transformer_jax.modules.models import LanguageModel
from transformer_jax.options import DataOptions, DecodeOptions
from transformer_jax.serving.line_policy import LinePolicy, escape_line
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

_PIECES = re.compile(r"(?<=\n\n)(?=[^\n])")   # cut after a blank line, before the next text


def read_text_file(path: str) -> str:
  """The whole file (gzipped or not) as UTF-8 text; an invalid byte is refused, naming its
  line."""
  return "".join(line + "\n" for _, line in readers.read_lines(path))


def text_pieces(text: str) -> list[dict]:
  """The text cut after its blank lines, as records that join back into it."""
  return [{"text": piece} for piece in _PIECES.split(text) if piece]


class LanguageModelTask(TokenPredictingTask):
  name = "lm"
  record_keys = ("text",)
  sequence_keys = ("inputs", "targets")
  token_keys = {"inputs": "source"}
  counted_keys = ("inputs",)   # as many as the targets, but a chat's are not all trained
  metric_names = ("loss", "accuracy", "perplexity", "bits_per_character")
  # byte_bpe, hf_tokenizer: an import's (GPT-2's, Llama's), through init_from
  tokenizer_kinds = ("chars", "sentencepiece", "byte_bpe", "hf_tokenizer")
  serving_output = "continuation"
  long_inputs = "truncate"     # a prompt keeps its last tokens (see `truncate`)
  strict_utf8 = True           # a prompt that is not UTF-8 is refused, not guessed at
  target_key = "targets"

  # ---------------------------------------------------------------------- data
  @classmethod
  def check_data(cls, data: DataOptions) -> None:
    """Conversations need the chat template of an import's tokenizer, from local files."""
    if data.layout == "chat" and (data.source, data.tokenizer) != ("local", "hf_tokenizer"):
      raise UserError(f"data.layout='chat' reads local JSONL conversations with an import's "
                      f"chat template: set data.source='local' and data.tokenizer="
                      f"'hf_tokenizer' (not {data.source!r}, {data.tokenizer!r}), with "
                      "init_from the import")

  @classmethod
  def local_splits(cls, directory: str, splits: Sequence[str], data: DataOptions):
    """`{split}.txt[.gz]`: the stream's pieces, or the paragraphs as documents;
    `{split}.jsonl[.gz]`: conversations."""
    def loader(split: str) -> Callable[[], Sequence[dict]]:
      def load() -> list[dict]:
        if data.layout == "chat":
          return read_chat_jsonl(readers.find_file(directory, f"{split}.jsonl"))
        records = text_pieces(read_text_file(readers.find_file(directory, f"{split}.txt")))
        if data.layout == "documents":
          records = [{"text": r["text"].strip()} for r in records if r["text"].strip()]
        return records
      return load
    return {s: loader(s) for s in splits}, None

  @classmethod
  def tfds_converter(cls, name: str, data: DataOptions) -> Callable[[dict, int], dict]:
    """lm1b and other TFDS text sets: the "text" feature, one document per example."""
    from transformer_jax.data.tfds_source import feature_text
    return lambda ex, i: {"text": feature_text(ex["text"])}

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str, None]:
    return record["text"], None

  # ------------------------------------------------------------------- records
  def record_from_line(self, line: str) -> dict:
    """A prompt (its escapes already read by the line policy)."""
    return {"prompt": line}

  @functools.cached_property
  def chat_encoder(self) -> ChatEncoder:
    """The tokenizer's chat template, for conversations (UserError where it has none)."""
    return ChatEncoder(self.tokenizer)

  def prepare_records(self, records: Sequence[dict]) -> Sequence[dict]:
    """Conversations with their ids and weights ("tokens", "weights"): each rendered and
    encoded once, and any the template refuses named, before the first step. Other records
    as they are."""
    if not records or "messages" not in records[0]:
      return records
    encoder = self.chat_encoder
    return [dict(r, **dict(zip(("tokens", "weights"), encoder.encode(r)))) for r in records]

  def featurize(self, record: dict) -> Example:
    """A document: BOS + text -> text + EOS. A conversation: its ids but the last -> its
    ids but the first, PAD where not an assistant's. A prompt: its `prompt_ids` (its
    targets mirror them: a prompt predicts nothing, but a batch has both keys)."""
    if "prompt" in record:
      prompt = ids(prompt_ids(self.tokenizer, record["prompt"]))
      return {"inputs": prompt, "targets": prompt}
    if "messages" in record:
      tokens, weights = ((record["tokens"], record["weights"]) if "tokens" in record
                         else self.chat_encoder.encode(record))
      return {"inputs": ids(tokens[:-1]),
              "targets": ids(np.where(weights[1:] > 0, tokens[1:], PAD_ID))}
    tokens = self.tokenizer.encode(record["text"])
    return {"inputs": ids([BOS_ID] + tokens), "targets": ids(tokens + [EOS_ID])}

  def is_empty(self, example: Example) -> bool:
    """No text, or (a conversation) no assistant token to learn."""
    return len(example["targets"]) <= 1 or not example["targets"].any()

  def truncate(self, example: Example, length: int, keep: str = "tail") -> Example:
    """The last `length` tokens, after the first where the inputs start with BOS (a
    document, a prompt of a model whose texts start with BOS)."""
    inputs = example["inputs"]
    head = int(len(inputs) > 0 and inputs[0] == BOS_ID)
    return {k: prompt_tail(v, length, head) for k, v in example.items()}

  def line_policy(self, data: DataOptions) -> LinePolicy:
    return LinePolicy(too_long="truncate", truncate="tail", escapes=True)

  def model_batch(self, packed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    get = padded_getter(packed, rows)
    return {"inputs": get("inputs"), "targets": get("targets"),
            "positions": get("inputs_positions"), "segment_ids": get("inputs_segment_ids")}

  def batch_spec(self, rows: int, length: int,
                 max_per_row: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((rows, length), jnp.int32)
            for k in ("inputs", "targets", "positions", "segment_ids")}

  def token_stream(self, records: Sequence[dict]) -> np.ndarray:
    """The records' text as one stream of token ids (the "stream" layout)."""
    return np.fromiter((t for r in records for t in self.tokenizer.encode(r["text"])),
                       np.int32)

  @staticmethod
  def stream_window(stream: np.ndarray, index: int, length: int) -> dict[str, np.ndarray]:
    """Window `index` of the stream as a model row of `length` (the last one padded)."""
    window = stream[index * length:(index + 1) * length]
    inputs = np.concatenate([[BOS_ID], window[:-1]]).astype(np.int32)
    pad = length - len(window)
    row = {"inputs": inputs, "targets": window.astype(np.int32),
           "positions": np.arange(len(window), dtype=np.int32),
           "segment_ids": np.ones(len(window), np.int32)}
    return {k: np.pad(v, (0, pad)) for k, v in row.items()}

  # --------------------------------------------------------------------- model
  def build_model(self, model_config: TransformerConfig) -> LanguageModel:
    return LanguageModel(model_config)

  def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool,
             return_hidden: bool = False) -> jax.Array:
    rngs = {"dropout": rng} if train else {}
    return self.model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"], train=train, rngs=rngs,
                            return_hidden=return_hidden)

  # ---------------------------------------------------------------- generation
  def continue_prompts(self, params: Any, prompts: Sequence[np.ndarray],
                       decode: DecodeOptions, end_ids: tuple[int, ...] = ()) -> list[str]:
    """Each prompt's (its `prompt_ids`) continuation as text (sampling.generate), which
    stops at an end id of the model's or of `end_ids` (a chat template's end of turn)."""
    sampling.check_room(self.model_config, decode.max_new_tokens)
    width = max([len(p) for p in prompts] + [1])
    rows = np.zeros((len(prompts), width), np.int32)
    for b, prompt in enumerate(prompts):
      rows[b, :len(prompt)] = prompt
    ends = self.model_config.end_ids + tuple(e for e in end_ids
                                             if e not in self.model_config.end_ids)
    run = sampling.compiled_generate(self.model_config.replace(end_ids=ends),
                                     decode.max_new_tokens)
    out = run(params, rows, decode.temperature, decode.top_k, decode.top_p, decode.seed)
    return [self.tokenizer.decode(t) for t in sampling.continuations(out, ends)]

  def predict(self, params: Any, batch: Mapping[str, np.ndarray],
              decode: DecodeOptions) -> list[str]:
    """Each row's continuation as one line (escaped, as the line policy reads prompts)."""
    prompts = [row[row != PAD_ID] for row in np.asarray(batch["inputs"])]
    return [escape_line(t) for t in self.continue_prompts(params, prompts, decode)]

  def serving_function(self, decode: DecodeOptions) -> Callable[..., jax.Array]:
    """(params, prompt ids (B, S) right-padded, as `prompt_ids` encodes them) ->
    (B, max_new_tokens) continuation ids, drawn with the run's decode options as predict
    draws them."""
    sampling.check_room(self.model_config, decode.max_new_tokens)

    def continue_lines(params: Any, prompts: jax.Array) -> jax.Array:
      return sampling.generate(self.model, params, prompts, decode.max_new_tokens,
                               decode.temperature, decode.top_k, decode.top_p, decode.seed)
    return continue_lines

  def streaming_programs(self, params: Any, rows: Any, length: Any) -> dict[str, Any]:
    """sampling.prefill, sampling.step and sampling.score, as the served model's "prefill",
    "step" and "score": each (function of (params, *inputs), the inputs' shapes) for `rows`
    rows of `length` tokens, with the KV cache as a flat list of arrays ("cache": their
    shapes). A server keeps the cache of its decoding batch between prefill and step
    (serving/slots.py); score reads prompts' log-probabilities without a cache."""
    model = self.model
    row = lambda dtype, *more: jax.ShapeDtypeStruct((rows, *more), dtype)   # noqa: E731
    # temperature, top_k, top_p, logprobs (the top log-probabilities a row reports)
    settings = [row(jnp.float32), row(jnp.int32), row(jnp.float32), row(jnp.int32)]
    prefill_inputs = [row(jnp.int32, length), row(jnp.int32), row(jnp.uint32), row(jnp.int32),
                      *settings]          # prompts, max_new_tokens, seeds, choices
    cache, treedef = jax.tree_util.tree_flatten(jax.eval_shape(
        lambda p, *inputs: sampling.prefill(model, p, *inputs)[0], params, *prefill_inputs))

    def prefill(params: Any, *inputs: jax.Array) -> tuple[Any, ...]:
      cache, first, lengths, keys, reported = sampling.prefill(model, params, *inputs)
      return jax.tree_util.tree_leaves(cache), first, lengths, keys, *reported

    def step(params: Any, cache: list[jax.Array], *inputs: jax.Array) -> tuple[Any, ...]:
      cache, drawn, reported = sampling.step(model, params, treedef.unflatten(cache), *inputs)
      return jax.tree_util.tree_leaves(cache), drawn, *reported

    def score(params: Any, texts: jax.Array, logprobs: jax.Array) -> tuple[Any, ...]:
      return sampling.score(model, params, texts, logprobs)
    step_inputs = [cache, row(jnp.int32), row(jnp.int32), row(jnp.uint32, 2), *settings]
    return {"prefill": (prefill, prefill_inputs), "step": (step, step_inputs),
            "score": (score, [row(jnp.int32, length), row(jnp.int32)]), "cache": cache}

  # ---------------------------------------------------------------- evaluation
  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    """Loss, accuracy and perplexity per token, and bits per character: the summed nll in
    bits over the characters of the text predicted (document layout: EOS's nll counts in
    too). Samples: the first rows' opening tokens continued, beside what the text says."""
    totals = teacher_forced_sums(eval_step, params, batches)
    metrics = loss_metrics(totals)
    characters = sum(len(r["text"]) for b in batches for r in b.records)
    metrics["bits_per_character"] = totals.get("nll", 0.0) / math.log(2) / max(characters, 1)
    return metrics, self._samples(params, batches, decode)

  def _samples(self, params: Any, batches: Sequence[EvalBatch], decode: DecodeOptions,
               count: int = 3, prompt_tokens: int = 32) -> Samples:
    """The first rows' opening tokens continued, beside the text; a conversation's turns
    before its first reply answered (up to the end of turn), beside that reply."""
    rows = [(b.arrays["inputs"][i], b.arrays["targets"][i], r)
            for b in batches for i, r in enumerate(b.records)][:count]
    if not rows:
      return []
    chat = "messages" in rows[0][2]
    prompts = [x[:int(np.argmax(y != PAD_ID)) + 1] if chat
               else x[:min(prompt_tokens, int((x != PAD_ID).sum()))] for x, y, _ in rows]
    turn_end = self.chat_encoder.end_of_turn if chat else None
    decode = dataclasses.replace(
        decode, max_new_tokens=min(decode.max_new_tokens, self.model_config.max_len // 2))
    outputs = self.continue_prompts(params, prompts, decode,
                                    () if turn_end is None else (turn_end,))
    samples = []
    for prompt, (_, _, record), output in zip(prompts, rows, outputs):
      shown = self.tokenizer.decode(prompt)
      reference = ((assistant_texts(record["messages"]) or [""])[0] if chat
                   else record["text"][len(shown):len(shown) + len(output)])
      samples.append((escape_line(shown), escape_line(output), escape_line(reference)))
    return samples

  def eval_windows(self, records: Sequence[dict], batch_size: int, length: int,
                   limit: int = 0) -> list[PipelineBatch]:
    """The "stream" layout's evaluation: the split's stream in consecutive windows of
    `length`, every token predicted once (the first `limit` windows if > 0)."""
    stream = self.token_stream(records)
    count = -(-len(stream) // length)
    count = min(count, limit) if limit > 0 else count
    batches = []
    for start in range(0, count, batch_size):
      windows = [self.stream_window(stream, i, length)
                 for i in range(start, min(start + batch_size, count))]
      arrays = {k: np.stack([w[k] for w in windows]
                            + [np.zeros(length, np.int32)] * (batch_size - len(windows)))
                for k in windows[0]}
      texts = [{"text": self.tokenizer.decode(w["targets"][w["targets"] != PAD_ID])}
               for w in windows]
      batches.append(PipelineBatch(arrays, texts))
    return batches
