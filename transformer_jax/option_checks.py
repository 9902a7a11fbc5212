"""The base of every config group of options.py and the checks of their values: a bad value
is a one-line UserError naming the field as it is set (`group` is its prefix, "data.")."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, TypeVar

from transformer_jax.errors import UserError

O = TypeVar("O", bound="GroupOptions")


# A training example longer than data.max_length: dropped, truncated (data.truncate says
# which tokens stay), or split into consecutive pieces of max_length tokens.
TOO_LONG_POLICIES = ("drop", "truncate", "split")


def integer(group: str, name: str, value: Any, low: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    need = "a positive integer" if low == 1 else f"an integer >= {low}"
    raise UserError(f"{group}{name}={value!r}: must be {need}")


def number(group: str, name: str, value: Any, valid: Callable[[float], bool],
           need: str) -> None:
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not valid(value):
    raise UserError(f"{group}{name}={value!r}: must be {need}")


def check_choice(group: str, name: str, value: Any, choices: Sequence[str]) -> None:
  if value not in choices:
    raise UserError(f"{group}{name}={value!r}: must be one of {tuple(choices)}")


class GroupOptions:
  """A config group: `from_dict` builds it from a mapping, ignoring keys that are not its
  fields (saved configs of other versions; the group's own fields are checked here)."""
  GROUP = ""

  @classmethod
  def from_dict(cls: type[O], values: Mapping[str, Any] | None) -> O:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in dict(values or {}).items() if k in names})
