"""The run config's schema: every config group as a frozen, typed options object with its
defaults and its validation (one-line UserErrors naming the field), read once from the
ml_collections config by `RunOptions.from_config` (field names that changed: renamed_fields.py).

This is the only module that reads a ConfigDict. Below the setup, a function takes the
options object it reads: `make_optimizer(OptimizerOptions)`, `make_source(task, DataOptions)`,
tasks and data readers the `DataOptions`, decoding the `DecodeOptions`. The `model` group is
typed by `TransformerConfig` (config.py) plus the task's head options (tasks/), since its
vocabulary sizes come from the data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Sequence

from transformer_jax.errors import UserError
from transformer_jax.option_checks import TOO_LONG_POLICIES, check_choice
from transformer_jax.option_checks import GroupOptions as _Options
from transformer_jax.option_checks import integer as _integer
from transformer_jax.option_checks import number as _number
from transformer_jax.option_groups import (  # noqa: F401  (re-exported: the schema's groups)
  LORA_TARGETS,
  PRETRAIN_OBJECTIVES,
  LoraOptions,
  PretrainOptions,
)
from transformer_jax.renamed_fields import upgrade

DATA_SOURCES = ("synthetic", "local", "tfds")
# The generated tasks of data/synthetic.py. The list lives here, with the other choices the
# schema checks, so that the schema need not import the data package (which imports it).
SYNTHETIC_TASKS = ("reverse", "sort", "add")
TOKENIZERS = ("sentencepiece", "words", "chars", "byte_bpe", "hf_tokenizer")  # last 2: imports
# How a language model reads its files (tasks/lm.py): the split as one token stream cut into
# windows of max_length, its paragraphs as packed documents, or JSONL chat conversations.
TEXT_LAYOUTS = ("stream", "documents", "chat")
TRUNCATIONS = ("head", "tail", "head_tail")   # which tokens a truncated example keeps
SCHEDULES = ("rsqrt", "warmup_cosine", "constant")
OPTIMIZERS = ("adam", "adamw", "muon")
NONFINITE_POLICIES = ("stop", "skip")


def check_synthetic(task: str, min_length: int, max_length: int) -> None:
  """A synthetic task's name and its digits per example (also checked by SyntheticData)."""
  if task not in SYNTHETIC_TASKS:
    raise UserError(f"data.synthetic_task={task!r}: must be one of {SYNTHETIC_TASKS}")
  if not 1 <= min_length <= max_length:
    raise UserError(f"data.min_length={min_length}, data.max_length={max_length}: need "
                    "1 <= min_length <= max_length")


REDUCTION_DTYPES = ("auto", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class DecodeOptions(_Options):
  """How outputs are searched for: beam search (beam_size 1: greedy) with length penalty
  `alpha`, outputs up to `max_extra_length` tokens longer than the input's batch width;
  taggers decode the most likely valid BIO sequence unless `bio_constrained` is False."""
  beam_size: int = 4
  alpha: float = 0.6
  max_extra_length: int = 50
  bio_constrained: bool = True
  # A language model's sampling (sampling.py): `max_new_tokens` at `temperature` (0: greedy)
  # from the `top_k` likeliest tokens (0: all) within the `top_p` nucleus; `seed` fixes draws.
  max_new_tokens: int = 200
  temperature: float = 0.8
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self) -> None:
    for name, low in (("beam_size", 1), ("max_extra_length", 0), ("max_new_tokens", 1),
                      ("top_k", 0), ("seed", 0)):
      _integer("decode.", name, getattr(self, name), low)
    _number("decode.", "alpha", self.alpha, lambda v: v >= 0, "a number >= 0")
    _number("decode.", "temperature", self.temperature, lambda v: v >= 0, ">= 0 (0: greedy)")
    _number("decode.", "top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1] (1: no cut)")


@dataclasses.dataclass(frozen=True)
class EvalOptions(_Options):
  """Periodic evaluation: the first `examples` of the evaluation split (0: all), scored and
  decoded in batches of `batch_size` rows; `num_samples` (input, output, reference) printed."""
  batch_size: int = 64
  examples: int = 0
  num_samples: int = 3

  def __post_init__(self) -> None:
    for name, low in (("batch_size", 1), ("examples", 0), ("num_samples", 0)):
      _integer("eval.", name, getattr(self, name), low)


@dataclasses.dataclass(frozen=True)
class DataOptions(_Options):
  """Where the examples come from and how they are tokenized and batched (synthetic tasks read
  the first four fields; configs/default.py `text_data` documents each field)."""
  source: str = "synthetic"                 # synthetic | local | tfds
  synthetic_task: str = "reverse"           # synthetic: reverse | sort | add
  min_length: int = 2                       # synthetic: digits per example
  max_length: int = 64                      # training: tokens per packed row and example
  dir: str = ""                             # local: the data folder
  name: str = ""                            # tfds: dataset name
  tfds_data_dir: str = ""
  download: bool = False
  source_language: str = ""
  target_language: str = ""
  labels: str = ""                          # class or tag names, comma-separated
  train_split: str = "train"
  eval_split: str = ""                      # "": "eval" for synthetic data, else "validation"
  test_split: str = ""
  tokenizer: str = "sentencepiece"
  vocab_size: int = 8000
  shared_vocab: bool = True
  spm_model_type: str = "unigram"
  tokenizer_max_examples: int = 0
  min_word_count: int = 2
  too_long: str = "drop"
  truncate: str = "head"
  br_tags: str = "keep"                     # classification: "<br />" kept, or a "space"
  text_of: str = ""                         # mlm: the task whose files hold the text
  extra_text: str = ""                      # mlm: a file of one text per line, added to train
                                           # (a name in dir, or a path from dir or absolute)
  layout: str = "stream"                    # lm: "stream", "documents", "chat" (TEXT_LAYOUTS)
  pack: bool = True
  max_segments: int = 0
  eval_max_length: int = 128
  eval_batch_tokens: int = 0                # evaluation: rows x length bound (0: rows only)
  prefetch: int = 2

  def __post_init__(self) -> None:
    check_choice("data.", "source", self.source, DATA_SOURCES)
    if not self.eval_split:
      object.__setattr__(self, "eval_split",
                         "eval" if self.source == "synthetic" else "validation")
    _integer("data.", "max_length", self.max_length, 1)
    if self.synthetic:
      check_synthetic(self.synthetic_task, self.min_length, self.max_length)
      return
    _integer("data.", "eval_max_length", self.eval_max_length, 1)
    check_choice("data.", "too_long", self.too_long, TOO_LONG_POLICIES)
    check_choice("data.", "truncate", self.truncate, TRUNCATIONS)
    check_choice("data.", "br_tags", self.br_tags, ("keep", "space"))
    _integer("data.", "eval_batch_tokens", self.eval_batch_tokens, 0)
    check_choice("data.", "tokenizer", self.tokenizer, TOKENIZERS)
    check_choice("data.", "layout", self.layout, TEXT_LAYOUTS)

  @property
  def synthetic(self) -> bool:
    return self.source == "synthetic"

  @property
  def split_names(self) -> list[str]:
    """The splits a run reads: train, eval and the test split if one is named."""
    return list(dict.fromkeys(s for s in (self.train_split, self.eval_split, self.test_split)
                              if s))

  def check_tokenizer_for(self, task_name: str, kinds: Sequence[str]) -> None:
    """The tokenizer must be one the task can use (`kinds`: the task's tokenizer_kinds)."""
    if not self.synthetic and self.tokenizer not in kinds:
      raise UserError(f"data.tokenizer={self.tokenizer!r} does not fit a {task_name} task: "
                      f"use {' or '.join(repr(k) for k in kinds)}")


@dataclasses.dataclass(frozen=True)
class OptimizerOptions(_Options):
  """Adam, AdamW (paper: Adam(0.9, 0.98, 1e-9)) or Muon (the hidden matrices at
  `muon_learning_rate` with `muon_momentum`, orthogonalised in `muon_ns_steps` Newton-Schulz
  iterations, Adam for the rest; training/optimizers.py) on
  a schedule peaking at `learning_rate`
  (rsqrt with learning_rate <= 0: the paper's peak), gradients clipped to global norm
  `clip_grad_norm` (0: off). `pretrained_rate_scale`: init_from a pretrained encoder, the
  carried modules learn at this fraction of the fresh head's rate."""
  name: str = "adam"
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  weight_decay: float = 0.0
  schedule: str = "rsqrt"
  learning_rate: float = 0.0
  warmup_steps: int = 4000
  clip_grad_norm: float = 0.0
  end_learning_rate: float = 0.0       # warmup_cosine: the rate at the last step
  decay_matrices_only: bool = False    # adamw: no decay of vectors (biases, norm scales)
  pretrained_rate_scale: float = 1.0
  muon_learning_rate: float = 0.02     # muon: the hidden matrices' peak rate
  muon_momentum: float = 0.9           # muon: its momentum (Nesterov; 0.9 beat 0.95, 0.85)
  muon_ns_steps: int = 5               # muon: Newton-Schulz iterations per update (optax's)

  def __post_init__(self) -> None:
    check_choice("optimizer.", "name", self.name, OPTIMIZERS)
    _number("optimizer.", "muon_learning_rate", self.muon_learning_rate, lambda v: v > 0,
            "a number > 0")
    _number("optimizer.", "muon_momentum", self.muon_momentum, lambda v: 0 <= v < 1,
            "in [0, 1)")
    _integer("optimizer.", "muon_ns_steps", self.muon_ns_steps, 1)
    if not 0 < self.pretrained_rate_scale <= 1:
      raise UserError(f"optimizer.pretrained_rate_scale={self.pretrained_rate_scale}: must "
                      "be in (0, 1] (a fraction of the head's rate)")
    check_choice("optimizer.", "schedule", self.schedule, SCHEDULES)
    _integer("optimizer.", "warmup_steps", self.warmup_steps, 0)
    if self.schedule == "rsqrt" and self.warmup_steps < 1:
      raise UserError("optimizer.warmup_steps must be >= 1 for the rsqrt schedule")
    _number("optimizer.", "end_learning_rate", self.end_learning_rate,
            lambda v: 0 <= v <= max(self.learning_rate, 0), f"in [0, {self.learning_rate}]")
    if self.schedule != "rsqrt" and not self.learning_rate > 0:
      raise UserError(f"optimizer.learning_rate={self.learning_rate}: must be > 0 for "
                      f"schedule {self.schedule!r}")


@dataclasses.dataclass(frozen=True)
class MeshOptions(_Options):
  """Devices per mesh axis (sharding.py; -1: those the others leave). `shard_optimizer_state`:
  ZeRO-1 (sharding.split_over_data). `reduce_gradients_in`: "auto" (XLA sums the replicas'
  gradients in the backward matmuls' dtype) or a dtype each replica's gradient is summed in
  explicitly (the MLPerf TPU Transformer's bfloat16 reduction; fsdp = tensor = 1 only)."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  shard_optimizer_state: bool = False
  reduce_gradients_in: str = "auto"

  def __post_init__(self) -> None:
    check_choice("mesh.", "reduce_gradients_in", self.reduce_gradients_in, REDUCTION_DTYPES)
    if self.reduce_gradients_in != "auto" and (self.fsdp, self.tensor) != (1, 1):
      raise UserError(f"mesh.reduce_gradients_in={self.reduce_gradients_in!r} sums replicas "
                      f"of whole gradients: it needs mesh.fsdp=1 and mesh.tensor=1, not "
                      f"{self.fsdp} and {self.tensor} (or keep reduce_gradients_in='auto')")

  def sizes(self) -> dict[str, int]:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclasses.dataclass(frozen=True)
class DistributedOptions(_Options):
  """Multi-host: `initialize` starts jax.distributed (the cluster read from the environment
  on Cloud TPU/SLURM, or given by coordinator_address, num_processes and process_id)."""
  initialize: bool = False
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1


_POSITIVE_FIELDS = ("num_train_steps", "log_every_steps", "eval_every_steps",
                    "checkpoint_every_steps", "keep_checkpoints", "batch_size",
                    "grad_accum_steps")


@dataclasses.dataclass(frozen=True)
class TrainOptions(_Options):
  """The top-level fields: the task, the training length and batch, logging, evaluation and
  checkpoint cadence, which checkpoints are kept, averaged or ranked, and fine-tuning."""
  task: str = "seq2seq"
  seed: int = 0
  num_train_steps: int = 2400
  log_every_steps: int = 100
  eval_every_steps: int = 1200
  checkpoint_every_steps: int = 600
  keep_checkpoints: int = 3
  average_checkpoints: int = 0
  keep_best_checkpoints: int = 0
  best_checkpoint_metric: str = ""
  best_checkpoint_mode: str = "max"
  batch_size: int = 64
  grad_accum_steps: int = 1
  label_smoothing: float = 0.1
  nonfinite: str = "stop"
  init_from: str = ""

  def __post_init__(self) -> None:
    for field in _POSITIVE_FIELDS:
      _integer("config.", field, getattr(self, field), 1)
    if self.batch_size % self.grad_accum_steps:
      raise UserError(f"config.batch_size={self.batch_size} must be divisible by "
                      f"config.grad_accum_steps={self.grad_accum_steps}")
    check_choice("config.", "nonfinite", self.nonfinite, NONFINITE_POLICIES)
    _integer("config.", "keep_best_checkpoints", self.keep_best_checkpoints, 0)
    check_choice("config.", "best_checkpoint_mode", self.best_checkpoint_mode, ("max", "min"))
    _integer("config.", "average_checkpoints", self.average_checkpoints, 0)
    average = self.average_checkpoints
    if average > self.keep_checkpoints:
      raise UserError(f"config.average_checkpoints={average} needs that many checkpoints "
                      f"kept: raise config.keep_checkpoints={self.keep_checkpoints} to {average}")
    saves = -(-self.num_train_steps // self.checkpoint_every_steps)  # the last step saves
    if average > saves:
      raise UserError(f"config.average_checkpoints={average}: only {saves} checkpoints are "
                      f"saved in {self.num_train_steps} steps; lower "
                      f"config.checkpoint_every_steps={self.checkpoint_every_steps}")
    _number("", "label_smoothing", self.label_smoothing, lambda v: 0 <= v < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """A whole run config, parsed: the top-level fields (`train`), each group, the `model`
  group as given (TransformerConfig fields plus the task's head options), and `as_given`,
  the config as a plain dict (what config.json and checkpoints record)."""
  train: TrainOptions
  data: DataOptions
  model: Mapping[str, Any]
  optimizer: OptimizerOptions
  decode: DecodeOptions
  eval: EvalOptions
  mesh: MeshOptions
  distributed: DistributedOptions
  pretrain: PretrainOptions
  lora: LoraOptions
  as_given: Mapping[str, Any]

  GROUPS: ClassVar[dict[str, type[_Options]]] = {
      "data": DataOptions, "optimizer": OptimizerOptions, "decode": DecodeOptions,
      "eval": EvalOptions, "mesh": MeshOptions, "distributed": DistributedOptions,
      "pretrain": PretrainOptions, "lora": LoraOptions}

  @classmethod
  def from_config(cls, config: Any) -> "RunOptions":
    """From an ml_collections ConfigDict (or a plain dict: a saved config, read under the
    current field names)."""
    live = hasattr(config, "to_dict")
    given = upgrade(config.to_dict() if live else dict(config))
    if live:   # A config file's misspelt field would otherwise be ignored.
      _check_known_fields(given)
    groups = {name: option.from_dict(given.get(name)) for name, option in cls.GROUPS.items()}
    return cls(train=TrainOptions.from_dict(given), model=dict(given.get("model", {})),
               as_given=given, **groups)  # type: ignore[arg-type]

  @classmethod
  def parse(cls, config: Any) -> "RunOptions":
    """`config` parsed (an ml_collections ConfigDict or a saved dict), or returned as it is
    if it already is RunOptions: what commands and the setup accept."""
    return config if isinstance(config, RunOptions) else cls.from_config(config)

  def with_batch_size(self, batch_size: int) -> "RunOptions":
    """The same run with another global batch (aot's planning searches)."""
    return dataclasses.replace(
        self, train=dataclasses.replace(self.train, batch_size=batch_size),
        as_given={**self.as_given, "batch_size": batch_size})


def _check_known_fields(given: Mapping[str, Any]) -> None:
  top = {f.name for f in dataclasses.fields(TrainOptions)} | set(RunOptions.GROUPS) | {"model"}
  unknown = [f"config.{k}" for k in given if k not in top]
  for name, group in RunOptions.GROUPS.items():
    fields = {f.name for f in dataclasses.fields(group)}  # type: ignore[arg-type]
    unknown += [f"config.{name}.{k}" for k in dict(given.get(name) or {}) if k not in fields]
  if unknown:
    raise UserError(f"unknown config field(s) {', '.join(unknown)}: not options of this "
                    "version (the config groups are in transformer_jax/options.py)")
