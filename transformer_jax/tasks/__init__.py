"""Tasks by name: each owns its records, featurizing, model, loss, metrics and predict
(see tasks/base.py for the protocol). Adding a task means a module here, an entry in
TASKS, and a config."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from transformer_jax.config import TransformerConfig
from transformer_jax.errors import UserError
from transformer_jax.options import TrainOptions
from transformer_jax.tasks.base import EvalBatch, Task
from transformer_jax.tasks.classification import ClassificationTask
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.tasks.mlm import MaskedLMTask
from transformer_jax.tasks.rtd import ReplacedTokenDetectionTask
from transformer_jax.tasks.seq2seq import Seq2SeqTask
from transformer_jax.tasks.tagging import TaggingTask

# The translation task's earlier name, which outside code imports (../shared/bench's
# side-by-side harness with Flax's WMT model: `from transformer_jax.tasks import TranslationTask`).
TranslationTask = Seq2SeqTask

TASKS: dict[str, type[Task]] = {
    t.name: t for t in (Seq2SeqTask, ClassificationTask, TaggingTask, MaskedLMTask,
                        ReplacedTokenDetectionTask, LanguageModelTask)}


def task_class(name: str) -> type[Task]:
  if name not in TASKS:
    raise UserError(f"task={name!r}: must be one of {', '.join(TASKS)}")
  return TASKS[name]


def split_model_fields(task: type[Task],
                       model: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """The config's `model` group as (TransformerConfig fields, the task's head options)."""
  fields = {k: v for k, v in model.items() if k not in task.head_options}
  head = {k: model.get(k, default) for k, default in task.head_options.items()}
  return fields, head


def from_run_config(run_config: Mapping[str, Any], *, tokenizer: Any = None,
                    target_tokenizer: Any = None,
                    labels: Sequence[str] | None = None) -> Task:
  """The task a saved run config (config.json, or one inside a checkpoint) describes, with
  its model config, for evaluation and inference (no label smoothing)."""
  cls = task_class(TrainOptions.from_dict(run_config).task)
  fields, head = split_model_fields(cls, run_config["model"])
  return cls(TransformerConfig.from_dict(fields), tokenizer=tokenizer,
             target_tokenizer=target_tokenizer, labels=labels, head=head)


__all__ = ["TASKS", "Task", "EvalBatch", "Seq2SeqTask", "TranslationTask", "ClassificationTask",
           "TaggingTask", "MaskedLMTask", "LanguageModelTask", "ReplacedTokenDetectionTask",
           "task_class", "split_model_fields", "from_run_config"]
