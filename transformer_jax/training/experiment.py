"""One run's setup, resolved once from the config and shared by training, `--eval_only` and
the AOT compiler: the task with its model config, the data, the mesh, the optimizer, and the
state's shapes and shardings.

  experiment = Experiment.create(config, workdir)          # reads the data
  state, state_sharding = experiment.init_state()
  train_step = experiment.train_step(state_sharding)

`Experiment.create(config, data=None, vocab_sizes=..., devices=...)` builds the same thing
without reading any data (for compiling ahead of time on devices that are not there).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from transformer_jax import checkpoint, lora, sharding, tasks
from transformer_jax.config import TransformerConfig
from transformer_jax.data.readers import parse_labels
from transformer_jax.data.sources import check_data_for_task, make_source, training_width
from transformer_jax.data.tokenizer import tokenizer_item
from transformer_jax.data.vocab import SPECIALS
from transformer_jax.errors import MissingFileError, UserError
from transformer_jax.modules import kernels
from transformer_jax.options import (
  DataOptions,
  DecodeOptions,
  EvalOptions,
  LoraOptions,
  RunOptions,
  TrainOptions,
)
from transformer_jax.renamed_fields import upgrade
from transformer_jax.tasks import Task
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import TrainState, new_train_state
from transformer_jax.training.steps import make_eval_step, make_train_step

# Model fields a fine-tuning run takes from its own config; every other one (the architecture)
# comes from the pretrained model named by init_from.
FINE_TUNING_FIELDS = ("dropout_rate", "attention_dropout_rate", "activation_dropout_rate",
                      "dtype", "remat_policy", "attention_impl")


def validate(options: RunOptions, task: type[Task]) -> None:
  """What each options group cannot check alone: the fields against the task, the processes
  and the data (model fields are checked by TransformerConfig, in Experiment.create, before
  any data is read)."""
  train = options.train
  if train.batch_size % jax.process_count():
    raise UserError(f"config.batch_size={train.batch_size} must be divisible by the "
                    f"number of processes ({jax.process_count()})")
  if train.keep_best_checkpoints:   # the only use of the metric: a misspelt one fails here
    names = [f"eval/{m}" for m in task.metric_names]
    if train.best_checkpoint_metric not in names:
      raise UserError(f"config.best_checkpoint_metric={train.best_checkpoint_metric!r}: a "
                      f"{task.name} task reports {', '.join(names)}")
  task.check_head(tasks.split_model_fields(task, options.model)[1],
                  None if options.data.synthetic else options.data.tokenizer)
  check_data_for_task(task, options.data)
  width = training_width(options.data)
  if options.lora.rank and not train.init_from:
    raise UserError(f"lora.rank={options.lora.rank} adapts a pretrained model: set "
                    "config.init_from to its export or checkpoint (or lora.rank=0)")
  max_len = options.model.get("max_len")
  if isinstance(max_len, int) and max_len < width:
    raise UserError(f"model.max_len={max_len} is below the {width} tokens of the "
                    "training batches (data.max_length); raise model.max_len or lower "
                    "data.max_length")


def model_config(options: Any, task: type[Task], vocab_size: int,
                 target_vocab_size: int | None = None,
                 pretrained: dict | None = None) -> tuple[TransformerConfig, dict]:
  """The config's (RunOptions, or the config they parse from) model group with the data's
  vocabulary sizes and bound on segments per row (target_vocab_size: a
  separate target vocabulary), and the task's head options. With a `pretrained` run config
  (init_from), the architecture is the pretrained model's and only FINE_TUNING_FIELDS come
  from the config; a model of another task (a pretrained encoder) gives the architecture
  and the head options that shape the encoder's parameters, the config the others."""
  options = RunOptions.parse(options)
  model = dict(options.model)
  # The packer's bound is the data's (data.max_segments): a saved run config's copy (its
  # config.json, read back by some benchmarks) is recomputed, never taken as given.
  model.pop("max_segments", None)
  bound = {"max_segments": segments_per_row(options.data, task)}
  if pretrained is not None:   # its vocabulary sizes too: the data uses its tokenizers
    saved = dict(pretrained["model"])
    if TrainOptions.from_dict(pretrained).task != task.name:
      architecture = {f.name for f in dataclasses.fields(TransformerConfig)}
      saved = {**{k: model[k] for k in task.head_options if k in model},
               **{k: v for k, v in saved.items()
                  if k in architecture or k in task.carried_head_options}}
    model = {**saved, **{k: model[k] for k in FINE_TUNING_FIELDS if k in model}}
    fields, head = tasks.split_model_fields(task, model)
    if fields["vocab_size"] != vocab_size:
      raise UserError(f"init_from: the pretrained model has {fields['vocab_size']} source "
                       f"ids but its tokenizer {vocab_size}")
    return TransformerConfig.from_dict({**fields, **bound}), head
  fields, head = tasks.split_model_fields(task, model)
  fields["vocab_size"] = vocab_size
  if target_vocab_size is not None:
    if fields.get("share_embeddings", True):   # Equal sizes or not, id i means different pieces.
      raise UserError("model.share_embeddings=True needs one vocabulary for source and "
                      "target, but data.shared_vocab=False gives two; set "
                      "--config.model.share_embeddings=False")
    fields["target_vocab_size"] = target_vocab_size
  return TransformerConfig.from_dict({**fields, **bound}), head


def segments_per_row(data: DataOptions, task: type[Task]) -> int:
  """The most sequences a training row holds (0: no bound): 1 for unpacked rows (synthetic
  data, data.pack=False, a language model's stream windows), else data.max_segments,
  which the packer enforces."""
  stream = data.layout == "stream" and hasattr(task, "stream_window")
  return 1 if data.synthetic or not data.pack or stream else data.max_segments


def check_packed_kernel(implementation: str, bound: int, platform: str) -> None:
  """cuDNN's packed layout is sized by the bound on segments per row: refuses packed rows
  without one, before any data is read."""
  if kernels.resolve(implementation, platform) == "cudnn" and bound == 0:
    raise UserError(f"model.attention_impl={implementation!r} on packed rows needs "
                    "data.max_segments > 0: cuDNN's packed layout is sized by the most "
                    "sequences a row holds (e.g. --config.data.max_segments=16)")


def _pretrained(train: TrainOptions, task: type[Task]) -> checkpoint.ModelRecord | None:
  """The model init_from names (an export, e.g. an import from Hugging Face, or a
  checkpoint), checked to be a model of the run's task."""
  path = train.init_from
  if not path:
    return None
  if not os.path.isdir(path):
    raise MissingFileError(f"init_from={path!r}: no such directory (give an export or "
                            "checkpoint directory)")
  model = checkpoint.read_record(path)
  saved = upgrade(model.config)
  saved_task = TrainOptions.from_dict(saved).task
  if saved_task != task.name and not tasks.task_class(saved_task).pretraining:
    raise UserError(f"init_from={path!r} holds a {saved_task} model; "
                     f"this run's task is {task.name}")
  return dataclasses.replace(model, config=saved)


def _check_lora(options: LoraOptions, pretrained: checkpoint.ModelRecord,
                task: type[Task]) -> None:
  """LoRA adapts a whole model of the run's task (a fresh head would have to be trained
  too), on the kernels its targets name."""
  saved_task = TrainOptions.from_dict(pretrained.config).task
  if saved_task != task.name:
    raise UserError(f"lora.rank={options.rank}: init_from={pretrained.path!r} holds a "
                    f"{saved_task} model; LoRA adapts a {task.name} model (or set lora.rank=0)")
  lora.check(options, pretrained.config.get("model", {}))


def _check_same_text_assets(pretrained: checkpoint.ModelRecord, source: Any) -> None:
  """The data must speak the pretrained model's vocabulary and labels (a workdir with other
  saved tokenizers cannot fine-tune it)."""
  theirs = tokenizer_item(pretrained.assets.tokenizer, pretrained.assets.target_tokenizer,
                          pretrained.assets.labels)
  labels = source.labels   # A pretraining model has no labels: any fit.
  if labels is None or theirs["labels"] is None:
    labels = theirs["labels"]
  ours = tokenizer_item(source.tokenizer, source.target_tokenizer, labels)
  if ours != theirs:
    raise UserError(f"init_from={pretrained.path!r}: the workdir's tokenizers or the data's "
                     "labels differ from the pretrained model's; use a fresh --workdir")


def _check_model_and_optimizer(options: RunOptions, task: type[Task]) -> None:
  """The model group and the optimizer, with stand-in vocabulary sizes (the real ones come
  from the data): their errors are the same, and come before the data is read."""
  separate_target = (not options.data.synthetic and task.has_target_text
                     and not options.data.shared_vocab)
  stand_in = 2 * len(SPECIALS)
  model_config(options, task, stand_in, stand_in if separate_target else None)


def _carry_modules(fresh: Any, saved: Any, path: str) -> tuple[Any, list[str]]:
  """`fresh` with each top-level module that `saved` also has replaced by the saved one
  (placed on the fresh one's devices), and those modules' names."""
  shared = sorted(set(fresh) & set(saved))
  for name in shared:
    shapes = [jax.tree_util.tree_map(lambda x: x.shape, tree[name]) for tree in (fresh, saved)]
    if shapes[0] != shapes[1]:
      raise UserError(f"init_from={path!r}: its {name!r} parameters do not fit this "
                      "model's; pretrain with this config's model group")
  if not shared:
    raise UserError(f"init_from={path!r}: the pretrained model shares no module with this "
                    "task's model")
  carried = {name: jax.tree_util.tree_map(lambda s, f: jax.device_put(s, f.sharding),
                                          saved[name], fresh[name]) for name in shared}
  return {**fresh, **carried}, shared


def _carried_modules(task: Task, pretrained: checkpoint.ModelRecord | None) -> list[str]:
  """The top-level modules that init_from carries from another task's model (its encoder),
  as Experiment.initial_params will: [] without one, or from a model of this run's task."""
  if pretrained is None or TrainOptions.from_dict(pretrained.config).task == task.name:
    return []
  fresh = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
  return sorted(set(fresh) & set(pretrained.modules))


@dataclasses.dataclass
class Experiment:
  """Everything a run derives from its config before the first step."""
  options: RunOptions
  task: Task
  data: Any | None            # data/sources.py; None when built without data
  mesh: Mesh
  schedule: optax.Schedule
  optimizer: optax.GradientTransformation
  pretrained: checkpoint.ModelRecord | None = None   # what init_from names

  @classmethod
  def create(cls, config: Any, workdir: str | None = None, *,
             data: bool = True, vocab_sizes: tuple[int, int | None] | None = None,
             labels: Sequence[str] | None = None, devices: Sequence[Any] | None = None,
             mesh: Mesh | None = None) -> "Experiment":
    """Validates the config, then builds the data (tokenizers trained or reloaded in the
    workdir) and the rest. With data=False nothing is read: the vocabulary sizes are
    `vocab_sizes` (source, separate target or None) and the label names `labels` or
    data.labels. `devices`: the mesh's devices (default: all of this process's backend);
    `mesh`: a ready mesh instead of config.mesh over them (aot's layout sweep). `config`:
    the ml_collections config (or RunOptions already parsed from one)."""
    options = RunOptions.parse(config)
    task_cls = tasks.task_class(options.train.task)
    # Every config field and the mesh first: reading data and training a tokenizer can take
    # minutes, and nothing may be written to the workdir for a config that cannot run.
    validate(options, task_cls)
    train = options.train
    if mesh is None:
      mesh = sharding.make_mesh(options.mesh.sizes(), list(devices) if devices else None)
    sharding.check_batch_fits(train.batch_size // train.grad_accum_steps, mesh,
                              "batch_size/grad_accum_steps")
    _check_model_and_optimizer(options, task_cls)
    defaults = TransformerConfig.__dataclass_fields__
    kernels.check_dropout(
        options.model.get("attention_impl", defaults["attention_impl"].default),
        options.model.get("attention_dropout_rate", defaults["attention_dropout_rate"].default),
        on=mesh.devices.flat[0].platform)
    check_packed_kernel(
        options.model.get("attention_impl", defaults["attention_impl"].default),
        segments_per_row(options.data, task_cls), mesh.devices.flat[0].platform)
    kernels.check_window(
        options.model.get("attention_impl", defaults["attention_impl"].default),
        options.model.get("sliding_window", defaults["sliding_window"].default),
        on=mesh.devices.flat[0].platform)
    pretrained = _pretrained(train, task_cls)
    if options.lora.rank and pretrained:
      _check_lora(options.lora, pretrained, task_cls)
    source = None
    if data:
      given = pretrained and (pretrained.assets.tokenizer, pretrained.assets.target_tokenizer)
      source = make_source(task_cls, options.data, train.seed, workdir, given)
      if pretrained:
        _check_same_text_assets(pretrained, source)
      if jax.process_index() == 0:
        print(f"data: {source.summary}")
      target = source.target_tokenizer
      vocab_sizes = (source.tokenizer.vocab_size,
                     None if target is source.tokenizer else target.vocab_size)
      labels = source.labels
    elif vocab_sizes is None:
      raise UserError("without data, give the vocabulary sizes")
    elif labels is None and task_cls.needs_labels:
      labels = parse_labels(options.data.labels)
    model_cfg, head = model_config(options, task_cls, *vocab_sizes,
                                   pretrained=pretrained and pretrained.config)
    task = task_cls(model_cfg, tokenizer=source and source.tokenizer,
                    target_tokenizer=source and source.target_tokenizer, labels=labels,
                    label_smoothing=train.label_smoothing, head=head)
    schedule = make_schedule(options.optimizer, model_cfg.d_model, train.num_train_steps)
    optimizer = make_optimizer(options.optimizer, schedule, _carried_modules(task, pretrained))
    if options.lora.rank:   # the adapters trained, the base frozen
      optimizer = lora.freeze_base(optimizer)
    return cls(options, task, source, mesh, schedule, optimizer, pretrained)

  @property
  def train(self) -> TrainOptions:
    return self.options.train

  @property
  def decode(self) -> DecodeOptions:
    return self.options.decode

  @property
  def eval(self) -> EvalOptions:
    return self.options.eval

  @property
  def model_config(self) -> TransformerConfig:
    return self.task.model_config

  @property
  def lora(self) -> LoraOptions | None:
    """The LoRA options of a LoRA run (lora.rank > 0), else None."""
    return self.options.lora if self.options.lora.rank else None

  def resolved_config(self) -> dict[str, Any]:
    """The config as run: its model group with the vocabulary sizes and head options."""
    resolved = dict(self.options.as_given)
    resolved["model"] = {**self.model_config.to_dict(), **self.task.head}
    path = self.train.init_from
    if self.lora and "://" not in path:   # the base the checkpoints name, from any directory
      resolved["init_from"] = os.path.abspath(path)
    return resolved

  # ------------------------------------------------------------------------ state
  def _new_state(self) -> TrainState:
    params = self.task.init_params(jax.random.PRNGKey(self.train.seed))
    if self.lora:   # fresh adapters (their own key) beside the base that init_from replaces
      key = jax.random.fold_in(jax.random.PRNGKey(self.train.seed), 1)
      params = lora.adapted(params, lora.init_adapters(nn.meta.unbox(params), self.lora, key))
    return new_train_state(params, self.optimizer, self.train.seed)

  def init_state(self) -> tuple[TrainState, Any]:
    """The initial state, created under jit in its final shardings (no device ever holds
    the whole state), and those shardings."""
    return sharding.create_sharded(self._new_state, self.mesh,
                                   shardings=self._state_shardings())

  def _state_shardings(self) -> Any:
    """The rules' shardings of the state; with mesh.shard_optimizer_state, the optimizer
    state further split over the data axis."""
    boxed = jax.eval_shape(self._new_state)
    shardings = sharding.shardings_for(boxed, self.mesh)
    if not self.options.mesh.shard_optimizer_state:
      return shardings
    return shardings.replace(opt_state=sharding.split_over_data(
        shardings.opt_state, boxed.opt_state))

  def abstract_state(self) -> tuple[TrainState, Any]:
    """The state's shapes and dtypes with their shardings (nothing allocated), and the
    shardings."""
    return sharding.abstract_sharded(self._new_state, self.mesh,
                                     shardings=self._state_shardings())

  def abstract_params(self) -> tuple[Any, Any]:
    """The parameters' shapes with shardings (what a saved model restores into)."""
    return sharding.abstract_sharded(lambda: self.task.init_params(jax.random.PRNGKey(0)),
                                     self.mesh)

  def initial_params(self, fresh: Any) -> tuple[Any, list[str]]:
    """The pretrained parameters (init_from), restored straight into their shardings (the
    state's: the same rules on the same mesh), and [] (all of them); a LoRA state's base
    (its adapters stay those of `fresh`). A model of another task (a pretraining task's)
    gives only the modules both models have (the encoder, its character features), whose
    names come second; the others stay as in `fresh`."""
    if TrainOptions.from_dict(self.pretrained.config).task == self.task.name:
      abstract, _ = self.abstract_params()
      params = checkpoint.restore_params(self.pretrained.path, abstract)
      return lora.with_base(fresh, params), []
    return _carry_modules(fresh, checkpoint.restore_params(self.pretrained.path),
                          self.pretrained.path)

  # ------------------------------------------------------------------------ steps
  def train_step(self, state_sharding: Any) -> Callable:
    """The jitted train step, `(state, global batch) -> (state, metrics)`, state donated."""
    return make_train_step(self.task, self.optimizer, self.schedule,
                           self.train.grad_accum_steps, state_sharding,
                           sharding.batch_sharding(self.mesh),
                           split_gradients_over_data=self.options.mesh.shard_optimizer_state,
                           reduce_gradients_in=self.options.mesh.reduce_gradients_in,
                           lora_options=self.lora)

  def eval_step(self, params_sharding: Any) -> Callable:
    """The jitted teacher-forced step `(params, global batch) -> sums`, of the model's
    parameters (a LoRA state's merged: `params_sharding` may be the state's)."""
    return make_eval_step(self.task, lora.base(params_sharding),
                          sharding.batch_sharding(self.mesh))

  def eval_batches(self, split: str, limit: int = 0) -> list:
    """The first `limit` examples of `split` (all if 0) in static-shape batches of
    eval.batch_size rows, checked against the model (ids and lengths)."""
    batches = self.data.eval_batches(self.task, split, self.eval.batch_size, limit)
    for batch in batches:
      self.task.check_batch(batch.arrays, f"{split} data")
    return batches
