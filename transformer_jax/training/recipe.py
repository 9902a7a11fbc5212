"""Self-pretraining, then fine-tuning: what `python train.py` runs for a config whose
`pretrain` group is enabled (options.PretrainOptions).

  W/pretrain/   stage 1: the task pretrain.objective names on the run's training text: a
                masked language model ("mlm") or replaced-token detection ("rtd"), with
                the vocabulary trained there (`pretraining_config` derives its config)
  W/            stage 2: the run's own task with init_from=W/pretrain/checkpoints/<last>:
                the encoder and vocabulary carried over, the head fresh

Each stage is an ordinary run in its workdir, so the same command again resumes whichever
stage is unfinished, and `predict --workdir W` serves the fine-tuned model. The stages can
also be run apart: the pretraining config alone (configs/sst2_pretrain.py), then the task's
config with --config.init_from=W/pretrain/checkpoints/<last>.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from typing import Any, Mapping

import jax
from jax.experimental.multihost_utils import sync_global_devices

from transformer_jax import checkpoint, tasks
from transformer_jax.config import TransformerConfig
from transformer_jax.errors import UserError
from transformer_jax.options import PretrainOptions, RunOptions
from transformer_jax.training.experiment import validate
from transformer_jax.training.loop import CONFIG_FILE, start_distributed, train_and_evaluate

PRETRAIN_DIR = "pretrain"
_EVAL_EXAMPLES = 1000   # the pretraining evaluation needs no more than this many texts
# Head options of the stage's task that its `pretrain` fields of the same name set.
_STAGE_HEAD_OPTIONS = ("mask_rate", "discriminator_weight")


def pretraining_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
  """The run that pretrains the encoder of `run_config` (a classification or tagging run
  config, as a plain dict) on the text of its training split, as the task
  pretrain.objective names ("mlm" or "rtd"): the same encoder, data files and tokenizer
  settings; steps, batch, learning rate, masking rate, discriminator weight, vocabulary
  size, extra text, dropout, row length and long-text policy from its `pretrain` group."""
  config = copy.deepcopy(dict(run_config))
  pretrain = PretrainOptions.from_dict(config.get("pretrain"))
  stage_task = tasks.task_class(pretrain.objective)
  architecture = {f.name for f in dataclasses.fields(TransformerConfig)}
  model = {k: v for k, v in config["model"].items()
           if k in architecture or k in stage_task.carried_head_options}
  model.update({k: getattr(pretrain, k) for k in _STAGE_HEAD_OPTIONS
                if k in stage_task.head_options})
  model.update(word_dropout=0.0,    # masking does its work
               dropout_rate=pretrain.dropout_rate,
               attention_dropout_rate=pretrain.attention_dropout_rate)
  data = {**config["data"], "text_of": config["task"], "extra_text": pretrain.extra_text,
          "test_split": ""}   # a test split is read once per reported configuration
  if pretrain.vocab_size:
    data["vocab_size"] = pretrain.vocab_size
  if pretrain.max_length:   # rows and evaluation at the stage's length
    data["max_length"] = data["eval_max_length"] = pretrain.max_length
  if pretrain.too_long:
    data["too_long"] = pretrain.too_long
  optimizer = {**config["optimizer"], "warmup_steps": pretrain.warmup_steps}
  if pretrain.learning_rate:
    optimizer["learning_rate"] = pretrain.learning_rate
  steps = pretrain.num_train_steps
  examples = config.get("eval", {}).get("examples", 0)
  config.update(
      task=stage_task.name, init_from="", num_train_steps=steps,
      batch_size=pretrain.batch_size or config["batch_size"], label_smoothing=0.0,
      eval_every_steps=min(config["eval_every_steps"], steps),
      checkpoint_every_steps=min(config["checkpoint_every_steps"], steps), keep_checkpoints=2,
      average_checkpoints=0, keep_best_checkpoints=0, best_checkpoint_metric="eval/loss",
      best_checkpoint_mode="min", model=model, data=data, optimizer=optimizer,
      eval={**config.get("eval", {}),
            "examples": min(examples, _EVAL_EXAMPLES) if examples else _EVAL_EXAMPLES},
      pretrain={**config.get("pretrain", {}), "enabled": False})
  return config


def pretrained_path(workdir: str, num_train_steps: int) -> str | None:
  """The pretraining stage's final checkpoint in `workdir`/pretrain, if it is there."""
  directory = os.path.join(workdir, PRETRAIN_DIR, checkpoint.CHECKPOINT_DIR)
  steps = checkpoint.checkpoint_steps(directory) if os.path.isdir(directory) else []
  done = [s for s in steps if s >= num_train_steps]
  return os.path.join(directory, str(max(done))) if done else None


def _check_stage_task(workdir: str, task: str) -> None:
  """A pretraining stage already begun in the workdir must be of the objective asked for:
  resuming or fine-tuning from the other one would silently give another encoder."""
  path = os.path.join(workdir, PRETRAIN_DIR, CONFIG_FILE)
  if not os.path.exists(path):
    return
  with open(path) as f:
    begun = json.load(f).get("task")
  if begun != task:
    raise UserError(f"{os.path.dirname(path)} holds a {begun!r} pretraining stage, but "
                    f"pretrain.objective={task!r}; use a fresh --workdir (or "
                    f"--config.pretrain.objective={begun})")


def train(config: Any, workdir: str) -> dict[str, float]:
  """`train_and_evaluate`, preceded by the pretraining stage when config.pretrain.enabled
  (skipped once its final checkpoint exists). Returns the fine-tuned run's final metrics
  ({} if a stage was stopped by a signal)."""
  options = RunOptions.parse(config)
  # Multi-host: the cluster starts before the checks below touch JAX, and both stages run
  # on it (JAX joins a cluster only before its first use).
  start_distributed(options)
  if not options.pretrain.enabled:
    return train_and_evaluate(options, workdir)
  if options.train.init_from:
    raise UserError("config.init_from and pretrain.enabled both give the starting encoder: "
                    "set --config.pretrain.enabled=False to fine-tune from init_from")
  stage = RunOptions.parse(pretraining_config(options.as_given))
  # Both stages' configs are checked before either starts (the data is read by each).
  validate(options, tasks.task_class(options.train.task))
  validate(stage, tasks.task_class(stage.train.task))
  _check_stage_task(workdir, stage.train.task)
  steps = stage.train.num_train_steps
  if pretrained_path(workdir, steps) is None:
    started = time.perf_counter()
    print(f"pretraining stage ({steps} steps of {stage.train.task}) in "
          f"{workdir}/{PRETRAIN_DIR}")
    if not train_and_evaluate(stage, os.path.join(workdir, PRETRAIN_DIR)):
      return {}
    if jax.process_count() > 1:   # every host sees the final checkpoint before looking for it
      sync_global_devices(f"{workdir}/{PRETRAIN_DIR} done")
    print(f"pretraining stage took {time.perf_counter() - started:.0f} s")
  init_from = pretrained_path(workdir, steps)
  print(f"fine-tuning stage from {init_from}")
  return train_and_evaluate({**options.as_given, "init_from": init_from}, workdir)
