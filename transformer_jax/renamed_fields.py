"""Config field names that changed: an override of an old name fails with a message giving
the new one (train.py), and a saved config.json that uses old names (workdirs of earlier
versions) is read under the new ones (`upgrade`)."""

from __future__ import annotations

from typing import Any, Sequence

# Old name -> new name.
RENAMED_FIELDS = {
    "decode.batch_size": "eval.batch_size",
    "decode.eval_examples": "eval.examples",
    "data.eval_examples": "eval.examples",
    "decode.num_samples": "eval.num_samples",
    "pooling": "model.pooling",
    "data.task": "data.synthetic_task",
}


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
