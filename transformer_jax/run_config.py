"""The run config's schema outside the model: typed option groups read once from the
ml_collections config, and the field names that changed (old scripts and old workdirs).

Train, evaluation, predict and the AOT command pass `DecodeOptions` and `EvalOptions` down
instead of the ConfigDict, so a function's signature says which settings it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from transformer_jax.errors import UserError

# Old name -> new name. An override of an old name fails with a message giving the new one;
# a saved config.json that uses old names (workdirs of earlier versions) is read under the
# new ones.
RENAMED_FIELDS = {
    "decode.batch_size": "eval.batch_size",
    "decode.eval_examples": "eval.examples",
    "data.eval_examples": "eval.examples",
    "decode.num_samples": "eval.num_samples",
    "pooling": "model.pooling",
    "data.task": "data.synthetic_task",
}


class RenamedFieldError(UserError):
  """A config field was given by a name it no longer has."""


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How outputs are searched for: beam search (beam_size 1: greedy) with length penalty
  `alpha`, outputs up to `max_extra_length` tokens longer than the input's batch width;
  taggers decode the most likely valid BIO sequence unless `bio_constrained` is False."""
  beam_size: int = 4
  alpha: float = 0.6
  max_extra_length: int = 50
  bio_constrained: bool = True

  def __post_init__(self) -> None:
    if not isinstance(self.beam_size, int) or self.beam_size < 1:
      raise UserError(f"decode.beam_size={self.beam_size!r}: must be an integer >= 1")
    if not isinstance(self.max_extra_length, int) or self.max_extra_length < 0:
      raise UserError(f"decode.max_extra_length={self.max_extra_length!r}: must be an "
                      "integer >= 0")
    if not isinstance(self.alpha, (int, float)) or self.alpha < 0:
      raise UserError(f"decode.alpha={self.alpha!r}: must be a number >= 0")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any] | None) -> "DecodeOptions":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(values or {}).items() if k in names})


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """Periodic evaluation: the first `examples` examples of the evaluation split (0: all),
  scored teacher-forced and decoded, in batches of `batch_size` rows; `num_samples`
  (input, output, reference) triples are printed."""
  batch_size: int = 64
  examples: int = 0
  num_samples: int = 3

  def __post_init__(self) -> None:
    for name, low in (("batch_size", 1), ("examples", 0), ("num_samples", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or value < low:
        raise UserError(f"eval.{name}={value!r}: must be an integer >= {low}")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any] | None) -> "EvalOptions":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(values or {}).items() if k in names})


def renamed_overrides(argv: Sequence[str]) -> list[str]:
  """Messages for command-line overrides (`--config.a.b=V`) that use an old field name."""
  messages = []
  for arg in argv:
    if arg.startswith("--config."):
      name = arg[len("--config."):].split("=", 1)[0]
      if name in RENAMED_FIELDS:
        messages.append(f"--config.{name} is now --config.{RENAMED_FIELDS[name]}")
  return messages


def upgrade(saved: dict[str, Any]) -> dict[str, Any]:
  """A saved run config (config.json, or one inside a checkpoint) with old field names moved
  to their new ones; the new name wins where both are present."""
  upgraded = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
  for old, new in RENAMED_FIELDS.items():
    old_group, _, old_key = old.rpartition(".")
    source = upgraded.get(old_group, {}) if old_group else upgraded
    if not isinstance(source, dict) or old_key not in source:
      continue
    value = source.pop(old_key)
    new_group, _, new_key = new.rpartition(".")
    target = upgraded.setdefault(new_group, {}) if new_group else upgraded
    target.setdefault(new_key, value)
  return upgraded
