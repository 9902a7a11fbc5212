"""Builds the data source named by the `data` config group."""

from __future__ import annotations

from typing import Any

from transformer_jax.data.synthetic import SyntheticTask

SOURCES = ("synthetic",)


def make_source(data_config: Any, seed: int) -> SyntheticTask:
  if data_config.source == "synthetic":
    return SyntheticTask(data_config.task, data_config.min_length, data_config.max_length,
                         seed)
  raise ValueError(f"data.source={data_config.source!r}: must be one of {SOURCES}")
