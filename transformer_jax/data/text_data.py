"""Real-text task data: a corpus, its tokenizer(s) and the Grain pipeline, behind the same
interface as the synthetic tasks (tokenizer, target_tokenizer, labels, train_iterator,
eval_batches).

Every split is read and checked first. Tokenizers are then trained on the training split at
the first run and saved in the workdir (`vocab.json`, plus `target_vocab.json` when source
and target vocabularies are separate) with a record of what they were trained from
(`tokenizer_identity.json`); a resumed run loads them from there (the trainer refuses
them if that record differs), and `predict` reads the copy in the checkpoint. Class or tag
names go to `labels.json`. Every file is written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax.data import pipeline
from transformer_jax.data.corpus import Corpus
from transformer_jax.data.tokenizer import (
  TARGET_VOCAB_FILE,
  VOCAB_FILE,
  CharVocab,
  SentencePieceTokenizer,
  WordVocab,
  load_tokenizer,
)
from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json
from transformer_jax.options import DataOptions

LABELS_FILE = "labels.json"
IDENTITY_FILE = "tokenizer_identity.json"   # what the workdir's tokenizer was trained from


def _training_sample(records: Sequence[dict], limit: int, seed: int) -> Iterator[dict]:
  """All records, or a seeded random `limit` of them (tokenizers need no more on big
  corpora)."""
  indices = range(len(records))
  if 0 < limit < len(records):
    indices = sorted(np.random.default_rng(seed).choice(len(records), limit, replace=False))
  for i in indices:
    yield records[int(i)]


class TokenizerTraining(Protocol):
  """What tokenizer training needs of a task class (transformer_jax.tasks.Task has it)."""
  name: str
  tokenizer_kinds: tuple[str, ...]
  has_target_text: bool

  @classmethod
  def tokenizer_texts(cls, record: dict) -> tuple[str | list[str], str | None]: ...


def _train_tokenizers(task: TokenizerTraining, corpus: Corpus, config: DataOptions,
                      seed: int) -> tuple[Any, Any]:
  name = config.tokenizer
  config.check_tokenizer_for(task.name, task.tokenizer_kinds)

  def texts() -> Iterator[tuple[str | list[str], str | None]]:
    for record in _training_sample(corpus.split(config.train_split),
                                   config.tokenizer_max_examples, seed):
      yield task.tokenizer_texts(record)

  if name in ("byte_bpe", "hf_tokenizer"):
    family = "GPT-2's tokenizer" if name == "byte_bpe" else "a Hugging Face tokenizer"
    raise UserError(f"data.tokenizer={name!r} is {family}, read from a pretrained model, not "
                    "trained here: set init_from to an import of one (python -m "
                    "transformer_jax.convert --from=hf_gpt2 or --from=hf_llama)")
  if name == "chars":
    return (CharVocab.build(s for s, _ in texts()),) * 2
  if name == "words":
    vocab = WordVocab.build((s if isinstance(s, list) else s.split() for s, _ in texts()),
                            min_count=config.min_word_count)
    return vocab, vocab

  def spm(pieces: Iterator[str]) -> SentencePieceTokenizer:
    return SentencePieceTokenizer.train(pieces, config.vocab_size,
                                        model_type=config.spm_model_type)
  if not task.has_target_text:
    tokenizer = spm(s for s, _ in texts())
    return tokenizer, tokenizer
  if config.shared_vocab:
    tokenizer = spm(text for pair in texts() for text in pair)
    return tokenizer, tokenizer
  return spm(s for s, _ in texts()), spm(t for _, t in texts())


# Data-config fields that change what tokenizer training produces.
_TOKENIZER_SETTINGS = ("tokenizer", "vocab_size", "spm_model_type", "shared_vocab",
                       "min_word_count", "tokenizer_max_examples", "train_split")
_TEXT_SETTINGS = {"br_tags": "keep", "text_of": "", "extra_text": ""}   # field: its default


def tokenizer_identity(task: TokenizerTraining, corpus: Corpus, config: DataOptions,
                       seed: int) -> dict[str, Any]:
  """What a tokenizer is trained from: the task, the training split's origin (file names and
  sizes, or the TFDS dataset) and the tokenizer settings (with the seed when sampling), and
  a hash of all that."""
  settings = {k: getattr(config, k) for k in _TOKENIZER_SETTINGS}
  if config.tokenizer_max_examples > 0:
    settings["seed"] = seed
  # Later settings that change the text, recorded only when set: earlier workdirs still match.
  settings.update({k: getattr(config, k) for k, unset in _TEXT_SETTINGS.items()
                   if getattr(config, k) != unset})
  identity = {"task": task.name, "training_data": corpus.origin(config.train_split),
              "settings": settings}
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
  return {"hash": digest, **identity}


def _check_identity(workdir: str, expected: dict[str, Any]) -> None:
  """Refuses the workdir's tokenizer if it was trained from other data or settings. A
  workdir without the record (written by an older version) is trusted."""
  path = os.path.join(workdir, IDENTITY_FILE)
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  if saved.get("hash") == expected["hash"]:
    return
  differing = [k for k in ("task", "training_data", "settings") if saved.get(k) != expected[k]]
  detail = "; ".join(f"{k}: saved {saved.get(k)} -> now {expected[k]}" for k in differing)
  raise UserError(f"the tokenizer in {workdir} was trained on other data or settings than "
                  f"this config gives ({detail}); to start fresh use a new --workdir, or "
                  f"delete {VOCAB_FILE}, {TARGET_VOCAB_FILE}, their .model files, "
                  f"{IDENTITY_FILE} and checkpoints/ from {workdir}")


def load_or_train_tokenizers(task: TokenizerTraining, corpus: Corpus, config: DataOptions,
                             seed: int,
                             workdir: str | None,
                             given: tuple[Any, Any] | None = None,
                             check_identity: bool = False) -> tuple[Any, Any, str]:
  """(source tokenizer, target tokenizer, what happened). Reuses the workdir's saved
  tokenizers (with check_identity, only if they were made for the same data and settings:
  others are refused); else takes the `given` ones (a pretrained model's) or trains on the
  training split, and saves them there with that identity (process 0 trains, the other
  hosts wait and load)."""
  paths = None
  hosts = jax.process_count() > 1
  if workdir:
    identity = tokenizer_identity(task, corpus, config, seed)
    paths = (os.path.join(workdir, VOCAB_FILE), os.path.join(workdir, TARGET_VOCAB_FILE))
    saved = os.path.exists(paths[0])
    if hosts:   # every host has looked before process 0 may write: all take the same branch
      multihost_utils.sync_global_devices("tokenizer looked for")
    if saved:
      if check_identity:
        _check_identity(workdir, identity)
      source = load_tokenizer(paths[0])
      target = load_tokenizer(paths[1]) if os.path.exists(paths[1]) else source
      return source, target, f"loaded from {paths[0]}"
  make = (lambda: given) if given else (lambda: _train_tokenizers(task, corpus, config, seed))
  if hosts and paths:
    if jax.process_index() == 0:
      _save(*make(), paths, identity)
    multihost_utils.sync_global_devices("tokenizer saved")
    return load_or_train_tokenizers(task, corpus, config, seed, workdir, given, check_identity)
  source, target = make()
  if paths:
    _save(source, target, paths, identity)
  where = f", saved to {paths[0]}" if paths else ""
  origin = "the pretrained model's" if given else f"trained on the {config.train_split} split"
  return source, target, origin + where


def _save(source: Any, target: Any, paths: tuple[str, str], identity: dict[str, Any]) -> None:
  """Each file atomically, the identity last: it vouches for the files before it."""
  os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
  source.save(paths[0])
  if target is not source:
    target.save(paths[1])
  atomic_write_json(os.path.join(os.path.dirname(paths[0]), IDENTITY_FILE), identity,
                    indent=2, sort_keys=True)


class TextData:
  """A corpus made ready for training: tokenizers, training batches, eval buckets."""

  def __init__(self, task: TokenizerTraining, corpus: Corpus, data_config: DataOptions, seed: int,
               workdir: str | None = None, tokenizers: tuple[Any, Any] | None = None,
               check_identity: bool = False):
    """tokenizers: a pretrained model's (init_from), used instead of training new ones.
    check_identity: refuse a workdir tokenizer made for other data or settings (the
    trainer's setup asks for it; a reader of a finished workdir need not)."""
    self.labels, self.description = corpus.labels, corpus.description
    self._corpus, self._config, self._seed = corpus, data_config, seed
    self._prepared: dict[str, tuple[Any, Sequence[dict]]] = {}   # split: (task, records)
    corpus.check_splits(data_config.split_names)   # All data read before anything is saved.
    self.tokenizer, self.target_tokenizer, origin = load_or_train_tokenizers(
        task, corpus, data_config, seed, workdir, tokenizers, check_identity)
    if workdir and self.labels is not None:
      atomic_write_json(os.path.join(workdir, LABELS_FILE), {"labels": self.labels})
    sizes = sorted({self.tokenizer.vocab_size, self.target_tokenizer.vocab_size})
    self.summary = (f"{self.description}: {len(corpus.split(data_config.train_split)):,} "
                    f"training examples; {self.tokenizer.kind} vocabulary of "
                    f"{' / '.join(f'{s:,}' for s in sizes)} ({origin})")

  def records(self, split: str) -> Sequence[dict]:
    """The records of `split`, as read."""
    return self._corpus.split(split)

  def _task_records(self, task: Any, split: str) -> Sequence[dict]:
    """The records of `split` as `task` prepares them (once; see RecordPreparing)."""
    records = self._corpus.split(split)
    if not isinstance(task, RecordPreparing):
      return records
    if split not in self._prepared or self._prepared[split][0] is not task:
      self._prepared[split] = (task, task.prepare_records(records))
    return self._prepared[split][1]

  @property
  def max_length(self) -> int:
    return max(self._config.max_length, self._config.eval_max_length)

  def train_iterator(self, task: pipeline.Featurizing, batch_size: int, *,
                     shard_index: int | None = None, shard_count: int | None = None,
                     num_epochs: int | None = None) -> pipeline.TrainIterator:
    """This host's rows of each global batch of `batch_size` rows (see
    pipeline.train_iterator; `shard_index/count` default to JAX's process index and
    count)."""
    c = self._config
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    records = self._task_records(task, c.train_split)
    if _reads_stream(task, c):
      stream = task.token_stream(records)
      window = functools.partial(task.stream_window, stream, length=c.max_length)
      return pipeline.window_iterator(
          -(-len(stream) // c.max_length), window, batch_size=batch_size, seed=self._seed,
          shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs,
          prefetch=c.prefetch)
    return pipeline.train_iterator(
        records, task,
        batch_size=batch_size, max_length=c.max_length, seed=self._seed,
        too_long=c.too_long, truncate=c.truncate, pack=c.pack, max_segments=c.max_segments,
        shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs,
        prefetch=c.prefetch)

  def eval_batches(self, task: pipeline.Featurizing, split: str, batch_size: int,
                   limit: int = 0) -> list[pipeline.EvalBatch]:
    """The first `limit` examples of `split` (all if 0), bucketed by length."""
    records = self._task_records(task, split)
    if _reads_stream(task, self._config):
      return task.eval_windows(records, batch_size, self._config.eval_max_length, limit)
    count = len(records) if limit <= 0 else min(limit, len(records))
    batches, counts = pipeline.eval_batches(
        [records[i] for i in range(count)], task, batch_size=batch_size,
        max_length=self._config.eval_max_length, truncate=self._config.truncate,
        batch_tokens=self._config.eval_batch_tokens)
    if counts.too_long:
      print(f"data: {counts.too_long} of {count} {split} examples are longer than "
            f"data.eval_max_length={self._config.eval_max_length} tokens and were truncated "
            f"(data.truncate={self._config.truncate!r})")
    return batches


@runtime_checkable
class RecordPreparing(Protocol):
  """A task that makes a split's records ready once, before its first batch (tasks/lm.py:
  each chat conversation rendered and encoded, so that one its template refuses is named
  before the first step, and no template is rendered again each epoch)."""

  def prepare_records(self, records: Sequence[dict]) -> Sequence[dict]: ...


@runtime_checkable
class StreamReading(Protocol):
  """What the "stream" layout needs of a task (tasks/lm.py provides it): the records' text
  as one stream of token ids, a window of it as a model row, evaluation windows."""

  def token_stream(self, records: Sequence[dict]) -> np.ndarray: ...
  def stream_window(self, stream: np.ndarray, index: int,
                    length: int) -> dict[str, np.ndarray]: ...
  def eval_windows(self, records: Sequence[dict], batch_size: int, length: int,
                   limit: int = 0) -> list[pipeline.EvalBatch]: ...


def _reads_stream(task: Any, config: DataOptions) -> bool:
  return config.layout == "stream" and isinstance(task, StreamReading)
